"""Plain-text output: wrapped paragraphs and aligned tables."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence


def paragraphs(text: str, *, width: int = 79) -> str:
    """``text``'s paragraphs (separated by blank lines), each wrapped to ``width``."""
    blocks = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(textwrap.fill(" ".join(block.split()), width) for block in blocks)


def table(rows: Sequence[tuple[str, ...]]) -> str:
    """Rows as left-aligned columns two spaces apart; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
