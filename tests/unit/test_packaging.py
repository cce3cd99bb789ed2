"""The distribution installs the four top-level packages (``ckpt``, ``agent``, ``service``,
``migrations``), typed, with every file that is not Python (CI's wheel step runs them)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_the_packages_their_files_and_the_ckpt_command(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("ckpt_spot-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {
        "ckpt",
        "agent",
        "service",
        "migrations",
        wheel.name.split("-py")[0] + ".dist-info",
    }
    # Every file of the packages that git tracks is in the wheel: templates, static assets,
    # the migrations' versions and script.py.mako, the py.typed markers.
    tracked = subprocess.run(
        ["git", "ls-files", "ckpt", "agent", "service", "migrations"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(tracked) > 150
    assert sorted(set(tracked) - set(names)) == []
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    assert "ckpt = ckpt.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
