"""The README stays true: its example runs and resumes, and CI runs its test command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_ci_runs_the_readme_test_command() -> None:
    test_command = next(block.strip() for block in blocks("sh") if "pytest" in block)
    assert test_command in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_the_training_loop_example_runs_and_resumes(tmp_path: Path) -> None:
    (example,) = blocks("python")
    script = tmp_path / "train.py"
    script.write_text(example)
    env = {**os.environ, "CKPT_STORE": str(tmp_path / "store")}

    def run() -> str:
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    assert "fresh start" in run()
    assert "resumed from runs/my-run/bundles/000000000040" in run()
