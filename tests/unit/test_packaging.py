"""The distribution installs one top-level package, ``ckpt``, typed, with its migrations."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_one_typed_package_and_the_ckpt_command(tmp_path: Path) -> None:
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
    (wheel,) = tmp_path.glob("ckpt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"ckpt", wheel.name.split("-py")[0] + ".dist-info"}
    assert "ckpt/py.typed" in names
    assert "ckpt/migrations/script.py.mako" in names
    assert any(name.startswith("ckpt/migrations/versions/") for name in names)
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    assert "ckpt = ckpt.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
