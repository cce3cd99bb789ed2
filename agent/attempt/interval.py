"""``every="auto"``: the save interval that wastes least, re-evaluated as a run goes on.

The interval is the Young/Daly optimum ``sqrt(2 · cost · mtbf)`` (``ckpt.core.interval``),
within ``[auto_min_seconds, auto_max_seconds]``. ``cost`` is what a save stalls the loop,
averaged over the saves measured (the first save comes after ``auto_min_seconds``, to
measure one); ``mtbf`` is the control plane's estimate for the run and its capacity pool
(``GET /v1/runs/{run}/preemption-rate``), asked again every ``REFRESH_SECONDS`` from the
training loop (through the control plane, on a thread of its own: the loop gets the last
answer at once, and waits at most ``ESTIMATE_PATIENCE`` seconds for the first only), or
``mtbf_seconds`` when configured (store-only: that or the default prior). A change of more
than a tenth is announced (``agent.summary.announce``: printed unless quiet). Only rank 0 decides when an auto save is due; the ranks save
together as for any due save.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agent.summary import announce, format_seconds
from ckpt.core.errors import CkptError
from ckpt.core.interval import bounded, waste_per_hour, young_daly

log = logging.getLogger("ckpt")

REFRESH_SECONDS = 600.0
ESTIMATE_PATIENCE = 2.0
DEFAULT_MTBF_SECONDS = 4 * 3600.0  # the control plane's default prior, store-only
_WEIGHT = 0.3  # of the newest save in the running average of the cost


class AutoInterval:
    def __init__(
        self,
        *,
        run: str,
        low: float,
        high: float,
        mtbf_seconds: float | None,
        estimate: Callable[[], float | None],
        quiet: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run, self._low, self._high, self._quiet = run, low, high, quiet
        self._fixed_mtbf, self._estimate, self._clock = mtbf_seconds, estimate, clock
        self.cost_seconds: float | None = None
        self.mtbf_seconds = mtbf_seconds or DEFAULT_MTBF_SECONDS
        self.seconds = low  # until a save is measured
        self._asked_at: float | None = None

    def measured(self, stall_seconds: float) -> None:
        """A save stalled the loop this long."""
        cost = self.cost_seconds
        self.cost_seconds = (
            stall_seconds if cost is None else (1 - _WEIGHT) * cost + _WEIGHT * stall_seconds
        )
        self._update()

    def current(self) -> float:
        """The interval in seconds, after asking for a new estimate if it is time."""
        now = self._clock()
        if self._fixed_mtbf is None and (
            self._asked_at is None or now - self._asked_at >= REFRESH_SECONDS
        ):
            self._asked_at = now
            try:
                self.mtbf_seconds = self._estimate() or self.mtbf_seconds
            except CkptError as err:
                log.warning(
                    "run %s: no estimate of the time between preemptions: %s", self._run, err
                )
            self._update()
        return self.seconds

    def waste_seconds_per_hour(self) -> float | None:
        """What the current interval is expected to lose each hour; None before a save."""
        if self.cost_seconds is None:
            return None
        return waste_per_hour(
            interval_seconds=self.seconds,
            cost_seconds=self.cost_seconds,
            mtbf_seconds=self.mtbf_seconds,
        )

    def _update(self) -> None:
        if self.cost_seconds is None:
            return
        chosen = bounded(
            young_daly(cost_seconds=self.cost_seconds, mtbf_seconds=self.mtbf_seconds),
            low=self._low,
            high=self._high,
        )
        before, self.seconds = self.seconds, chosen
        if abs(chosen - before) > 0.1 * before:
            self._announce()

    def _announce(self) -> None:
        assert self.cost_seconds is not None
        waste = self.waste_seconds_per_hour()
        assert waste is not None
        announce(
            f"ckpt: run {self._run}: saving every {format_seconds(self.seconds)} (a save "
            f"stalls {format_seconds(self.cost_seconds)}, preemptions come every "
            f"{self.mtbf_seconds / 3600:.3g} h on average: {format_seconds(waste)} of each "
            "hour expected lost)",
            quiet=self._quiet,
        )
