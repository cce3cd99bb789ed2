"""How often to save: the Young/Daly interval from the cost of a save and the mean time
between preemptions, and the estimate of that mean from attempt history.

A save costs the loop ``cost`` seconds (its visible stall); a preemption loses on average
half an interval of work. Over an interval ``T`` the expected waste per second of training
is ``cost / T + T / (2 · mtbf)``, least at ``T* = sqrt(2 · cost · mtbf)`` (Young 1974;
Daly 2006), where the two halves are equal. Both numbers change as a run goes on (a save
grows with the state; a capacity pool is taken back more or less often), so the agent
re-evaluates ``T*`` after each measured save and each new estimate.

The mean time between preemptions is estimated from attempts: each contributes its time
alive (exposure) and, when it was preempted or lost, one event; attempts still running,
finished or failed (a crash is not the capacity's doing) contribute exposure only. With a
gamma prior worth one event at ``prior`` seconds, the estimate is
``(exposure + prior) / (events + 1)``: the prior alone with no history, the plain
``exposure / events`` with much. The run's estimate takes its capacity pool's estimate as
its prior (the pool's own takes the configured prior), so a new run on a pool that is
preempted every hour starts near an hour, and its own history takes over as it grows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class History:
    """Seconds alive and preemptions, over some attempts."""

    exposure_seconds: float = 0.0
    preemptions: int = 0

    def __add__(self, other: History) -> History:
        return History(
            self.exposure_seconds + other.exposure_seconds, self.preemptions + other.preemptions
        )

    def mtbf(self, *, prior_seconds: float) -> float:
        """The mean time between preemptions: ``(exposure + prior) / (events + 1)``."""
        return (self.exposure_seconds + prior_seconds) / (self.preemptions + 1)


def young_daly(*, cost_seconds: float, mtbf_seconds: float) -> float:
    """The interval between saves that wastes least: ``sqrt(2 · cost · mtbf)``."""
    return math.sqrt(2 * max(cost_seconds, 0.0) * mtbf_seconds)


def waste_per_hour(*, interval_seconds: float, cost_seconds: float, mtbf_seconds: float) -> float:
    """Seconds of each hour expected lost at this interval: to saves (``cost / T``) and to
    the work redone after preemptions (``T / (2 · mtbf)``)."""
    fraction = cost_seconds / interval_seconds + interval_seconds / (2 * mtbf_seconds)
    return 3600 * fraction


def bounded(seconds: float, *, low: float, high: float) -> float:
    return min(max(seconds, low), high)
