"""This process's attempt at a run, as the control plane knows it.

Registering an attempt gives it the run's next fencing epoch (every older attempt is fenced:
its writes get 409 from then on) and, when it resumes, the bundle to resume from. While it
lives it heartbeats every ``heartbeat_seconds`` with its step (each retried for the client's
``retry_seconds``, as every call is: an outage shorter than that costs no heartbeat), so that the control plane can
tell a preempted pod that never said goodbye (lost) from a live one; when it ends it says
how (finished, preempted, failed), once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

from agent.attempt.notices import Notice
from agent.catalog.client import ControlPlane, Registration
from agent.ranks.base import Ranks
from ckpt.core.errors import CkptError, FencedError

log = logging.getLogger("ckpt")


def pod_name() -> str:
    """``CKPT_POD`` (the hostname by default), with ``/CKPT_POD_UID`` when set: a recreated
    pod may reuse its name, never its UID."""
    name = os.environ.get("CKPT_POD") or socket.gethostname()
    uid = os.environ.get("CKPT_POD_UID")
    return f"{name}/{uid}" if uid else name


class Outbox(Protocol):
    """What rides on a rank's heartbeats besides its step (``agent.verify.keep``)."""

    def pending(self) -> list[dict[str, Any]]: ...

    def sent(self, fingerprints: list[dict[str, Any]]) -> None: ...


class Attempt:
    """Registers, heartbeats and ends one attempt at ``run``."""

    def __init__(
        self,
        control: ControlPlane,
        *,
        run: str,
        heartbeat_seconds: float,
        step: Callable[[], int],
        ranks: Ranks,
        store_url: str,
    ) -> None:
        self.registration: Registration | None = None
        self._control, self._run, self._ranks = control, run, ranks
        self._store_url = store_url
        self._heartbeat_seconds = heartbeat_seconds
        self._step = step
        self._stopping = threading.Event()
        self._heartbeats: threading.Thread | None = None
        self._end_lock = threading.Lock()
        self._ended = False
        self._early_notice: tuple[Notice, int] | None = None
        self.interval: tuple[float, float | None] | None = None  # sent with each heartbeat
        # Where the attempt's time went so far (agent.attempt.goodput), sent likewise.
        self.time: Callable[[], dict[str, float | int] | None] = lambda: None
        self.outbox: Outbox | None = None  # the fingerprints of this rank's steps

    def register(self, *, resume: bool) -> Registration:
        """Register a new attempt (fencing every older one); heartbeats start with the first."""
        registration = self._ranks.from_first(
            lambda: self._control.register(
                self._run,
                pod=pod_name(),
                node=os.environ.get("CKPT_NODE"),
                pool=os.environ.get("CKPT_POOL"),
                resume=resume,
            ),
            timeout=self._control.retry_seconds,
        )
        with self._end_lock:
            self.registration = registration
            early, self._early_notice = self._early_notice, None
        if early is not None:
            try:
                self._control.notice(registration.attempt_id, notice=early[0], step=early[1])
            except CkptError as err:
                log.warning("run %s: could not record the notice: %s", self._run, err)
        log.info(
            "run %s: registered attempt %d (epoch %d) with %s",
            self._run,
            registration.attempt_id,
            registration.epoch,
            self._control.url,
        )
        if registration.store not in (None, self._store_url):
            log.warning(
                "run %s: this process writes bundles to %s, the control plane at %s reads %s; "
                "unless both name the same storage, every commit will fail",
                self._run,
                self._store_url,
                self._control.url,
                registration.store,
            )
        if self._heartbeats is None:
            self._heartbeats = threading.Thread(
                target=self._beat, name="ckpt-heartbeat", daemon=True
            )
            self._heartbeats.start()
        return registration

    def current(self) -> Registration:
        """The registered attempt; one that saves before any resume registers here."""
        return self.registration or self.register(resume=False)

    def end(
        self, reason: str, *, final_save_committed: bool, step: int, patience: float | None
    ) -> None:
        """Stop the heartbeats and report the end, once (the deadline action of a preemption
        may race the training loop to it)."""
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
        self._stopping.set()
        if self.registration is not None and self._ranks.rank == 0:  # one end per attempt
            self._control.end(
                self.registration.attempt_id,
                reason=reason,
                final_save_committed=final_save_committed,
                step=step,
                patience=patience,
                time=self.time(),
            )

    def notice(self, notice: Notice, *, step: int) -> None:
        """Record a cloud's notice of a coming preemption on the attempt (from any rank: the
        first one is kept); one read before the attempt registers is recorded then."""
        with self._end_lock:
            registration = self.registration
            if registration is None:
                self._early_notice = (notice, step)
                return
        self._control.notice(registration.attempt_id, notice=notice, step=step)

    def stop(self) -> None:
        """Stop the heartbeats without reporting an end."""
        self._stopping.set()

    def beat(self, *, patience: float | None = None) -> None:
        """Heartbeat now, with what the outbox holds (a no-op before the attempt registers),
        retried for ``patience`` seconds (default: the client's ``retry_seconds``)."""
        registration = self.registration
        if registration is None:
            return
        outbox = self.outbox
        fingerprints = outbox.pending() if outbox is not None else []
        self._control.heartbeat(
            registration.attempt_id,
            step=self._step(),
            rank=self._ranks.rank,
            patience=self._control.retry_seconds if patience is None else patience,
            interval=self.interval,
            time=self.time() if self._ranks.rank == 0 else None,
            fingerprints=fingerprints,
        )
        if outbox is not None:
            outbox.sent(fingerprints)

    def _beat(self) -> None:
        while not self._stopping.wait(self._heartbeat_seconds):
            try:
                self.beat()
            except FencedError as err:
                log.error("run %s: %s; heartbeats stop", self._run, err)
                return
            except RuntimeError:  # httpx: the client closed under a heartbeat still retrying
                if self._stopping.is_set():
                    return
                raise
            except CkptError as err:
                log.warning("run %s: heartbeat failed: %s", self._run, err)
