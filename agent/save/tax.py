"""The save tax: how much later the training loop got to where it is because of a save.

``stall_seconds`` is the time inside ``save()`` and the next step's wait; the loop also pays
for the persist's hashing and writing on the cores it trains on. ``StepClock`` times the
loop by its optimizer steps (a step pre-hook) and charges a save the extra time of the steps
it overlapped, from ``save()`` until durable, against the median step before it:

    tax = (s_k - s_0 - k * m) + max(0, t_1 - s_k - m)

where ``s_0`` is the last step before ``save()``, ``s_1 .. s_k`` the steps until the save
was durable at ``t_1``, and ``m`` the median of the recent steps no save overlapped. The
step still running at ``t_1`` counts only for what it has already run over ``m`` (a lower
bound: it may be slowed further before it ends). No figure (None) before ``MIN_STEPS``
such steps were seen, or when a save was not started between steps.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from agent.save.yielding import StepGate

MIN_STEPS = 3  # steps without a save before a median stands for "a step"
_KEPT = 32  # the recent steps the median is taken of


@dataclass(frozen=True)
class Window:
    """The loop when a save started: its step count and last step, and a step's median."""

    steps: int
    last_step_at: float
    median: float


class StepClock:
    """Times the optimizer steps of the loop (from any one thread), and the saves that
    overlap them (from the persist thread)."""

    def __init__(
        self, *, gate: StepGate | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._clock, self._gate = clock, gate
        self._lock = threading.Lock()
        self._steps = 0
        self._last: float | None = None
        self._plain: deque[float] = deque(maxlen=_KEPT)  # intervals no save overlapped
        self._saving = 0  # saves started and not yet durable or failed
        self._overlapped = False  # a save overlapped the step running now

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> list[RemovableHandle]:
        """Tick on every step of the first optimizer (one tick per iteration); the ``gate``
        (``StepGate``) closes while any of them steps."""
        optimizers = list(optimizers)
        ticks = [optimizers[0].register_step_pre_hook(lambda *_: self.tick())] if optimizers else []
        return ticks + (self._gate.watch(optimizers) if self._gate else [])

    def tick(self) -> None:
        now = self._clock()
        with self._lock:
            if self._last is not None and not self._overlapped:
                self._plain.append(now - self._last)
            self._steps += 1
            self._last = now
            self._overlapped = self._saving > 0

    def started(self) -> Window | None:
        """A save starts now (call ``ended`` once it is durable or failed): where the loop
        is, or None when there is no step median to charge it against yet."""
        with self._lock:
            self._saving += 1
            self._overlapped = True
            if self._last is None or len(self._plain) < MIN_STEPS:
                return None
            return Window(self._steps, self._last, statistics.median(self._plain))

    def ended(self, window: Window | None) -> float | None:
        """The save that started at ``window`` is durable (or failed) now: its tax."""
        now = self._clock()
        with self._lock:
            self._saving -= 1
            if window is None or self._last is None:
                return None
            steps = self._steps - window.steps
            done = self._last - window.last_step_at - steps * window.median
            running = max(0.0, now - self._last - window.median)
        return max(0.0, done + running)
