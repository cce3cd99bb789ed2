"""DDP saves: bytes uploaded and stall per rank, world size 2 against 1, in one run.

    .venv/bin/python bench/ranks.py [--repeat 3] [--width 1024] [--layers 4]

Each repeat saves the same model (``--layers`` x nn.Linear(width, width) + AdamW after one
step) into an empty directory store: once in one process, and once as two DDP ranks (real
processes on gloo). DDP's weights and optimizer state are identical on every rank, so the
two ranks should upload them once between them; per-rank state (RNG, data position,
counters) is small. Printed: the bytes both ranks uploaded / one replica's payload (target
<= 1.05), and each rank's stall / the single process's stall.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt import Checkpointer
from tests.server_process import free_port


def worker(store: str, width: int, layers: int) -> None:
    """One rank (or the single process): train a step, save once, print the figures."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()
    with Checkpointer(
        run="bench", store=store, models=model, optimizers=optimizer, quiet=True
    ) as ckpt:
        result = ckpt.save().wait()
    print(
        json.dumps(
            {
                "payload": result.payload_bytes,
                "new": result.new_bytes,
                "stall": result.stall_seconds,
            }
        )
    )
    if world > 1:
        dist.destroy_process_group()


def run(world: int, store: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    port = str(free_port())
    command = [
        sys.executable,
        __file__,
        "--worker",
        str(store),
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
    ]
    processes = [
        subprocess.Popen(
            command,
            env={
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "LOCAL_WORLD_SIZE": str(world),
                "OMP_NUM_THREADS": "1",
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    return [json.loads(output.strip().splitlines()[-1]) for output in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.layers)
        return
    uploaded, stalls = [], []
    with tempfile.TemporaryDirectory() as work:
        for attempt in range(args.repeat):
            [single] = run(1, Path(work, f"one-{attempt}"), args)
            ranks = run(2, Path(work, f"two-{attempt}"), args)
            uploaded.append(sum(rank["new"] for rank in ranks) / single["payload"])
            stalls.append(max(rank["stall"] for rank in ranks) / single["stall"])
            print(
                f"repeat {attempt + 1}: one replica {single['payload']} bytes; two ranks uploaded "
                f"{[rank['new'] for rank in ranks]}; stall {single['stall']:.3f} s vs "
                f"{[round(rank['stall'], 3) for rank in ranks]}",
                flush=True,
            )
    print(f"| figure | world size 2 / world size 1 (median of {args.repeat}) | target |")
    print("|---|---|---|")
    print(
        f"| bytes uploaded by all ranks / one replica | {statistics.median(uploaded):.3f} | <= 1.05 |"
    )
    print(f"| stall of the slower rank / one process | {statistics.median(stalls):.2f} | |")


if __name__ == "__main__":
    main()
