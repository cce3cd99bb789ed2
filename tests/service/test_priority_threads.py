"""The priority class has worker threads of its own (``CKPT_PRIORITY_THREADS``): a heartbeat
and ``/resumable`` are served while bulk requests hold every other thread of the server
(issue 29: the scheduler's question must not wait behind bulk work). Against a real
``ckpt server`` on PostgreSQL, with the bulk budgets off so that bulk requests can take
all of FastAPI's 40 threads: each one waits on a lock this test holds on the audit
events, a state the test controls, then lets go."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from ckpt.core.storage import DirectoryStore
from tests.server_process import ServerProcess, ckpt_server
from tests.service.conftest import create_pg_database
from tests.service.helpers import register, save

RUN = "trained"
DEFAULT_THREADS = 40  # anyio's default limiter: what FastAPI's sync routes run in
HELD = DEFAULT_THREADS + 8  # more bulk requests than threads: some wait for one
HANG_GUARD = 120.0  # only ends a test that would otherwise hang


@pytest.fixture
def server(pg_databases: list[str], tmp_path: Path) -> Iterator[ServerProcess]:
    url = create_pg_database()
    pg_databases.append(url)
    env = {"CKPT_MAX_BULK_IN_FLIGHT": "0", "CKPT_MAX_EXPENSIVE_PER_TOKEN": "0"}
    with ckpt_server(tmp_path, database_url=url, env=env) as running:
        yield running


def plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def waiting_on_locks(database: psycopg.Connection[tuple[int]]) -> int:
    """The server's sessions waiting for a lock (on the events this test holds)."""
    found = database.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
    ).fetchone()
    assert found is not None
    return found[0]


def test_priority_requests_are_served_while_bulk_requests_hold_every_other_thread(
    server: ServerProcess, pg_databases: list[str]
) -> None:
    store = DirectoryStore(server.store)
    with server.client() as admin:
        attempt = register(admin, RUN)
        save(admin, store, RUN, attempt, step=10)
    answers: list[int] = []

    def events() -> None:
        with server.client() as client:
            answers.append(client.get(f"/v1/runs/{RUN}/events", timeout=HANG_GUARD).status_code)

    bulk = [threading.Thread(target=events) for _ in range(HELD)]
    with (
        psycopg.connect(plain(pg_databases[-1])) as holder,
        psycopg.connect(plain(pg_databases[-1]), autocommit=True) as watcher,
    ):
        holder.execute("LOCK TABLE bundle_event IN ACCESS EXCLUSIVE MODE")
        for thread in bulk:
            thread.start()
        deadline = time.monotonic() + HANG_GUARD
        while waiting_on_locks(watcher) < DEFAULT_THREADS:  # every thread taken
            assert time.monotonic() < deadline, f"{waiting_on_locks(watcher)} waiting"
            time.sleep(0.05)
        with server.client() as trainer:
            beat = trainer.post(
                f"/v1/attempts/{attempt['attempt_id']}/heartbeat",
                json={"step": 11},
                timeout=HANG_GUARD,
            )
            resumable = trainer.get(f"/v1/runs/{RUN}/resumable", timeout=HANG_GUARD)
        still_waiting = waiting_on_locks(watcher)
        holder.rollback()  # lets the bulk requests go
    for thread in bulk:
        thread.join()
    assert beat.status_code == 200, beat.text
    assert resumable.status_code == 200, resumable.text
    assert resumable.json()["step"] == 10
    assert still_waiting == DEFAULT_THREADS  # served while the bulk requests held them all
    assert answers == [200] * HELD
