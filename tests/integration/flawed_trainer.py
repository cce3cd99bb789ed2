"""The demo job (agent.demo.train) with one flaw that breaks bit-exact resume, for the tests
that a resume's verification catches it: ``python -m tests.integration.flawed_trainer
--flaw FLAW ARGS...`` with FLAW one of

    none            the demo job as it is
    leaky-sampler   its sampler also draws from a ``random.Random`` that ckpt does not capture
    data            the restored data position is moved on by one batch (a damaged data layer)
    optimizer       the restored Adam first moment is scaled by 1.01 (a damaged optimizer layer)
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

from agent.data.sampling import ResumableSampler, SampleIndex
from agent.demo import train
from ckpt import ResumeResult

FLAWS = ("none", "leaky-sampler", "data", "optimizer")


class LeakySampler(ResumableSampler):
    """Moves some indices by one, by a generator of its own that no checkpoint holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.leak = random.Random(3)

    def __iter__(self) -> Iterator[int]:
        for index in super().__iter__():
            moved = (int(index) + self.leak.randrange(2)) % train.NUM_SAMPLES
            yield SampleIndex(moved, index.seed) if isinstance(index, SampleIndex) else moved


def leaky_loader(args: Any) -> Any:
    loader = made_loader(args)
    sampler = LeakySampler(train.NUM_SAMPLES, seed=11)
    return torch.utils.data.DataLoader(
        loader.dataset, sampler=sampler, batch_size=train.BATCH_SIZE, num_workers=args.workers
    )


def damaging(flaw: str) -> Any:
    """``train.build`` whose checkpointer damages one layer right after it is restored."""

    def build(args: Any) -> train.Job:
        job = _build(args)
        resume = job.ckpt.resume

        def damaged_resume(**kwargs: Any) -> ResumeResult:
            result = resume(**kwargs)
            if result.resumed and flaw == "data":
                sampler = LOADERS[-1].sampler
                state = sampler.state_dict()
                sampler.load_state_dict(state | {"offset": state["offset"] + train.BATCH_SIZE})
            if result.resumed and flaw == "optimizer":
                first = next(iter(job.optimizer.state.values()))
                first["exp_avg"].mul_(1.01)
            return result

        job.ckpt.resume = damaged_resume  # type: ignore[method-assign]
        return job

    return build


LOADERS: list[Any] = []  # the loaders made, the one in use last
_make_loader, _build = train.make_loader, train.build


def made_loader(args: Any) -> Any:
    LOADERS.append(_make_loader(args))
    return LOADERS[-1]


if __name__ == "__main__":
    at = sys.argv.index("--flaw")
    flaw = sys.argv.pop(at + 1)
    sys.argv.pop(at)
    assert flaw in FLAWS, f"the flaw must be one of {FLAWS}, got {flaw!r}"
    train.make_loader = leaky_loader if flaw == "leaky-sampler" else made_loader
    if flaw in ("data", "optimizer"):
        train.build = damaging(flaw)
    train.main()
