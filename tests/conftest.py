from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.server_process import TRAINER_HANG_GUARD

RunTrainer = Callable[..., dict[str, Any]]

# MKL picks how many threads a matrix product uses (MKL_DYNAMIC), and the last bits of a
# product depend on it (a tiny GPT-2 trained with 1 MKL thread differs from 2 at step 3):
# pinned, two runs of one job compute alike, and a comparison of them tests the resume.
ARITHMETIC = {"MKL_DYNAMIC": "FALSE"}


def run_trainer(
    store: Path | str,
    out: Path,
    *args: str,
    expect_rc: int = 0,
    env: dict[str, str] | None = None,
    module: str = "agent.demo.train",
) -> dict[str, Any]:
    """Run a training job (the demo's, or ``module``) in a fresh process and load what it wrote."""
    command = [
        sys.executable,
        "-m",
        module,
        "--store",
        str(store),
        "--out",
        str(out),
        *args,
    ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=TRAINER_HANG_GUARD,
        check=False,
        env={**os.environ, **ARITHMETIC, **(env or {})},
    )
    assert done.returncode == expect_rc, (
        f"{command} exited {done.returncode}:\n{done.stderr[-4000:]}"
    )
    if expect_rc != 0:
        return {}
    state: dict[str, Any] = torch.load(out, weights_only=True)
    return state


@pytest.fixture
def trainer(tmp_path: Path) -> RunTrainer:
    counter = iter(range(1_000_000))

    def run(
        *args: str,
        store: Path | None = None,
        expect_rc: int = 0,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        return run_trainer(
            store or tmp_path / "store",
            tmp_path / f"out{next(counter)}.pt",
            *args,
            expect_rc=expect_rc,
            env=env,
        )

    return run
