"""A bulk request that runs steps aside while a priority request is in flight
(``service.yielding``, ``CKPT_BULK_YIELD_SECONDS``; issue 29: the scheduler's question must
not wait behind bulk work). Against a real ``ckpt server`` on PostgreSQL: this test holds a
heartbeat in flight by locking its attempt's row, a state it controls, sends a bulk request
(a lineage: paused before a statement of its autocommit reads; a query of 10,000 blobs:
paused in its body's parse), and watches ``ckpt_bulk_yielding`` while it waits; or holds
a heartbeat's body back, the request admitted and in flight already."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
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
from tests.service.test_priority_threads import HANG_GUARD, plain, waiting_on_locks

RUN = "trained"
BLOBS = 10_000  # a query this large is bulk (service.admission), and parsed in slices


def metric(server: ServerProcess, name: str) -> float | None:
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def lineage(client: httpx.Client) -> httpx.Response:
    return client.get(f"/v1/runs/{RUN}/lineage", timeout=HANG_GUARD)


def blob_query(client: httpx.Client) -> httpx.Response:
    blobs = [
        {"sha256": hashlib.sha256(f"yield-{i}".encode()).hexdigest(), "size": 1 + i}
        for i in range(BLOBS)
    ]
    body = json.dumps({"blobs": blobs}).encode()
    headers = {"Content-Type": "application/json"}
    return client.post("/v1/blobs/missing", content=body, headers=headers, timeout=HANG_GUARD)


BULK: dict[str, Callable[[httpx.Client], httpx.Response]] = {
    "lineage": lineage,
    "blob_query": blob_query,
}


def in_thread(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(call()))
    thread.start()
    return thread, answers


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def yielding_server(
    pg_databases: list[str], tmp_path: Path, budget: float
) -> Iterator[ServerProcess]:
    url = create_pg_database()
    pg_databases.append(url)
    # Bulk work in the serving process, as on SQLite and while a bulk process is away
    # (tests/service/test_bulk_process.py): on PostgreSQL it has a process of its own.
    env = {"CKPT_BULK_YIELD_SECONDS": str(budget), "CKPT_BULK_PROCESS": "0"}
    with ckpt_server(tmp_path, database_url=url, env=env) as running:
        yield running


@pytest.fixture
def patient(pg_databases: list[str], tmp_path: Path) -> Iterator[ServerProcess]:
    """Bulk requests step aside for as long as the test may wait."""
    yield from yielding_server(pg_databases, tmp_path, HANG_GUARD)


@pytest.fixture
def brief(pg_databases: list[str], tmp_path: Path) -> Iterator[ServerProcess]:
    """Bulk requests step aside for a tenth of a second in all."""
    yield from yielding_server(pg_databases, tmp_path, 0.1)


@contextmanager
def heartbeat_held(
    server: ServerProcess, database: str
) -> Iterator[tuple[psycopg.Connection[Any], Callable[[], None], list[httpx.Response]]]:
    """A heartbeat in flight, waiting on its attempt's row, which this test locks. Yields a
    connection to watch the waits with, the release of the lock, and the heartbeat's answer
    (in once released)."""
    store = DirectoryStore(server.store)
    with server.client() as admin:
        attempt = register(admin, RUN)
        save(admin, store, RUN, attempt, step=10)
    attempt_id = attempt["attempt_id"]
    with (
        psycopg.connect(plain(database)) as holder,
        psycopg.connect(plain(database), autocommit=True) as watcher,
    ):
        holder.execute("SELECT id FROM attempt WHERE id = %s FOR UPDATE", (attempt_id,))

        def beat() -> httpx.Response:
            with server.client() as trainer:
                url = f"/v1/attempts/{attempt_id}/heartbeat"
                return trainer.post(url, json={"step": 11}, timeout=HANG_GUARD)

        thread, answers = in_thread(beat)
        try:
            until(lambda: waiting_on_locks(watcher) == 1, "the heartbeat to wait on the row")
            yield watcher, holder.rollback, answers
        finally:
            holder.rollback()
            thread.join()


@pytest.mark.parametrize("bulk", sorted(BULK))
def test_a_bulk_request_waits_while_a_heartbeat_is_in_flight(
    patient: ServerProcess, pg_databases: list[str], bulk: str
) -> None:
    server = patient
    with (
        heartbeat_held(server, pg_databases[-1]) as (watcher, release, beat),
        server.client() as reader,
    ):
        thread, answers = in_thread(lambda: BULK[bulk](reader))
        until(lambda: metric(server, "ckpt_bulk_yielding") == 1, "the bulk request to yield")
        assert answers == []  # it waits, holding no lock the heartbeat needs
        assert waiting_on_locks(watcher) == 1
        release()
        thread.join()
    assert beat[0].status_code == 200, beat[0].text
    assert answers[0].status_code == 200, answers[0].text
    assert metric(server, "ckpt_bulk_yielding") == 0
    waited = metric(server, "ckpt_bulk_yield_seconds_total")
    assert waited is not None and waited > 0


def test_a_bulk_request_waits_no_longer_than_its_budget(
    brief: ServerProcess, pg_databases: list[str]
) -> None:
    server = brief
    with (
        heartbeat_held(server, pg_databases[-1]) as (watcher, _, beat),
        server.client() as reader,
    ):
        answer = lineage(reader)  # answered while the heartbeat still waits
        still_waiting = waiting_on_locks(watcher)
    assert answer.status_code == 200, answer.text
    assert still_waiting == 1
    assert beat[0].status_code == 200, beat[0].text
    waited = metric(server, "ckpt_bulk_yield_seconds_total")
    assert waited is not None and 0.05 < waited < 1


def test_a_priority_request_counts_in_flight_while_its_body_arrives(
    patient: ServerProcess,
) -> None:
    """A heartbeat is in flight from its admission, not from its route: while its body is
    still on the way, a bulk request steps aside for it."""
    server = patient
    store = DirectoryStore(server.store)
    with server.client() as admin:
        attempt = register(admin, RUN)
        save(admin, store, RUN, attempt, step=10)
    body = json.dumps({"step": 11}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD) as trainer:
        trainer.sendall(
            f"POST /v1/attempts/{attempt['attempt_id']}/heartbeat HTTP/1.1\r\n"
            f"Host: {host}\r\nAuthorization: Bearer {server.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )  # the head only: the body follows once the bulk request has stepped aside
        with server.client() as reader:
            thread, answers = in_thread(lambda: lineage(reader))
            until(lambda: metric(server, "ckpt_bulk_yielding") == 1, "the lineage to yield")
            assert answers == []
            trainer.sendall(body)
            thread.join()
        status_line = trainer.makefile("rb").readline()
    assert status_line.startswith(b"HTTP/1.1 200"), status_line
    assert answers[0].status_code == 200, answers[0].text
    assert metric(server, "ckpt_bulk_yielding") == 0
