"""Goodput: the share of an attempt's (or a run's) time that made progress that was kept.

An attempt's time, as its agent accounts it from the moment its process started:

- ``restart``: from the process's start until the loop can train (imports, setting up,
  resuming: fetching and restoring the bundle);
- ``stall``: the loop waiting on saves;
- ``train``: the rest, training;
- ``redo``: of ``train``, the steps that were lost (trained past the last bundle before
  the attempt ended, so its successor trains them again), at the attempt's mean step time.

``goodput = (train - redo) / (restart + stall + train)``. A run's is the same over the sums
of its attempts. What a killed process did after its last report is not in its figures
(at most a heartbeat interval); its lost steps are in ``redo`` all the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimeSpent:
    restart_seconds: float = 0.0
    stall_seconds: float = 0.0
    train_seconds: float = 0.0
    redo_seconds: float = 0.0

    @property
    def wall_seconds(self) -> float:
        return self.restart_seconds + self.stall_seconds + self.train_seconds

    @property
    def goodput(self) -> float | None:
        """Productive time over wall time; None before any time was accounted."""
        wall = self.wall_seconds
        if wall <= 0:
            return None
        return max(self.train_seconds - self.redo_seconds, 0.0) / wall

    def __add__(self, other: TimeSpent) -> TimeSpent:
        return TimeSpent(
            self.restart_seconds + other.restart_seconds,
            self.stall_seconds + other.stall_seconds,
            self.train_seconds + other.train_seconds,
            self.redo_seconds + other.redo_seconds,
        )


def redo_seconds(*, train_seconds: float, steps_trained: int, steps_lost: int | None) -> float:
    """The time the lost steps took: ``steps_lost`` at the mean step time, at most all of it."""
    if not steps_lost or steps_trained <= 0:
        return 0.0
    return min(train_seconds, train_seconds * steps_lost / steps_trained)
