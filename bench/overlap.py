"""Overlapped staging and the staging budget, against baselines measured in the same run.

    .venv/bin/python bench/overlap.py [--repeat 3] [--width 3264] [--layers 8]

The state is ``--layers`` x nn.Linear(width, width) plus Adam (the defaults: 85.23M
parameters, 1.02 GB, as in ``save_restore.py``), saved to a directory store. A training
iteration is forward + backward of a batch, then the optimizer step.

- stall: how long a save holds training up: ``save()`` plus the wait of the next optimizer
  step (``SaveResult.stall_seconds``), with overlap on and off, vs ``copy_`` of the same
  tensors into warm buffers. Measured with a batch whose forward + backward take longer
  than that copy, and with none (the step right after ``save()``: the worst case). Beside
  it, an iteration without a save in flight and the one right after a save: that adds
  what the persist (hashing and writing on the same cores) takes from training, which a
  stall figure leaves out, with overlap on or off.
- budget: time to durable (``save()`` to committed) and the stall with ``staging_bytes`` at
  25% of the state, vs unbounded, and the staging buffers' bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt import Checkpointer
from ckpt.core.storage import open_store

GB = 1e9


def build(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optimizer


def iteration(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor | None
) -> float:
    """Forward and backward of ``batch`` (none: the gradients stay), then a step."""
    started = time.perf_counter()
    if batch is not None:
        model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return time.perf_counter() - started


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    return tensors + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def copy_floor(tensors: list[torch.Tensor], repeat: int) -> float:
    buffers = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeat + 1):
        started = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def stalls(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor | None,
    *,
    overlap: bool,
    repeat: int,
    work: Path,
) -> tuple[float, float, float]:
    """(median stall, median iteration without a save, median iteration after a save)."""
    store = open_store(str(work / f"store-{uuid.uuid4().hex[:6]}"))
    held, plain, after = [], [], []
    with Checkpointer(
        run="overlap", store=store, models=model, optimizers=optimizer, overlap=overlap
    ) as ckpt:
        for round_ in range(repeat + 1):
            plain.append(iteration(model, optimizer, batch))
            ckpt.counters.step += 1
            pending = ckpt.save()
            after.append(iteration(model, optimizer, batch))
            result = pending.wait()
            if round_:  # the first save allocates the buffers
                held.append(result.stall_seconds)
        shutil.rmtree(store.url.removeprefix("file://"), ignore_errors=True)
    return statistics.median(held), statistics.median(plain[1:]), statistics.median(after[1:])


def durable(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    *,
    budget: int | None,
    repeat: int,
    work: Path,
) -> tuple[float, float, int]:
    """(median save-to-committed seconds, median stall, staging buffer bytes), each save
    followed by a training iteration (whose step the budget holds up)."""
    store = open_store(str(work / f"store-{uuid.uuid4().hex[:6]}"))
    times, held = [], []
    with Checkpointer(
        run="budget", store=store, models=model, optimizers=optimizer, staging_bytes=budget
    ) as ckpt:
        for round_ in range(repeat + 1):
            ckpt.counters.step += 1
            pending = ckpt.save()
            iteration(model, optimizer, batch)
            result = pending.wait()
            if round_:
                times.append(pending.stall_seconds + result.persist_seconds)
                held.append(result.stall_seconds)
        buffers = ckpt._staging.nbytes
    shutil.rmtree(store.url.removeprefix("file://"), ignore_errors=True)
    return statistics.median(times), statistics.median(held), buffers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=3264)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    os.environ.setdefault("CKPT_QUIET", "1")
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-overlap-"))
    model, optimizer = build(args.width, args.layers)
    iteration(model, optimizer, torch.randn(1, args.width))  # Adam's state exists
    tensors = state(model, optimizer)
    size = sum(t.nbytes for t in tensors)
    floor = copy_floor(tensors, args.repeat)
    print(
        f"state {size / GB:.2f} GB, {len(tensors)} tensors; {os.cpu_count()} CPUs; medians of "
        f"{args.repeat}; warm copy_ of the state {floor * 1e3:.0f} ms",
        flush=True,
    )
    try:
        print("| forward + backward | overlap | stall | stall / copy_ | iteration | next one |")
        print("|---|---|---|---|---|---|")
        for batch in (torch.randn(args.batch, args.width), None):
            for overlap in (True, False):
                stall, plain, after = stalls(
                    model, optimizer, batch, overlap=overlap, repeat=args.repeat, work=work
                )
                what = "none (step at once)" if batch is None else f"batch of {args.batch}"
                print(
                    f"| {what} | {'on' if overlap else 'off'} | {stall * 1e3:.0f} ms | "
                    f"{stall / floor:.2f} | {plain * 1e3:.0f} ms | {after * 1e3:.0f} ms |",
                    flush=True,
                )
        print()
        print("| staging budget | durable | ratio | stall | buffers |")
        print("|---|---|---|---|---|")
        unbounded = None
        for budget in (None, size // 4):
            seconds, stall, buffers = durable(
                model,
                optimizer,
                torch.randn(args.batch, args.width),
                budget=budget,
                repeat=args.repeat,
                work=work,
            )
            unbounded = unbounded or seconds
            name = "none" if budget is None else f"{budget / GB:.2f} GB (25%)"
            print(
                f"| {name} | {seconds:.2f} s | {seconds / unbounded:.2f} | {stall * 1e3:.0f} ms | "
                f"{buffers / GB:.2f} GB |",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
