"""Synchronous save and restore of a model + Adam state: ckpt vs torch.save / torch.load.

    .venv/bin/python bench/save_restore.py [--width 3264 --layers 8 --repeat 3 --dir /tmp]

The default state is 8 x nn.Linear(3264, 3264) plus Adam after one step (85.23M
parameters, 48 tensors, 1.02 GB). Every figure is printed next to a
baseline measured in the same run, on the same disk, as a ratio (these machines are noisy):

- save: ``Checkpointer.save().wait()`` (6 layers, SHA-256 of every blob, fsync + rename per blob,
  manifest last) vs ``torch.save`` of the same state dicts to a file + fsync.
- resave: a second save of an unchanged state (every blob deduplicated; only headers and the
  manifest are written) vs the same ``torch.save``.
- restore: ``Checkpointer.resume()`` (download, verify every SHA-256, load in place) vs
  ``torch.load(weights_only=True)`` + ``load_state_dict``.

The asynchronous, staged save (a stall of about a memcpy) is a later issue; this measures
the synchronous path it builds on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from agent import Checkpointer


def build(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return model, optimizer


def median_seconds(
    action: Callable[[], object], repeat: int, before: Callable[[], object] = lambda: None
) -> float:
    times = []
    for _ in range(repeat):
        before()
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=3264)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()

    model, optimizer = build(args.width, args.layers)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-bench-"))
    try:
        baseline_file = work / "baseline.pt"

        def torch_save() -> None:
            with baseline_file.open("wb") as out:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out)
                out.flush()
                os.fsync(out.fileno())

        def torch_load() -> None:
            state = torch.load(baseline_file, weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

        store = work / "store"
        ckpt = Checkpointer(run="bench", store=str(store), models=model, optimizers=optimizer)

        def fresh_store() -> None:
            shutil.rmtree(store, ignore_errors=True)

        t_save = median_seconds(torch_save, args.repeat)
        c_save = median_seconds(ckpt.save, args.repeat, before=fresh_store)
        c_resave = median_seconds(ckpt.save, args.repeat)
        new_bytes = ckpt.save().wait().new_bytes
        t_load = median_seconds(torch_load, args.repeat)
        c_load = median_seconds(ckpt.resume, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gb = state_bytes / 1e9
    print(
        f"state: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters + Adam, {gb:.3f} GB"
    )
    print(f"{'':10} {'ckpt s':>8} {'GB/s':>6} {'baseline s':>11} {'GB/s':>6} {'ratio':>6}")
    for label, ours, base in (
        ("save", c_save, t_save),
        ("resave", c_resave, t_save),
        ("restore", c_load, t_load),
    ):
        print(
            f"{label:10} {ours:8.3f} {gb / ours:6.2f} {base:11.3f} {gb / base:6.2f} {ours / base:6.2f}"
        )
    print(
        f"resave wrote {new_bytes} new bytes of {state_bytes} (unchanged tensors are not stored again)"
    )


if __name__ == "__main__":
    main()
