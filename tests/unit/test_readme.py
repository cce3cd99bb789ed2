"""The README stays true and short: its example runs, a second run continues where the first
stopped and the two together equal one uninterrupted run; CI runs its test command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

# The quick start, as a newcomer copies it from a fresh clone.
DEMO_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && "
    ".venv/bin/pip install -e '.[demo]' && .venv/bin/ckpt demo"
)


def blocks(language: str) -> list[str]:
    """The fenced blocks in ``language`` ("" for none), each opening fence matched with its
    closing one."""
    fences = re.findall(r"^```([\w-]*)\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)
    return [body for lang, body in fences if lang == language]


def test_the_readme_is_a_five_minute_read() -> None:
    assert len(README.encode()) < 10 * 1024


def test_ci_runs_the_readme_test_command() -> None:
    test_command = next(block.strip() for block in blocks("sh") if "pytest" in block)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_the_quick_start_installs_extras_that_exist() -> None:
    commands = [line for block in blocks("sh") for line in block.splitlines()]
    assert DEMO_COMMAND in commands
    assert ". .venv/bin/activate" in commands  # the demo's closing hints call ckpt by name
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in re.findall(r"-e '\.\[(\w+)\]'", " ".join(commands)):
        assert extra in extras["optional-dependencies"], extra


def run(script: Path, *, cwd: Path) -> subprocess.CompletedProcess[str]:
    """One run of a training script in a fresh process, on a store of its own."""
    cwd.mkdir(exist_ok=True)
    env = {name: value for name, value in os.environ.items() if not name.startswith("CKPT_")}
    env["CKPT_STORE"] = str(cwd / "store")
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_a_second_run_of_the_example_continues_the_first_bit_exactly(tmp_path: Path) -> None:
    (example,) = blocks("python")
    keep = "\ntorch.save(model.state_dict(), 'weights.pt')\n"
    script = tmp_path / "train.py"
    script.write_text(example + keep)
    once, count = re.subn(r"STEPS_PER_RUN = 4, 20\b", "STEPS_PER_RUN = 4, 40", example)
    assert count == 1
    uninterrupted = tmp_path / "uninterrupted.py"
    uninterrupted.write_text(once + keep)

    first = run(script, cwd=tmp_path / "twice")
    assert "trained steps 0 to 20" in first.stdout
    assert "starting fresh" in first.stderr
    second = run(script, cwd=tmp_path / "twice")
    assert "trained steps 20 to 40" in second.stdout
    # What the README says a second run prints on stderr.
    (shown,) = [block for block in blocks("") if block.startswith("ckpt: run my-run:")]
    resumed, saved = shown.splitlines()
    assert resumed in second.stderr
    assert saved.split(": ")[2] == "saved step 30"
    assert "ckpt: run my-run: saved step 30: " in second.stderr

    assert "trained steps 0 to 40" in run(uninterrupted, cwd=tmp_path / "once").stdout
    resumed_weights = torch.load(tmp_path / "twice" / "weights.pt", weights_only=True)
    reference = torch.load(tmp_path / "once" / "weights.pt", weights_only=True)
    assert resumed_weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(resumed_weights[name], tensor), name
