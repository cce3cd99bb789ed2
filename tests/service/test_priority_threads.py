"""The priority class has worker threads of its own (``CKPT_PRIORITY_THREADS``): a heartbeat
and ``/resumable`` are served while bulk requests hold every other thread of the server
(issue 29: the scheduler's question must not wait behind bulk work); and bulk requests
run one at a time (``CKPT_BULK_CONCURRENCY``), the others waiting their turn without a
thread. Against a real ``ckpt server`` on PostgreSQL, with the bulk budgets off so that
bulk requests can take all of FastAPI's 40 threads: each one waits on a lock this test
holds on the audit events, a state the test controls, then lets go."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
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
QUEUED = 5  # bulk requests waiting their turn behind the one that runs


# The bulk budgets off, and bulk requests served in the serving process (as on SQLite, and
# while a bulk process is away: tests/service/test_bulk_process.py): its threads and turns
# are what these tests count; with a bulk process up, the requests would go there.
NO_BUDGETS = {
    "CKPT_MAX_BULK_IN_FLIGHT": "0",
    "CKPT_MAX_EXPENSIVE_PER_TOKEN": "0",
    "CKPT_BULK_PROCESS": "0",
}


@pytest.fixture
def server(pg_databases: list[str], tmp_path: Path) -> Iterator[ServerProcess]:
    """Bulk requests all at once (no turns): they take every thread."""
    url = create_pg_database()
    pg_databases.append(url)
    env = {**NO_BUDGETS, "CKPT_BULK_CONCURRENCY": "0"}
    with ckpt_server(tmp_path, database_url=url, env=env) as running:
        yield running


@pytest.fixture
def in_turns(pg_databases: list[str], tmp_path: Path) -> Iterator[ServerProcess]:
    """Bulk requests in turns, one at a time: the default."""
    url = create_pg_database()
    pg_databases.append(url)
    with ckpt_server(tmp_path, database_url=url, env=NO_BUDGETS) as running:
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


@contextmanager
def bulk_held_on_a_lock(
    server: ServerProcess, database: str, count: int
) -> Iterator[tuple[dict[str, Any], psycopg.Connection[Any], list[int]]]:
    """A run with one committed bundle, then ``count`` bulk requests (reads of its audit
    events) sent while this test holds a lock on the events: they wait on it until the block
    ends. Yields the attempt, a connection to watch the waits with, and the bulk requests'
    answers (all in once the block has ended)."""
    store = DirectoryStore(server.store)
    with server.client() as admin:
        attempt = register(admin, RUN)
        save(admin, store, RUN, attempt, step=10)
    answers: list[int] = []

    def events() -> None:
        with server.client() as client:
            answers.append(client.get(f"/v1/runs/{RUN}/events", timeout=HANG_GUARD).status_code)

    bulk = [threading.Thread(target=events) for _ in range(count)]
    with (
        psycopg.connect(plain(database)) as holder,
        psycopg.connect(plain(database), autocommit=True) as watcher,
    ):
        holder.execute("LOCK TABLE bundle_event IN ACCESS EXCLUSIVE MODE")
        for thread in bulk:
            thread.start()
        try:
            yield attempt, watcher, answers
        finally:
            holder.rollback()  # lets the bulk requests go
    for thread in bulk:
        thread.join()


def test_priority_requests_are_served_while_bulk_requests_hold_every_other_thread(
    server: ServerProcess, pg_databases: list[str]
) -> None:
    with bulk_held_on_a_lock(server, pg_databases[-1], HELD) as (attempt, watcher, answers):
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
    assert beat.status_code == 200, beat.text
    assert resumable.status_code == 200, resumable.text
    assert resumable.json()["step"] == 10
    assert still_waiting == DEFAULT_THREADS  # served while the bulk requests held them all
    assert answers == [200] * HELD


def bulk_waiting(server: ServerProcess) -> float | None:
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    found = re.search(r"^ckpt_bulk_waiting (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_bulk_requests_run_one_at_a_time_the_others_wait_their_turn(
    in_turns: ServerProcess, pg_databases: list[str]
) -> None:
    server = in_turns
    with bulk_held_on_a_lock(server, pg_databases[-1], QUEUED + 1) as (_, watcher, answers):
        deadline = time.monotonic() + HANG_GUARD
        while bulk_waiting(server) != QUEUED:  # one runs (and waits on the lock), the rest queue
            assert waiting_on_locks(watcher) <= 1, "a second bulk request ran beside the first"
            assert time.monotonic() < deadline, f"{bulk_waiting(server)} bulk requests waiting"
            time.sleep(0.05)
        running = waiting_on_locks(watcher)
        with server.client() as trainer:  # the priority class does not queue behind them
            resumable = trainer.get(f"/v1/runs/{RUN}/resumable", timeout=HANG_GUARD)
    assert running == 1
    assert resumable.status_code == 200, resumable.text
    assert answers == [200] * (QUEUED + 1)
    assert bulk_waiting(server) == 0
