"""What fingerprinting the steps costs, as a ratio of step time measured in the same run.

    .venv/bin/python bench/fingerprint.py [--model readme|1gb|both] [--rounds N] [--copies N]

Two models: the README's (Linear(16, 64), ReLU, Dropout, Linear(64, 4), AdamW, batches of 8,
accumulation 4) and a 1 GB state (8 x nn.Linear(3264, 3264) and Adam: 85M parameters, the
state ``save_restore.py`` uses). Each arm trains its own copies of the job (the same seed),
each with its own checkpointer; the copies of all arms take turns, one optimizer step each,
in a shuffled order every round, so a busy machine's other work falls on every arm alike,
and an arm's result is the mean over its copies (two identical copies differ by up to 1%
on a millisecond step: where their memory lies). The arms:

    off                     the baseline: the README's loop, ``CKPT_VERIFY=off``
    off, again              the same once more: how far two identical arms still differ,
                            the noise floor
    exact                   the README's loop as it is (no ``step_done``), as shipped: the
                            parameters' sample at the steps ``agent.verify.cadence`` picks
    off, loss               a loop that reports its loss, ``step_done(loss)`` each micro-batch
                            (with ``off``, a no-op)
    exact, loss             that loop as shipped: the loss too, at the positions of those steps
    exact, loss, every step that loop with ``verify_every_steps=1``: every position, as
                            fingerprints were first built (README's model only)

Each is reported as the ratio of its copies' median step time to the baseline's (the loss
arms also to ``off, loss``: the fingerprint's own cost in such a loop), over all rounds and
over each third of them (the spread says how noisy the machine was). Beside them, what each
candidate digest costs per step, timed alone, against the same step time: the sample ckpt
takes (gather and, off the loop, hash), the gradients' norm, a full BLAKE2b of every
parameter (what ``agent.verify.digest`` avoids) and the loss's append to the ring.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.verify.digest import ParamSample, digest
from agent.verify.ring import Ring
from ckpt import Checkpointer

ACCUMULATION = 4
Job = tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]


def readme_job() -> Job:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, labels = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return model, optimizer, lambda: nn.functional.cross_entropy(model(inputs), labels)


def big_job() -> Job:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(3264, 3264, bias=False) for _ in range(8)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    inputs = torch.randn(16, 3264)
    return model, optimizer, lambda: model(inputs).square().mean()


@dataclass(frozen=True)
class Arm:
    verify: str
    report: bool = True  # the loop calls step_done(loss), as documented: the tensor as it is
    every_steps: int | None = None  # verify_every_steps; None: the default


ARMS = {
    "off": Arm("off", report=False),
    "off, again": Arm("off", report=False),
    "exact": Arm("exact", report=False),
    "off, loss": Arm("off"),
    "exact, loss": Arm("exact"),
    "exact, loss, every step": Arm("exact", every_steps=1),
}
# The model, its arms, the rounds (one optimizer step per copy of an arm a round) and the
# copies of each arm, by default.
JOBS = {
    "readme": (readme_job, list(ARMS), 3000, 2),
    "1gb": (big_job, ["off", "off, again", "exact", "exact, loss"], 20, 1),
}
Times = dict[str, list[list[float]]]  # each arm's step times, by copy


def step(ckpt: Checkpointer, job: Job, *, report: bool) -> float:
    """One optimizer step of ``ACCUMULATION`` micro-batches; its seconds."""
    _, optimizer, loss_of = job
    counters = ckpt.counters
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
            ckpt.step_done(loss)
        ckpt.maybe_save()
    return time.perf_counter() - started


def candidates(model: nn.Module) -> dict[str, Callable[[], object]]:
    sample = ParamSample({"model": model})
    params = [p for p in model.parameters()]
    ring, loss, counter = Ring(), torch.tensor(1.0), iter(range(1 << 62))
    return {
        "sample gather (on the loop)": sample.take,
        "sample gather + hash": lambda: digest(sample.take()),  # type: ignore[arg-type]
        "gradient norm": lambda: torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.detach()) for p in params])
        ),
        "full BLAKE2b of the parameters": lambda: [
            hashlib.blake2b(p.detach().numpy().tobytes()).digest() for p in params
        ],
        "the loss kept (a ring append), per micro-batch": lambda: ring.record(
            (next(counter), 0), sample=None, loss=loss
        ),
    }


def ratios(times: list[list[float]], base: list[list[float]]) -> list[float]:
    """The mean of the copies' median step times over the baseline's: over all rounds, then
    over each third."""
    rounds = len(base[0])
    cuts = [slice(0, rounds)] + [slice(i * rounds // 3, (i + 1) * rounds // 3) for i in range(3)]
    return [
        statistics.mean(statistics.median(copy[cut]) for copy in times)
        / statistics.mean(statistics.median(copy[cut]) for copy in base)
        for cut in cuts
    ]


def bench(name: str, rounds: int | None, copies: int | None) -> None:
    make, arms, default_rounds, default_copies = JOBS[name]
    runs = [(arm, copy) for copy in range(copies or default_copies) for arm in arms]
    jobs = [make() for _ in runs]
    times: Times = {arm: [[] for _ in range(copies or default_copies)] for arm in arms}
    with tempfile.TemporaryDirectory() as root:
        checkpointers = [
            Checkpointer(
                run=f"bench-{index}",
                store=f"{root}/{index}",
                models=jobs[index][0],
                optimizers=jobs[index][1],
                verify=ARMS[arm].verify,
                verify_every_steps=ARMS[arm].every_steps,
                handle_signals=False,
                quiet=True,
            )
            for index, (arm, _) in enumerate(runs)
        ]
        for index, (arm, _) in enumerate(runs):  # warm up
            for _ in range(2):
                step(checkpointers[index], jobs[index], report=ARMS[arm].report)
        order, shuffle = list(range(len(runs))), random.Random(0).shuffle  # not the job's
        for _ in range(rounds or default_rounds):
            shuffle(order)
            for index in order:
                arm, copy = runs[index]
                seconds = step(checkpointers[index], jobs[index], report=ARMS[arm].report)
                times[arm][copy].append(seconds)
        for ckpt in checkpointers:
            ckpt.close()
    report(name, times, jobs[0][0])


def report(name: str, times: Times, model: nn.Module) -> None:
    base = statistics.mean(statistics.median(copy) for copy in times["off"])
    rounds, copies = len(times["off"][0]), len(times["off"])
    print(
        f"{name}: step {base * 1e3:.3f} ms with fingerprints off; {rounds} rounds, {copies} copies"
    )
    pairs = [(arm, "off") for arm in times if arm != "off"] + [
        (arm, "off, loss")
        for arm in times
        if ARMS[arm].report and ARMS[arm].verify != "off" and "off, loss" in times
    ]
    for arm, against in pairs:
        whole, *thirds = ratios(times[arm], times[against])
        spread = ", ".join(f"{third:.4f}" for third in thirds)
        print(f"  {arm} / {against}: {whole:.4f} ({(whole - 1) * 100:+.2f}%; by thirds {spread})")
    for what, run in candidates(model).items():
        seconds = []
        for _ in range(max(5, min(1000, int(0.2 / base)))):
            started = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - started)
        cost = statistics.median(seconds)
        print(f"  {what}: {cost * 1e6:.2f} us = {cost / base * 100:.4f}% of a step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["readme", "1gb", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=None, help="default: 3000, 1 GB: 20")
    parser.add_argument("--copies", type=int, default=None, help="of each arm; default 2, 1 GB: 1")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a busy machine's other work disturbs one thread least
    for name in JOBS if args.model == "both" else [args.model]:
        bench(name, args.rounds, args.copies)


if __name__ == "__main__":
    main()
