"""After SIGTERM or SIGINT: spend what is left of the grace period well, then exit.

At the next step boundary (``Checkpointer.maybe_save``) the agent waits for the save in
flight, saves once more if the position moved and the last measured save fits in what is
left of the grace period (else keeps the last bundle), ends the attempt as preempted with
whether this position is durable, and exits ``128 + signal``. When no boundary comes in
time (a long step, an evaluation, a stuck collective), the deadline ends the attempt and
the process itself, keeping the last bundle. ``signals`` catches the signal.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
from collections.abc import Callable
from typing import NoReturn, Protocol

from agent.attempt.signals import SignalWatch
from agent.ranks.base import Ranks
from agent.save.persist import Persister
from agent.save.policy import Position
from agent.save.result import PendingSave
from ckpt.core.errors import CkptError

log = logging.getLogger("ckpt")


class End(Protocol):
    def __call__(self, reason: str, *, final_save_committed: bool, patience: float) -> None: ...


def deadline_seconds(grace_seconds: float) -> float:
    """When the agent gives up waiting for a step boundary: a margin before the end of the
    grace period leaves the interpreter time to exit (about a second here)."""
    margin = min(max(1.0, 0.1 * grace_seconds), 5.0, grace_seconds / 2)
    return grace_seconds - margin


def describe(durable_at: Position | None) -> str:
    if durable_at is None:
        return "nothing is saved yet, so the run starts over"
    return f"the last bundle is at {durable_at}"


class Preemption:
    """What a checkpointer does between a stop signal and its exit."""

    def __init__(
        self,
        *,
        run: str,
        ranks: Ranks,
        grace_seconds: float,
        persister: Persister,
        save: Callable[[], PendingSave],
        position: Callable[[], Position],
        end: End,
        install: bool,
    ) -> None:
        self._run, self._persister, self._ranks = run, persister, ranks
        self._save, self._position, self._end = save, position, end
        self.signals = SignalWatch(
            deadline_seconds=deadline_seconds(grace_seconds), on_deadline=self._deadline_passed
        )
        if install:
            self.signals.install()

    @property
    def requested(self) -> bool:
        """Whether a stop signal came."""
        return self.signals.requested

    def act(self) -> NoReturn:
        """At a step boundary after a signal (to this rank or another of the job): make the
        newest state durable if there is time, end the attempt as preempted, exit. The ranks
        decide each step together, so all save or none does."""
        signum = self.signals.signum or signal.SIGTERM  # the signal may have reached another rank
        finished = False
        try:
            finished = self._together(self._finish_in_flight())
            if finished and self._position() != self._persister.durable_at:
                finished = self._emergency_save()
        finally:
            self.signals.settle()  # from here on the exit is this thread's
            committed = self._persister.durable_at == self._position()
            self._end_attempt(committed, patience=max(self._budget(), 0.5))
        log.warning(
            "run %s: preempted by %s at %s; %s; exiting with %d",
            self._run,
            signal.Signals(signum).name,
            self._position(),
            "this position is saved" if committed else describe(self._persister.durable_at),
            128 + signum,
        )
        if not finished:  # an upload still runs: the interpreter's exit would wait for it
            exit_now(128 + signum)
        # The interpreter's exit collects the whole heap several times over: with torch
        # loaded, 2 CPU-seconds, half a minute on a busy machine, past the grace period.
        # Objects alive now are left to the OS; the SystemExit unwinds as before.
        gc.freeze()
        raise SystemExit(128 + signum)

    def close(self) -> None:
        """Give the signals back."""
        self.signals.uninstall()

    def _budget(self) -> float:
        """Seconds left before the deadline of the signal's grace period."""
        return self.signals.deadline_seconds - self.signals.elapsed()

    def _finish_in_flight(self) -> bool:
        """Wait for the save in flight within the budget; False when time ran out."""
        try:
            self._persister.wait(timeout=max(self._budget(), 0.0))
        except TimeoutError:
            log.error(
                "run %s: the save in flight did not finish within the grace period", self._run
            )
            return False
        except CkptError as err:
            log.error("run %s: the save in flight failed: %s", self._run, err)
        return True

    def _emergency_save(self) -> bool:
        """Save once more if the last measured save fits; False when it ran out of time."""
        estimate, left = self._persister.save_seconds, self._budget()
        if not self._together(estimate is not None and estimate <= left):
            known = (
                "no save was measured yet" if estimate is None else f"a save takes {estimate:.1f} s"
            )
            log.warning(
                "run %s: not saving after the signal (%s, %.1f s left); the last bundle stays",
                self._run,
                known,
                left,
            )
            return True
        try:
            self._save().wait(timeout=max(self._budget(), 0.0))
        except TimeoutError:
            log.error("run %s: the emergency save did not finish in time", self._run)
            return False
        except CkptError as err:
            log.error("run %s: the emergency save failed: %s", self._run, err)
        return True

    def _together(self, ok: bool) -> bool:
        """Whether every rank can go on (a rank short of time makes every rank stop)."""
        return self._ranks.all_ok(ok, timeout=max(self._budget(), 1.0))

    def _end_attempt(self, committed: bool, *, patience: float) -> None:
        try:
            self._end("preempted", final_save_committed=committed, patience=patience)
        except CkptError as err:
            log.error("run %s: could not end the attempt: %s", self._run, err)

    def _deadline_passed(self) -> None:
        """The grace period is nearly over and the loop reached no step boundary: end the
        attempt and the process now, keeping the last bundle."""
        signum = self.signals.signum or signal.SIGTERM
        log.error(
            "run %s: no step boundary within the grace period; exiting (%s)",
            self._run,
            describe(self._persister.durable_at),
        )
        self._end_attempt(False, patience=1.0)
        exit_now(128 + signum)


def exit_now(code: int) -> NoReturn:
    """Leave without waiting for threads (an upload that can no longer finish in time)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)
