"""A change to an attempt (a heartbeat, its end, a notice) locks its run before the attempt,
as every other write does (opening a bundle locks the run, then references the attempt), in
one statement on PostgreSQL. The test holds the attempt's row, sends a heartbeat, and once
the heartbeat waits for that row, finds the run already share-locked by it: with the locks
taken the other way round, the run is still free then, and a registration that locks the
run and then the attempts could deadlock with it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from sqlalchemy import Connection, text
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


def test_a_heartbeat_locks_the_run_before_the_attempt(
    make_server: MakeServer, run_name: str
) -> None:
    server = make_server("postgres")
    engine = server.context.engine
    with server.client() as client:
        attempt = register(client, run_name)
    answers: list[httpx.Response] = []

    def beat() -> None:
        with server.client() as trainer:
            answers.append(
                trainer.post(
                    f"/v1/attempts/{attempt['attempt_id']}/heartbeat",
                    json={"step": 1, "rank": 0},
                    timeout=HANG_GUARD,
                )
            )

    with engine.connect() as holder, engine.connect() as watcher, engine.connect() as probe:
        holder.execute(
            text("SELECT id FROM attempt WHERE id = :id FOR UPDATE"), {"id": attempt["attempt_id"]}
        )
        beating = threading.Thread(target=beat)
        beating.start()
        deadline = time.monotonic() + HANG_GUARD
        while waiting_on_locks(watcher) < 1:  # the heartbeat waits for the row
            assert time.monotonic() < deadline, "the heartbeat never waited for the attempt"
            time.sleep(0.02)
            watcher.rollback()
        with pytest.raises(OperationalError, match="could not obtain lock"):
            probe.execute(
                text("SELECT id FROM run WHERE name = :name FOR UPDATE NOWAIT"), {"name": run_name}
            )
        probe.rollback()
        holder.rollback()  # the heartbeat goes on
        beating.join(HANG_GUARD)
    assert [answer.status_code for answer in answers] == [200], answers[0].text
