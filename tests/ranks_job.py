"""Run the many-rank demo job (``agent.demo.ranks``) as real processes, one per rank,
the way torchrun would: each with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.server_process import free_port


@dataclass(frozen=True)
class Ranks:
    """How a job's ranks ended: exit codes and output, by rank."""

    codes: list[int]
    outputs: list[str]

    def text(self) -> str:
        return "\n".join(
            f"--- rank {r} ({c}):\n{o[-3000:]}"
            for r, (c, o) in enumerate(zip(self.codes, self.outputs, strict=True))
        )


def run_ranks(
    world: int,
    store: Path | str,
    out: Path,
    *args: str,
    env: dict[str, str] | None = None,
    module: str = "agent.demo.ranks",
) -> Ranks:
    """Start ``world`` ranks of the job (the demo's, or ``module``) and wait for all of them
    (at most 5 minutes)."""
    port = str(free_port())
    processes = []
    for rank in range(world):
        environment = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, "-m", module, "--store", str(store)]
        processes.append(
            subprocess.Popen(
                [*command, "--out", str(out), *args],
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    return Ranks([process.returncode for process in processes], outputs)


def load_ranks(out: Path, world: int) -> list[dict[str, Any]]:
    """Every rank's final state, as the job wrote it."""
    return [torch.load(f"{out}.rank{rank}", weights_only=True) for rank in range(world)]
