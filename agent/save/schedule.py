"""Whether a step boundary saves (``Checkpointer.maybe_save``), agreed by every rank.

A save is due by the policy (every N steps and/or T seconds, or ``every="auto"``'s interval)
or because a cloud announced a preemption; a stop signal ends the process here instead
(``attempt.grace``). A due save then waits for the bytes of the one before, or is skipped
(``in_flight="skip"``); never for the control plane, whose commits wait in the background.
Every rank decides
alike: a signal, a clock or a notice on one rank moves them all at this same boundary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agent.attempt.goodput import TimeAccount
from agent.attempt.grace import Preemption
from agent.attempt.interval import AutoInterval
from agent.attempt.notices import Notice, NoticeWatch
from agent.catalog.base import Catalog
from agent.config import Config, InFlight
from agent.ranks.base import MEET_SECONDS, Ranks
from agent.save.persist import Persister
from agent.save.policy import Position, SavePolicy
from ckpt.core.errors import CkptError

log = logging.getLogger("ckpt")


class SaveSchedule:
    """When the next save is due: the policy against the last position saved or resumed."""

    def __init__(
        self,
        config: Config,
        *,
        catalog: Catalog,
        ranks: Ranks,
        persister: Persister,
        preemption: Preemption,
        time_spent: TimeAccount,
        step: Callable[[], int],
    ) -> None:
        self.policy = SavePolicy(every_steps=config.every_steps, every_seconds=config.every_seconds)
        self.last: Position | None = None  # saved or resumed from, this attempt
        self._last_time = time.monotonic()
        self._run, self._skip = config.run, config.in_flight is InFlight.SKIP
        self._catalog, self._ranks, self._persister = catalog, ranks, persister
        self._preemption, self._time_spent, self._step = preemption, time_spent, step
        self.auto = (  # every="auto"'s interval, re-sized as saves are measured
            AutoInterval(
                run=config.run,
                low=config.auto_min_seconds,
                high=config.auto_max_seconds,
                mtbf_seconds=config.mtbf_seconds,
                estimate=catalog.preemption_rate,
                quiet=config.quiet or ranks.rank != 0,  # rank 0 times auto saves for all
            )
            if config.every == "auto"
            else None
        )
        self._notices = NoticeWatch(
            config.notices,
            poll_seconds=config.notice_poll_seconds,
            url=config.metadata_url,
            on_notice=self._noticed,
        )
        if config.notices:
            self._notices.start()

    def due(self, position: Position) -> bool:
        """Whether every rank saves at ``position`` now; after a stop signal, the process ends
        here instead (``Preemption.act``)."""
        seconds = time.monotonic() - self._last_time
        if self.auto is not None and self._ranks.rank == 0:  # rank 0 times auto saves for all
            self.policy = SavePolicy(every_seconds=self.auto.current())
        due = self.policy.due(position, last=self.last, seconds_since_last=seconds)
        stop, due, noticed = self._ranks.any_rank(
            self._preemption.requested,
            due,
            self._notices.take() is not None,
            timeout=MEET_SECONDS,
        )
        if stop:
            self._preemption.act()
        if noticed and position != self.last:
            log.warning("run %s: saving at %s after a preemption notice", self._run, position)
            due = True
        if not due:
            return False
        waiting = time.perf_counter()
        ready = self._persister.ready(skip=self._skip and not noticed)
        self._time_spent.stalled(time.perf_counter() - waiting)  # for the save in flight
        return self._ranks.all_ok(ready, timeout=MEET_SECONDS)

    def saved(self, position: Position) -> None:
        """A save at ``position``, or a resume from it: the next interval starts now."""
        self.last = position
        self._last_time = time.monotonic()

    def measured(self, stall: float) -> None:
        """A save was submitted after stalling the loop ``stall`` seconds: ``every="auto"``
        re-sizes its interval by it, and the attempt reports the new one."""
        if self.auto is not None:
            self.auto.measured(stall)
            self._catalog.interval(self.auto.seconds, self.auto.waste_seconds_per_hour())

    def close(self) -> None:
        self._notices.stop()

    def _noticed(self, notice: Notice) -> None:
        """A cloud's notice (on the watcher's thread): the attempt records it."""
        try:
            self._catalog.notice(notice, step=self._step())
        except CkptError as err:
            log.warning("run %s: could not record the notice: %s", self._run, err)
