"""One pass of a maintenance task at a time, across every replica.

On PostgreSQL a pass holds a session-level advisory lock (one key per task) on a connection
of its own for as long as it runs; a replica that finds the lock taken skips its pass. On
SQLite one process owns the catalog, so a lock per process suffices. Each pass is recorded
in ``maintenance_pass``: which replica ran it, when, and how it ended.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import Connection

from service.context import Context
from service.maintenance import repository
from service.models import utcnow

log = logging.getLogger("ckpt.service")


class Task(enum.StrEnum):
    GC = "gc"
    SCRUB = "scrub"


# Advisory lock keys: "ckpg" (the key garbage collection always used) and "ckps".
_KEYS = {Task.GC: 0x636B7067, Task.SCRUB: 0x636B7073}
_PROCESS_LOCKS: dict[tuple[str, Task], threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


@dataclass
class Pass:
    """A pass in progress: its ``maintenance_pass`` row; ``outcome`` is what it records."""

    id: int
    task: Task
    outcome: str = "done"


@contextlib.contextmanager
def exclusive(context: Context, task: Task) -> Iterator[Pass | None]:
    """Run the body as the one pass of ``task`` now: yields the recorded pass, or None when
    another pass of ``task`` (on any replica) holds the lock; then the body must skip."""
    with _lock(context, task) as acquired:
        if not acquired:
            log.info("%s: another pass is running; skipping this one", task)
            yield None
            return
        with context.transaction() as session:
            started = repository.start_pass(session, task=task, holder=holder(), at=utcnow())
        current = Pass(id=started, task=task)
        try:
            yield current
        except BaseException as err:
            _end(context, current, outcome=f"failed: {type(err).__name__}: {err}")
            raise
        _end(context, current, outcome=current.outcome)


def holder() -> str:
    """This replica, as ``maintenance_pass.holder`` names it: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _end(context: Context, current: Pass, *, outcome: str) -> None:
    try:
        with context.transaction() as session:
            repository.end_pass(session, pass_id=current.id, at=utcnow(), outcome=outcome)
    except Exception:  # the pass's own outcome (or error) matters more than its record
        log.exception("%s: cannot record the end of pass %d", current.task, current.id)


@contextlib.contextmanager
def _lock(context: Context, task: Task) -> Iterator[bool]:
    if context.engine.dialect.name != "postgresql":
        with _process_lock(str(context.engine.url), task) as acquired:
            yield acquired
        return
    with context.engine.connect() as connection:
        acquired = repository.try_advisory_lock(connection, key=_KEYS[task])
        try:
            yield acquired
        finally:
            if acquired:
                _unlock(connection, key=_KEYS[task])


def _unlock(connection: Connection, *, key: int) -> None:
    try:
        repository.advisory_unlock(connection, key=key)
    except Exception:
        # A pooled connection must not keep the lock: closing its session releases it.
        log.warning("cannot release maintenance lock %#x; closing its connection", key)
        connection.invalidate()


@contextlib.contextmanager
def _process_lock(database: str, task: Task) -> Iterator[bool]:
    with _PROCESS_LOCKS_GUARD:
        lock = _PROCESS_LOCKS.setdefault((database, task), threading.Lock())
    acquired = lock.acquire(blocking=False)
    try:
        yield acquired
    finally:
        if acquired:
            lock.release()
