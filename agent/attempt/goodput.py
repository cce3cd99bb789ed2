"""Where this attempt's time goes, as the agent sees it (``ckpt.core.goodput`` defines
the parts): reported with every heartbeat and at the end."""

from __future__ import annotations

import os
import time
from typing import Any

_IMPORTED_AT = time.time()


def process_started_at() -> float:
    """When this process started (seconds since the epoch): from /proc on Linux, else when
    ckpt was imported."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


class TimeAccount:
    def __init__(self, *, clock: Any = time.time) -> None:
        self._clock = clock
        self.started_at = min(process_started_at(), clock())
        self.ready_at: float | None = None
        self.stall_seconds = 0.0
        self._first_step = 0

    def ready(self, step: int) -> None:
        """The loop can train from here (resumed, or its first step without a resume)."""
        if self.ready_at is None:
            self.ready_at, self._first_step = self._clock(), step

    def stalled(self, seconds: float) -> None:
        self.stall_seconds += seconds

    def figures(self, step: int) -> dict[str, float | int] | None:
        """The parts so far; None before the loop is ready."""
        if self.ready_at is None:
            return None
        since = max(self._clock() - self.ready_at, 0.0)
        return {
            "restart_seconds": self.ready_at - self.started_at,
            "stall_seconds": min(self.stall_seconds, since),
            "train_seconds": max(since - self.stall_seconds, 0.0),
            "steps_trained": max(step - self._first_step, 0),
        }
