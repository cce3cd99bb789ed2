"""Every ``pip install`` a user is told to type names our distribution, ``ckpt-spot``, or
installs from the clone: the name ``ckpt`` on the public index is an unrelated project's."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from ckpt.core.version import DISTRIBUTION, install_hint

ROOT = Path(__file__).resolve().parents[2]
# The bare name with extras or alone after ``pip install``: someone else's package.
WRONG = re.compile(r"(?<![\w./-])ckpt\[|pip install\s+(?:-\S+\s+)*['\"]?ckpt(?![\w.-])")
# An install of ours, and the extras it asks for: the distribution's name or the clone.
OURS = re.compile(rf"(?:{re.escape(DISTRIBUTION)}|(?<![\w-])\.)\[([\w,]+)\]")


def _files() -> list[Path]:
    """Where a user reads an install command: the README, docs/, the code's messages, the
    deployment files and CI's scripts."""
    found = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("ckpt", "agent", "service", "deploy", ".ci"):
        found += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file()]
    return [p for p in found if p.suffix not in {".png", ".svg", ".js", ".css", ".pyc"}]


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def test_the_distribution_is_named_ckpt_spot_in_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION == "ckpt-spot"


def test_no_install_hint_names_the_other_projects_ckpt() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if WRONG.search(line)
    ]
    assert wrong == []


def test_every_install_hint_asks_for_extras_the_distribution_has() -> None:
    extras, asked = _extras(), 0
    for path in _files():
        for found in OURS.finditer(path.read_text(errors="replace")):
            for extra in found.group(1).split(","):
                assert extra in extras, f"{path.relative_to(ROOT)}: no extra {extra!r}"
                asked += 1
    assert asked >= 20  # README, docs, pyproject, Dockerfiles, CI: the check saw them


def test_the_commands_own_hints_name_the_distribution() -> None:
    hint = install_hint("server")
    assert hint.startswith(f"pip install '{DISTRIBUTION}[server]'")
    assert "pip install -e '.[server]'" in hint
    code = [
        ROOT / "ckpt" / "cli" / "__init__.py",
        ROOT / "ckpt" / "core" / "storage" / "__init__.py",
    ]
    for path in code:
        text = path.read_text()
        assert "pip install" not in text, f"{path}: a hint written by hand, not install_hint"
        assert "install_hint(" in text
