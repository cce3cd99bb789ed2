"""A save's calls to the control plane, waited for a bounded time.

The client gives a try ``TRY_SECONDS`` at least, however short its patience: a slow answer
is an answer, not an outage. A save does not wait that long for one: each of its calls runs
on a thread of its own, and the save waits for it at most twice its patience. Without an
answer by then the call raises ``LateError`` and goes on in the background; the save writes
its bytes as in an outage (the store itself says which blobs it holds) and defers its commit,
whose calls are idempotent, so an answer that comes late only moves the commit to the
background. A save's bytes, and the next save's stall, thus never wait on a control plane
that holds the connection without answering.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import TypeVar, cast

from agent.catalog.client import ControlPlane, UnansweredError

T = TypeVar("T")


class LateError(UnansweredError):
    """A call gave no answer in the time the save waits; ``call`` is still running."""

    def __init__(self, message: str, *, call: Future[object]) -> None:
        super().__init__(message)
        self.call = call


def within(call: Callable[[], T], *, seconds: float, what: str) -> T:
    """``call``'s answer, or its failure, if it comes within ``seconds``.

    Raises:
        LateError: none came by then (the call goes on, on its daemon thread).
    """
    running: Future[T] = Future()

    def run() -> None:
        try:
            running.set_result(call())
        except BaseException as err:  # handed to the caller, if it still waits
            running.set_exception(err)

    threading.Thread(target=run, name="ckpt-call", daemon=True).start()
    if not futures.wait([running], timeout=seconds).done:
        raise LateError(
            f"{what}: no answer from the control plane in {seconds:g} s (still asked in the "
            "background)",
            call=cast("Future[object]", running),
        )
    return running.result()


class SaveCalls:
    """How a catalog's saves call the control plane: each call within twice its patience,
    and none while one they stopped waiting for still has no answer."""

    def __init__(self, control: ControlPlane) -> None:
        self._control = control
        self._late: Future[object] | None = None  # the newest call a save stopped waiting for

    @property
    def silent(self) -> bool:
        """Whether the control plane is known not to answer now: the client's last call got
        no answer, or a save's call it stopped waiting for still has none."""
        late = self._late
        return self._control.unreachable or (late is not None and not late.done())

    def answer(self, call: Callable[[], T], *, patience: float | None, what: str) -> T:
        """``call``'s answer; a save's call (``patience`` given) is waited for at most twice
        its patience, then goes on in the background."""
        if patience is None:
            return call()
        try:
            return within(call, seconds=2 * patience, what=what)
        except LateError as err:
            self._late = err.call
            raise
