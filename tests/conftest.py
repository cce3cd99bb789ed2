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
        env={**os.environ, **(env or {})},
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
