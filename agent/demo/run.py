"""``ckpt demo``: train, get killed without warning, resume in a new process, and check
that the result is bit-identical to a run that was never interrupted."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agent.bundle import latest_manifest
from agent.demo.compare import differences
from agent.demo.train import ACCUMULATION
from agent.storage import open_store


def _train(label: str, store: str, run: str, out: Path, *args: str) -> tuple[int, float, str]:
    command = [
        sys.executable,
        "-m",
        "agent.demo.train",
        "--store",
        store,
        "--run",
        run,
        "--out",
        str(out),
        *args,
    ]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode not in (0, -9):
        sys.stderr.write(done.stderr)
        raise SystemExit(f"the {label} run failed with exit code {done.returncode}")
    return done.returncode, seconds, done.stdout.strip()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ckpt demo", description=__doc__)
    parser.add_argument(
        "--store", default=".ckpt/store", help="where bundles go (default: ./.ckpt/store)"
    )
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    parser.add_argument("--every", type=int, default=10, help="save every N steps")
    parser.add_argument("--seed", type=int, default=None, help="seed of the moment of the kill")
    args = parser.parse_args(argv)
    if args.every < 1 or args.steps < args.every + 3:
        parser.error(f"--steps must be at least --every + 3 (got {args.steps} and {args.every})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    chooser = random.Random(args.seed)
    kill = (chooser.randrange(args.every + 1, args.steps - 1), chooser.randrange(ACCUMULATION))
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{chooser.randrange(1 << 16):04x}"
    work = Path(args.store).absolute().parent / "demo" / run
    work.mkdir(parents=True, exist_ok=True)
    common = ("--steps", str(args.steps), "--total-steps", str(args.steps + 20))
    saving = ("--every", str(args.every))

    print(f"ckpt demo: run {run}, store {args.store}")
    print(
        f"1. training {args.steps} steps, saving every {args.every}; SIGKILL at step {kill[0]}.{kill[1]}"
    )
    kill_at = ("--kill-at", f"{kill[0]}.{kill[1]}")
    rc, seconds, _ = _train(
        "interrupted", args.store, run, work / "killed.pt", *common, *saving, *kill_at
    )
    manifest = latest_manifest(open_store(args.store), run)
    if rc != -9 or manifest is None:
        raise SystemExit("the interrupted run was expected to save a bundle and then be killed")
    print(f"   killed after {seconds:.1f} s; latest resumable bundle: step {manifest.step}")
    print("2. a new process resumes from it and trains to the end")
    _, seconds, said = _train("resumed", args.store, run, work / "resumed.pt", *common, *saving)
    print(f"   {said.splitlines()[0] if said else 'started fresh'} ({seconds:.1f} s)")
    print("3. a reference run trains the same job without interruption")
    _train("reference", args.store, f"{run}-reference", work / "reference.pt", *common)
    return report(work, kill=kill, resumed_step=manifest.step)


def report(work: Path, *, kill: tuple[int, int], resumed_step: int) -> int:
    """Print the comparison; 0 when the resumed run is bit-identical to the reference."""
    resumed: dict[str, Any] = torch.load(work / "resumed.pt", weights_only=True)
    reference: dict[str, Any] = torch.load(work / "reference.pt", weights_only=True)
    found = differences(reference, resumed)
    replayed = (kill[0] - resumed_step) * ACCUMULATION + kill[1]
    print()
    print(
        f"steps lost to the kill:       {kill[0] - resumed_step} ({replayed} micro-batches replayed)"
    )
    print(f"micro-batches compared:       {len(resumed['positions'])}")
    print(f"parameters and buffers:       {len(reference['model'])} tensors")
    print(f"optimizer state:              {len(reference['optimizer'])} tensors")
    if found:
        print("BIT-EXACT: NO")
        for item in found:
            print(f"  - {item}")
        return 1
    print("BIT-EXACT: yes - every parameter, optimizer tensor, LR and loss is identical")
    return 0
