"""The docs say what the code does today: many ranks are here, not coming."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_page_says_many_ranks_come_next() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    stale = [
        page.name
        for page in pages
        if re.search(r"(multi-rank|many ranks|ranks)[^.]{0,40}come next", page.read_text(), re.I)
        or "one rank per job today" in page.read_text()
    ]
    assert stale == []
    assert "[Many ranks](ranks.md)" in (ROOT / "docs" / "index.md").read_text()
