"""Bulk requests served by a process of their own (``service.bulk_process``), against a
real ``ckpt server`` on PostgreSQL: forwarded there and answered as before, counted once
in ``/metrics``, served in the serving process while the bulk process is gone, the bulk
process started again when it dies and gone when the server is killed."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import replace
from functools import partial
from pathlib import Path

import httpx
import psycopg
import pytest

from service.settings import Settings
from tests.server_process import (
    ANSWER_HANG_GUARD,
    STARTUP_HANG_GUARD,
    ServerProcess,
    ckpt_server,
)
from tests.service.conftest import create_pg_database
from tests.service.test_priority_threads import plain, waiting_on_locks

BULK_PAGE = {"limit": 500}  # a page of more than 100 runs: bulk (service.admission)
TRIES = 5  # a bulk process started again before a request came: try again with the new one


@pytest.fixture
def database(pg_databases: list[str]) -> str:
    url = create_pg_database()
    pg_databases.append(url)
    return url


@pytest.fixture
def server(database: str, tmp_path: Path) -> Iterator[ServerProcess]:
    with ckpt_server(tmp_path, database_url=database) as running:
        up = lambda: metric(running, "ckpt_bulk_process_up") == 1  # noqa: E731
        wait_for(up, "the bulk process", STARTUP_HANG_GUARD)  # a start, on a busy machine
        yield running


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=ANSWER_HANG_GUARD).text
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def served(server: ServerProcess, where: str) -> float:
    return metric(server, "ckpt_bulk_served_total", f'{{where="{where}"}}')


def wait_for(condition: Callable[[], bool], what: str, guard: float = ANSWER_HANG_GUARD) -> None:
    """Until ``condition`` holds (a state of the server, read again and again)."""
    deadline = time.monotonic() + guard
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def bulk_process(server: ServerProcess) -> int:
    """The pid of the server's bulk process (a child of its serving process); 0: none now."""
    children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
    for child in map(int, children):
        with suppress(FileNotFoundError):  # a child that exited meanwhile
            if b"service.bulk_child" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
    return 0


def replaced(server: ServerProcess, dead: int) -> bool:
    """Whether the server has a bulk process again, not ``dead``."""
    return bulk_process(server) not in (0, dead)


def gone(pid: int) -> bool:
    """Exited: no such process, or one exited that no parent has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_bulk_requests_are_answered_by_the_bulk_process_and_counted_once(
    server: ServerProcess,
) -> None:
    labels = '{method="GET",route="/v1/runs",status="200"}'
    counted = metric(server, "ckpt_http_requests_total", labels)  # the start's checks
    with server.client() as client:
        page = client.get("/v1/runs", params=BULK_PAGE)
        small = client.get("/v1/runs", params={"limit": 5})  # not bulk: served here
        missing = client.get("/v1/runs/no-such-run/lineage")  # bulk, and an error
        # The path as the client sent it, not decoded: no 500 for what a URL cannot hold,
        # and no other route for an escaped "?".
        odd = [client.get(f"/v1/runs/{name}/lineage") for name in ("%00", "a%3F")]
    assert page.status_code == small.status_code == 200
    assert page.json() == small.json() == {"runs": [], "next": None}
    assert missing.status_code == 404
    assert missing.json()["error"] == "not_found"
    assert missing.headers["content-type"] == "application/json"
    assert [answer.status_code for answer in odd] == [422, 422], [a.text for a in odd]
    for answer in (page, missing):  # each header once: the serving process's, not twice
        names = [name.lower() for name, _ in answer.headers.raw]
        assert sorted(names) == sorted(set(names)), names
    assert served(server, "bulk_process") == 4
    assert served(server, "here") == 0
    # Each request counted once, by the process that served it.
    assert metric(server, "ckpt_http_requests_total", labels) == counted + 2


def test_a_dead_bulk_process_is_replaced_and_bulk_requests_are_served_meanwhile(
    server: ServerProcess,
) -> None:
    with server.client() as client:
        for tries in range(1, TRIES + 1):  # noqa: B007 (the count is read after the loop)
            first = kill_bulk_process(server)
            # Before the serving process starts another (1 s after it saw this one die),
            # bulk requests are served where they were before there was one.
            answer = client.get("/v1/runs", params=BULK_PAGE)
            assert answer.status_code == 200, answer.text
            if served(server, "here") == 1:
                break
            wait_for(partial(replaced, server, first), "a bulk process again")
        assert served(server, "here") == 1, f"a bulk process was always back within {tries}"
        exits = float(tries)
        wait_for(lambda: metric(server, "ckpt_bulk_process_exits_total") == exits, "the exit")
        wait_for(lambda: metric(server, "ckpt_bulk_process_up") == 1, "a new bulk process")
        assert replaced(server, first)
        before = served(server, "bulk_process")
        assert client.get("/v1/runs", params=BULK_PAGE).status_code == 200
    assert served(server, "bulk_process") == before + 1
    assert "the bulk process" in server.log.read_text()  # the serving process said so


def kill_bulk_process(server: ServerProcess) -> int:
    child = bulk_process(server)
    assert child
    os.kill(child, signal.SIGKILL)
    return child


def test_a_bulk_process_exits_with_its_serving_process(server: ServerProcess) -> None:
    child = bulk_process(server)
    assert child
    socket = Path(Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[3].decode())
    assert socket.exists()
    os.kill(server.pid, signal.SIGKILL)  # no shutdown: the bulk process sees its stdin close
    wait_for(lambda: gone(child), f"bulk process {child} to exit")
    assert not socket.parent.exists()  # its directory, which the serving process left


def test_a_bulk_process_killed_while_it_serves_leaves_a_503_to_retry(
    server: ServerProcess, database: str
) -> None:
    """Killed while it serves a GC pass (which it may have carried out): the client is
    answered 503 with Retry-After, not a reset connection."""
    child = bulk_process(server)
    assert child
    with (
        psycopg.connect(plain(database)) as holder,
        psycopg.connect(plain(database), autocommit=True) as watcher,
        server.client() as client,
        ThreadPoolExecutor(1) as pool,
    ):
        # A GC pass starts by recording itself: it waits on this lock, in the bulk process.
        holder.execute("LOCK TABLE maintenance_pass IN ACCESS EXCLUSIVE MODE")
        answer = pool.submit(client.post, "/v1/gc", params={"dry_run": "true"})
        wait_for(lambda: waiting_on_locks(watcher) == 1, "the GC pass to wait on the lock")
        # What is not bulk is answered meanwhile.
        assert client.get("/v1/runs", params={"limit": 5}).status_code == 200
        os.kill(child, signal.SIGKILL)
        got = answer.result()
        holder.rollback()
    assert got.status_code == 503, got.text
    assert got.headers["retry-after"] == "1"
    assert got.json()["error"] == "retry"
    assert "retry it" in got.json()["message"]
    assert served(server, "retry") == 1
    wait_for(partial(replaced, server, child), "the bulk process started again")
    with server.client() as client:  # and the next pass is served by the new one
        assert client.post("/v1/gc", params={"dry_run": "true"}).status_code == 200


def test_each_worker_has_a_bulk_process_and_stops_it(
    pg_databases: list[str], tmp_path: Path
) -> None:
    url = create_pg_database()
    pg_databases.append(url)
    with ckpt_server(tmp_path, database_url=url, env={"CKPT_WORKERS": "2"}) as running:
        wait_for(lambda: metric(running, "ckpt_bulk_process_up") == 2, "two bulk processes")
        # The supervisor's children: the two workers, and multiprocessing's helper.
        children = Path(f"/proc/{running.pid}/task/{running.pid}/children").read_text().split()
        bulk = [bulk_process(replace(running, pid=int(child))) for child in children]
        bulk = [pid for pid in bulk if pid]
        assert len(bulk) == 2
    for pid in bulk:  # a server stopped (SIGTERM) stops them
        wait_for(partial(gone, pid), f"bulk process {pid} to exit")


def test_a_bulk_process_is_the_default_on_postgresql_only() -> None:
    postgresql = {"CKPT_DATABASE_URL": "postgresql://h/d"}
    assert Settings.from_env(postgresql).bulk_in_own_process
    assert not Settings.from_env({**postgresql, "CKPT_BULK_PROCESS": "0"}).bulk_in_own_process
    assert not Settings.from_env({}).bulk_in_own_process  # the embedded SQLite catalog
    with pytest.raises(ValueError, match="CKPT_BULK_PROCESS needs a PostgreSQL catalog"):
        Settings.from_env({"CKPT_BULK_PROCESS": "1"})


@pytest.mark.slow  # three health checks, 5 s apart, each given 5 s
def test_a_hung_bulk_process_is_killed_and_replaced(server: ServerProcess) -> None:
    child = bulk_process(server)
    assert child
    os.kill(child, signal.SIGSTOP)  # alive, and answering nothing
    try:
        hung = lambda: metric(server, "ckpt_bulk_process_exits_total") == 1  # noqa: E731
        wait_for(hung, "the hung bulk process killed", STARTUP_HANG_GUARD)
    finally:
        with suppress(ProcessLookupError):
            os.kill(child, signal.SIGCONT)
    wait_for(partial(gone, child), f"bulk process {child} to exit")
    wait_for(partial(replaced, server, child), "the bulk process started again")
    assert "did not answer /healthz 3 times in a row" in server.log.read_text()
