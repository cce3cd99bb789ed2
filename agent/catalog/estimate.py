"""The control plane's estimate of the time between preemptions (``every="auto"``), asked on
a thread of its own: the training loop that wants it never waits on the control plane but
for the very first answer, and that at most ``first_wait`` seconds."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future

from ckpt.core.errors import CkptError

log = logging.getLogger("ckpt")


class Estimate:
    """``latest()`` starts a question when none is in flight and returns the newest answer
    (None before any): an answer asked for now is used from the next call on."""

    def __init__(self, ask: Callable[[], float], *, first_wait: float, what: str) -> None:
        self._ask, self._first_wait, self._what = ask, first_wait, what
        self._lock = threading.Lock()
        self._asking: Future[float | None] | None = None
        self._answer: float | None = None

    def latest(self) -> float | None:
        with self._lock:
            asking = self._asking
            if asking is None or asking.done():
                self._take(asking)
                asking = self._asking = self._start()
            first = self._answer is None
        if first:
            futures.wait([asking], timeout=self._first_wait)
        with self._lock:
            if asking.done():
                self._take(asking)
            return self._answer

    def _take(self, asked: Future[float | None] | None) -> None:
        if asked is not None and asked.done() and (answer := asked.result()) is not None:
            self._answer = answer

    def _start(self) -> Future[float | None]:
        asking: Future[float | None] = Future()

        def ask() -> None:
            try:
                asking.set_result(self._ask())
            except CkptError as err:
                log.warning("%s: no estimate of the time between preemptions: %s", self._what, err)
                asking.set_result(None)
            except BaseException as err:  # handed to the loop that asked
                asking.set_exception(err)

        threading.Thread(target=ask, name="ckpt-estimate", daemon=True).start()
        return asking
