"""A change to an attempt (a heartbeat, its end, a notice) locks its run before the attempt,
as every other write does (opening a bundle locks the run, then references the attempt), in
one statement on PostgreSQL. The test holds the attempt's row, sends a heartbeat, and once
the heartbeat waits for that row, finds the run already share-locked by it: with the locks
taken the other way round, the run is still free then, and a registration that locks the
run and then the attempts could deadlock with it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError

from tests.service.conftest import MakeServer
from tests.service.helpers import register

HANG_GUARD = 30.0


def waiting_on_locks(watcher: Connection) -> int:
    """Sessions of the database waiting for a lock, but the watcher's own."""
    count: int = watcher.execute(
        text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
    ).scalar_one()
    return count


def wait_until_one_waits(watcher: Connection, who: str) -> None:
    """Until a session of the database (but the watcher's) waits for a lock."""
    deadline = time.monotonic() + HANG_GUARD
    while waiting_on_locks(watcher) < 1:
        assert time.monotonic() < deadline, f"{who} never waited for the row"
        time.sleep(0.02)
        watcher.rollback()


def run_locked_while_waiting(
    engine: Engine, *, hold: str, row: int, run_name: str, send: Callable[[], httpx.Response]
) -> httpx.Response:
    """Hold a row (``hold``: a ``SELECT ... FOR UPDATE`` of the row whose id is ``row``),
    ``send`` a request in a thread, and once it waits for that row check that it holds the
    run's lock already; then let it go on. Its answer."""
    answers: list[httpx.Response] = []
    with engine.connect() as holder, engine.connect() as watcher, engine.connect() as probe:
        holder.execute(text(hold), {"id": row})
        sending = threading.Thread(target=lambda: answers.append(send()))
        sending.start()
        wait_until_one_waits(watcher, "the request")
        with pytest.raises(OperationalError, match="could not obtain lock"):
            probe.execute(
                text("SELECT id FROM run WHERE name = :name FOR UPDATE NOWAIT"), {"name": run_name}
            )
        probe.rollback()
        holder.rollback()  # the request goes on
        sending.join(HANG_GUARD)
    assert len(answers) == 1
    return answers[0]


def test_a_heartbeat_locks_the_run_before_the_attempt(
    make_server: MakeServer, run_name: str
) -> None:
    server = make_server("postgres")
    with server.client() as client:
        attempt = register(client, run_name)

    def beat() -> httpx.Response:
        with server.client() as trainer:
            return trainer.post(
                f"/v1/attempts/{attempt['attempt_id']}/heartbeat",
                json={"step": 1, "rank": 0},
                timeout=HANG_GUARD,
            )

    answer = run_locked_while_waiting(
        server.context.engine,
        hold="SELECT id FROM attempt WHERE id = :id FOR UPDATE",
        row=attempt["attempt_id"],
        run_name=run_name,
        send=beat,
    )
    assert answer.status_code == 200, answer.text
