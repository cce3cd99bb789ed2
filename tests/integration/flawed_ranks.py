"""The many-rank demo job (agent.demo.ranks) with one flaw on one rank that breaks bit-exact
resume, for the tests that a resume's verification catches it on every rank it happens:
``python -m tests.integration.flawed_ranks --flaw FLAW --flaw-rank R ARGS...`` with FLAW one of

    none        the job as it is
    leaky-rng   rank R moves each sample of its inputs by its own multiple of a draw from a
                ``random.Random`` that ckpt does not capture: a resumed attempt draws from
                its seed again, not where the interrupted one was (one shift for the whole
                batch would vanish in the model's batch norm, but for its rounding, which
                differs between CPUs)
    optimizer   rank R scales its restored Adam first moment by 1.01 (a damaged optimizer
                layer on one rank)
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch
import torch.distributed as dist

from agent.demo import ranks
from ckpt import ResumeResult

FLAWS = ("none", "leaky-rng", "optimizer")
LEAK = random.Random(5)  # the flawed rank's own generator, in no bundle


def leaky(flaw_rank: int) -> Any:
    """``ranks.train_micro_batch`` whose inputs, on ``flaw_rank``, move by a leaked draw
    (sample i by i times it)."""
    train_micro_batch = ranks.train_micro_batch

    def moved(job: ranks.Job, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        if dist.get_rank() == flaw_rank:
            ramp = torch.arange(len(inputs), dtype=inputs.dtype).unsqueeze(1)
            inputs = inputs + LEAK.random() * ramp
        train_micro_batch(job, inputs, labels)

    return moved


def damaging(flaw_rank: int) -> Any:
    """``ranks.build`` whose checkpointer, on ``flaw_rank``, damages the optimizer layer
    right after it is restored."""
    build = ranks.build

    def damaged_build(args: Any) -> ranks.Job:
        job = build(args)
        resume = job.ckpt.resume

        def damaged_resume(**kwargs: Any) -> ResumeResult:
            result = resume(**kwargs)
            if result.resumed and dist.get_rank() == flaw_rank:
                first = next(iter(job.optimizer.state.values()))
                first["exp_avg"].mul_(1.01)
            return result

        job.ckpt.resume = damaged_resume  # type: ignore[method-assign]
        return job

    return damaged_build


def take(name: str) -> str:
    at = sys.argv.index(name)
    value = sys.argv.pop(at + 1)
    sys.argv.pop(at)
    return value


if __name__ == "__main__":
    flaw, flaw_rank = take("--flaw"), int(take("--flaw-rank"))
    assert flaw in FLAWS, f"the flaw must be one of {FLAWS}, got {flaw!r}"
    if flaw == "leaky-rng":
        ranks.train_micro_batch = leaky(flaw_rank)
    if flaw == "optimizer":
        ranks.build = damaging(flaw_rank)
    ranks.main()
