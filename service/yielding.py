"""Bulk work steps aside while a priority request is in flight.

Two cores, one GIL: a bulk request that runs (a query of 10,000 blobs, a long lineage)
takes the GIL in slices and a core, and ``/resumable`` or a heartbeat waits for both at
each of its statements. So a bulk request's thread pauses, at points where it holds no
lock and no transaction (between slices of its body's parse, between groups of store
stats, between its reads), while any priority request is in flight in the process, for
at most ``CKPT_BULK_YIELD_SECONDS`` in all: the priority request runs alone, and a bulk
request is answered that much later at most, however many priority requests come.

``BulkTurns``, an ASGI middleware, runs ``CKPT_BULK_CONCURRENCY`` (1) bulk requests at once:
one that runs holds the GIL in slices and a core, and two or more leave the priority
class's threads waiting for both at every query they make. It gives each bulk request its
budget (``turn``); the bulk code calls ``step_aside`` at its pause points, which does
nothing outside a bulk request or on the event loop. ``MarkPriority``, just inside the
token limits, counts the priority requests in flight in ``PriorityGate``: from their
admission, while their bodies arrive and they are routed, to their answers sent.

Under ``ckpt server`` on PostgreSQL the bulk requests have a process of their own
(``service.bulk_process``): what is here serves them where they share the priority class's
process, on SQLite and while that process is starting or gone.

Pause points are worth what the longest stretch between two of them is: measured under
``bench/flood.py --probe resumable --mix``, a bulk request took 2.9 ms (median) to 13 ms
(p99) to pause after a priority request arrived, until the longest stretches were cut (a
page of 500 runs in one statement each, 10-15 ms; validation in slices of 500 blobs,
1-2 ms; the grouping of ``sorted_in_steps``): now 1.0-1.2 ms and 10 ms
(docs/performance.md).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from service.admission import Head, RouteClass
from service.metrics import Metrics


class PriorityGate:
    """How many priority requests the process has in flight; bulk work waits for none."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._in_flight = 0

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Count one priority request in flight for the block."""
        with self._idle:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.notify_all()

    @property
    def busy(self) -> bool:
        """Whether a priority request is in flight (read without the lock: a hint)."""
        return self._in_flight > 0

    def wait_idle(self, timeout: float) -> float:
        """Wait until no priority request is in flight, ``timeout`` seconds at most; the
        seconds waited."""
        start = time.monotonic()
        with self._idle:
            self._idle.wait_for(lambda: not self._in_flight, timeout)
        return time.monotonic() - start


@dataclass
class _Turn:
    gate: PriorityGate
    metrics: Metrics
    budget: float  # seconds the request may still wait


_turn: ContextVar[_Turn | None] = ContextVar("bulk_turn", default=None)


@contextmanager
def turn(gate: PriorityGate, metrics: Metrics, budget: float) -> Iterator[None]:
    """Mark the block (and the worker threads it hands work to, which copy the context) as
    a bulk request's, which steps aside for at most ``budget`` seconds in all."""
    token = _turn.set(_Turn(gate=gate, metrics=metrics, budget=budget) if budget > 0 else None)
    try:
        yield
    finally:
        _turn.reset(token)


def step_aside() -> None:
    """A pause point of bulk work: wait while a priority request is in flight, within the
    request's budget. Call it only where the thread holds no lock, row or table, and no
    transaction (SQLite's hold the write lock)."""
    current = _turn.get()
    if current is None or current.budget <= 0 or not current.gate.busy or _on_event_loop():
        return
    current.metrics.bulk_yielding.inc()
    try:
        waited = current.gate.wait_idle(current.budget)
    finally:
        current.metrics.bulk_yielding.dec()
    current.budget -= waited
    current.metrics.bulk_yield_seconds.inc(waited)


class BulkTurns:
    """The ASGI middleware that runs ``concurrency`` bulk requests at once; the others wait
    their turn on the event loop. Inside the body limit, which has read the body: a client
    that sends its body slowly waits for it without holding a turn. The one that runs steps
    aside (``step_aside``), ``yield_seconds`` in all at most, while ``gate`` counts a
    priority request in flight (``MarkPriority``)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        concurrency: int,
        metrics: Metrics,
        gate: PriorityGate,
        yield_seconds: float,
    ) -> None:
        self.app = app
        self.turns = asyncio.Semaphore(concurrency)
        self.metrics = metrics
        self.gate = gate
        self.yield_seconds = yield_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route_class = Head.of(scope).route_class if scope["type"] == "http" else None
        if route_class is not RouteClass.BULK:
            await self.app(scope, receive, send)
            return
        self.metrics.bulk_waiting.inc()
        try:
            await self.turns.acquire()
        finally:
            self.metrics.bulk_waiting.dec()
        try:
            with turn(self.gate, self.metrics, self.yield_seconds):
                await self.app(scope, receive, send)
        finally:
            self.turns.release()


class MarkPriority:
    """The ASGI middleware, just inside the token limits, that counts a priority request in
    ``gate`` from its admission (before its body is read) to its answer sent."""

    def __init__(self, app: ASGIApp, *, gate: PriorityGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and Head.of(scope).route_class is RouteClass.PRIORITY:
            with self.gate.serving():
                await self.app(scope, receive, send)
            return
        await self.app(scope, receive, send)


# Words grouped between two pause points of ``sorted_in_steps``: 10,000 took 3-5 ms.
_GROUPING_STEP = 1000


def sorted_in_steps(words: Iterable[str]) -> list[str]:
    """``sorted(words)``, stepping aside between steps: one ``sorted`` of 10,000 SHA-256
    hexes holds the GIL 2 ms in one C call. Grouped by their first two characters (a
    Python loop, which lets go of the GIL when another thread asks), each group sorted
    alone: the same order, for any strings, at about the same cost."""
    groups: dict[str, list[str]] = {}
    for count, word in enumerate(words):
        if not count % _GROUPING_STEP:
            step_aside()
        groups.setdefault(word[:2], []).append(word)
    ordered: list[str] = []
    for start in sorted(groups):
        step_aside()
        ordered += sorted(groups[start])
    return ordered


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
