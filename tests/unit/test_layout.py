"""The repository's layout as the project was specified: what its root holds, the README's
line that names it, modules small enough to read in one sitting, and what an import of the
old layout, or a file that hides one of our packages, is told."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The top level the project was specified with.
SPECIFIED = {
    "pyproject.toml",
    "README.md",
    "agent",
    "service",
    "migrations",
    "deploy",
    "tests",
    "docker-compose.yml",
}
# Beside it: the public names, the command and the shared layer; benchmarks; the docs site;
# Alembic's CLI configuration; CI; what git and docker leave out.
BESIDE = {
    "ckpt",
    "bench",
    "docs",
    "mkdocs.yml",
    "alembic.ini",
    ".ci",
    ".gitignore",
    ".dockerignore",
}
PACKAGES = ("ckpt", "agent", "service", "migrations")
MAX_LINES = 400


@cache
def root_entries() -> frozenset[str]:
    """The root's entries that git tracks (not a virtual environment, a catalog, caches)."""
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked entries are unknown")
    return frozenset(name.split("/")[0] for name in listed.stdout.splitlines())


def test_the_root_holds_the_specified_top_level_and_nothing_unexplained() -> None:
    assert root_entries() >= SPECIFIED
    assert root_entries() == SPECIFIED | BESIDE


def test_the_readme_names_every_folder_of_the_root() -> None:
    readme = (ROOT / "README.md").read_text()
    line = next(p for p in readme.split("\n\n") if p.startswith("The repository:"))
    folders = {name for name in root_entries() if (ROOT / name).is_dir() and name[0] != "."}
    assert set(re.findall(r"`([\w.-]+)/`", line)) == folders


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_over_400_lines(package: str) -> None:
    modules = list((ROOT / package).rglob("*.py"))
    assert modules
    long = {
        str(path.relative_to(ROOT)): lines
        for path in modules
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by responsibility: {long}"


@pytest.mark.parametrize(
    ("old", "package"),
    [
        ("ckpt.agent.demo.train", "agent"),
        ("ckpt.service.app", "service"),
        ("ckpt.migrations", "migrations"),
    ],
)
def test_an_import_of_the_old_layout_names_the_new_package(old: str, package: str) -> None:
    with pytest.raises(
        ImportError, match=f"{old.split('.')[1]} moved: .* top-level package '{package}'"
    ):
        importlib.import_module(old)


def test_a_file_that_hides_the_agent_package_is_named(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text("")  # a training script's own agent.py, beside it
    done = subprocess.run(
        [sys.executable, "-c", "from ckpt import Checkpointer"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert f"{tmp_path / 'agent.py'} hides ckpt's package 'agent'" in done.stderr
    elsewhere = subprocess.run(
        [sys.executable, "-c", "from ckpt import Checkpointer"],
        cwd=ROOT / "docs",
        capture_output=True,
        text=True,
        check=False,
    )
    assert elsewhere.returncode == 0, elsewhere.stderr
