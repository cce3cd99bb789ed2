from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# The console script pip installed beside this interpreter.
CKPT = str(Path(sys.executable).parent / "ckpt")


def test_ckpt_demo_reports_bit_exact(tmp_path: Path) -> None:
    done = subprocess.run(
        [CKPT, "demo", "--steps", "30", "--every", "5", "--preemptions", "2", "--seed", "3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BIT-EXACT: yes" in done.stdout
    assert "SIGTERM 2 of 2 sent" in done.stdout
    assert "preempted at step" in done.stdout  # an attempt the agent ended itself
    assert "lost at step" in done.stdout  # the SIGKILLed one, marked by the control plane
    assert "/v1/runs/demo-" in done.stdout and "/resumable" in done.stdout
    assert list((tmp_path / ".ckpt" / "store" / "runs").iterdir())


def test_ckpt_without_a_command_explains_itself() -> None:
    done = subprocess.run([CKPT], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "demo" in done.stderr
