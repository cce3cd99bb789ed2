"""What fingerprinting every step costs, as a ratio of step time measured in the same run.

    .venv/bin/python bench/fingerprint.py [--model readme|1gb|both] [--blocks 5]

Two models: the README's (Linear(16, 64), ReLU, Dropout, Linear(64, 4), AdamW, batches of 8,
accumulation 4) and a 1 GB state (8 x nn.Linear(3264, 3264) and Adam: 85M parameters, the
state ``save_restore.py`` uses). The same training loop runs with ``CKPT_VERIFY=off`` (the
baseline) and ``exact`` (``step_done(loss)`` each micro-batch; the fingerprint of each
optimizer step), in interleaved blocks; the ratio of their median step times is the cost.
Beside it, what each candidate digest costs per step, against the same step time: the
sample ckpt takes (gather and, off the loop, hash), the gradients' norm, and a full
BLAKE2b of every parameter (what ``agent.verify.digest`` avoids).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.verify.digest import ParamSample, digest
from ckpt import Checkpointer

ACCUMULATION = 4


def readme_job() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, labels = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return model, optimizer, lambda: nn.functional.cross_entropy(model(inputs), labels)


def big_job() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(3264, 3264, bias=False) for _ in range(8)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    inputs = torch.randn(16, 3264)
    return model, optimizer, lambda: model(inputs).square().mean()


JOBS = {"readme": (readme_job, 50), "1gb": (big_job, 2)}  # optimizer steps per block


def steps(ckpt: Checkpointer, job: tuple, count: int, *, report: bool) -> list[float]:
    """``count`` optimizer steps of ``ACCUMULATION`` micro-batches; each one's seconds."""
    _, optimizer, loss_of = job
    counters, times = ckpt.counters, []
    for _ in range(count):
        started = time.perf_counter()
        for _ in range(ACCUMULATION):
            loss = loss_of() / ACCUMULATION
            loss.backward()
            counters.micro_step += 1
            if counters.micro_step == ACCUMULATION:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                counters.step, counters.micro_step = counters.step + 1, 0
            if report:
                ckpt.step_done(loss.detach())
            ckpt.maybe_save()
        times.append(time.perf_counter() - started)
    return times


def candidates(model: nn.Module) -> dict[str, Callable[[], object]]:
    sample = ParamSample({"model": model})
    params = [p for p in model.parameters()]
    return {
        "sample gather (on the loop)": sample.take,
        "sample gather + hash": lambda: digest(sample.take()),  # type: ignore[arg-type]
        "gradient norm": lambda: torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.detach()) for p in params])
        ),
        "full BLAKE2b of the parameters": lambda: [
            hashlib.blake2b(p.detach().numpy().tobytes()).digest() for p in params
        ],
    }


def bench(name: str, blocks: int) -> None:
    make, count = JOBS[name]
    job = make()
    timed: dict[str, list[float]] = {"off": [], "exact": []}
    with tempfile.TemporaryDirectory() as root:
        checkpointers = {
            mode: Checkpointer(
                run=f"bench-{mode}",
                store=f"{root}/{mode}",
                models=job[0],
                optimizers=job[1],
                verify=mode,
                handle_signals=False,
                quiet=True,
            )
            for mode in timed
        }
        for mode, ckpt in checkpointers.items():
            steps(ckpt, job, 2, report=mode == "exact")  # warm up
        for _ in range(blocks):
            for mode, ckpt in checkpointers.items():
                timed[mode] += steps(ckpt, job, count, report=mode == "exact")
        for ckpt in checkpointers.values():
            ckpt.close()
    base, verified = statistics.median(timed["off"]), statistics.median(timed["exact"])
    print(f"{name}: step {base * 1e3:.3f} ms without fingerprints, {verified * 1e3:.3f} ms with")
    print(f"  ratio with / without: {verified / base:.4f} ({(verified / base - 1) * 100:+.2f}%)")
    for what, run in candidates(job[0]).items():
        seconds = []
        for _ in range(max(5, count)):
            started = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - started)
        cost = statistics.median(seconds)
        print(f"  {what}: {cost * 1e6:.1f} us per step = {cost / base * 100:.3f}% of a step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["readme", "1gb", "both"], default="both")
    parser.add_argument("--blocks", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a busy machine's other work disturbs one thread least
    for name in JOBS if args.model == "both" else [args.model]:
        bench(name, args.blocks)


if __name__ == "__main__":
    main()
