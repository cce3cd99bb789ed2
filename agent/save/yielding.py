"""A save's background work yields to the optimizer's steps.

Hashing and writing a save take CPU time and memory bandwidth from the cores the loop runs
on. The part of an iteration the checkpointer sees is the optimizer's step (hooks before and
after it), and it is the part that runs on the host's CPU when the forward and backward do
not: an optimizer offloaded to the CPU (FSDP2's ``CPUOffloadPolicy``, ZeRO-Offload), or the
Python that launches a GPU optimizer's kernels. So while an optimizer steps, the save's
hashing and writing threads pause between pieces of at most ``PIECE_BYTES``; one step holds
them at most ``CKPT_SAVE_YIELD_SECONDS``, so a step that raises (no post-hook runs) or runs
longer cannot hold a save for good. The save becomes durable later by about the time the
loop spends in optimizer steps meanwhile.

Unset, the variable means 1 s in a process that uses CUDA (its forward and backward run on
a GPU) and no pause in one that trains on the CPU alone: there the forward and backward take
every core too, so a pause in the step only moves the save's work into them, which gained
nothing consistent (``bench/save_tax.py``, 3 runs: a tax of 0.86, 0.67 and 0.67 s with it
against 0.52, 0.77 and 0.72 s without) and made saves durable 15-25% later. 0 never pauses.

Nothing a step waits for pauses: the gate closes in a pre-hook registered after the
staging's (``StagingArea.before_step`` waits for the overlapped copies and the tensors read in
place), and the copies themselves never pass through it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils.hooks import RemovableHandle

PIECE_BYTES = 4 << 20  # the most a thread hashes or writes between two looks at the gate
DEFAULT_SECONDS = 1.0


def save_yield_seconds() -> float | None:
    """How long one optimizer step may pause a save's work (``CKPT_SAVE_YIELD_SECONDS``);
    None, unset: ``DEFAULT_SECONDS`` once the process uses CUDA, else no pause.

    Raises:
        ValueError: the variable is not a number of seconds from 0 up.
    """
    raw = os.environ.get("CKPT_SAVE_YIELD_SECONDS", "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(
            f"CKPT_SAVE_YIELD_SECONDS={raw!r}: expected the seconds one optimizer step may "
            "pause a save's hashing and writing, from 0 (never pause) up"
        )
    return seconds


class StepGate:
    """Open between the optimizer's steps, closed during them (``watch``); a save's threads
    pass their bytes through ``pieces``, which waits while it is closed."""

    def __init__(
        self, seconds: float | None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._auto = seconds is None  # close only once the process uses CUDA
        self.seconds, self._clock = DEFAULT_SECONDS if seconds is None else seconds, clock
        self._open = threading.Event()
        self._open.set()
        self._closed_at = 0.0

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> list[RemovableHandle]:
        """Close the gate while any of ``optimizers`` steps (register after the staging's
        hooks: what a step waits for must pass first)."""
        if self.seconds <= 0:
            return []
        handles = []
        for optimizer in optimizers:
            handles.append(optimizer.register_step_pre_hook(lambda *_: self.close()))
            handles.append(optimizer.register_step_post_hook(lambda *_: self.open()))
        return handles

    def close(self) -> None:
        if self._auto and not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return  # training on the CPU alone: see the module's doc
        self._closed_at = self._clock()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def wait(self) -> None:
        """Return once the gate is open, or it has been closed ``seconds``."""
        if not self._open.is_set():
            self._open.wait(max(0.0, self._closed_at + self.seconds - self._clock()))

    def pieces(self, pieces: Iterable[memoryview]) -> Iterator[memoryview]:
        """``pieces`` cut to at most ``PIECE_BYTES`` (views, no copy), each after ``wait``."""
        for piece in pieces:
            view = memoryview(piece).cast("B")
            for start in range(0, max(len(view), 1), PIECE_BYTES):
                self.wait()
                yield view[start : start + PIECE_BYTES]
