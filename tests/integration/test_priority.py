"""The scheduler's question is protected from a flood of bulk requests (issue 29: under one
token's flood of 10,000-blob queries, long lineages and 500-run pages, ``/resumable`` for
another token went from p99 61 ms to 619 ms). Against a real ``ckpt server`` process on
PostgreSQL: one token fills the process's budget of bulk requests with queries whose
bodies it holds back; then every further bulk request, of any token and any kind, is
refused at once (429, ``Retry-After``), while ``/resumable``, a heartbeat and a whole save
(its commit included) of other tokens are served."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from ckpt.core.storage import DirectoryStore
from tests.server_process import ServerProcess, ckpt_server
from tests.service.conftest import create_pg_database, drop_pg_database
from tests.service.helpers import register, save

BUDGET = 8  # the process's bulk budget, and the token's: one token can fill it
HELD = 2  # queries of 10,000 blobs weigh 4 each: two fill it
RUN = "trained"

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    url = create_pg_database()
    env = {"CKPT_MAX_EXPENSIVE_PER_TOKEN": str(BUDGET), "CKPT_MAX_BULK_IN_FLIGHT": str(BUDGET)}
    try:
        with ckpt_server(tmp_path, database_url=url, env=env) as running:
            yield running
    finally:
        drop_pg_database(url)


def new_token(server: ServerProcess, **body: str) -> str:
    with server.client() as client:
        response = client.post("/v1/tokens", json=body)
        response.raise_for_status()
        token: str = response.json()["token"]
        return token


def query(entries: int) -> bytes:
    blobs = [
        {"sha256": hashlib.sha256(f"held-{i}".encode()).hexdigest(), "size": 1 + i}
        for i in range(entries)
    ]
    return json.dumps({"blobs": blobs}).encode()


@contextmanager
def held_queries(server: ServerProcess, token: str, count: int) -> Iterator[None]:
    """``count`` blob queries of ``token`` admitted and in flight for the block's length:
    their headers and the start of their bodies sent, the rest held back."""
    address = urlsplit(server.url)
    body = query(10_000)
    head = (
        f"POST /v1/blobs/missing HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with ExitStack() as stack:
        for _ in range(count):
            sock = stack.enter_context(socket.create_connection((address.hostname, address.port)))
            sock.sendall(head + body[:1000])
        yield


def bulk_in_flight(server: ServerProcess) -> float | None:
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    found = re.search(r"^ckpt_bulk_in_flight (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def wait_until_full(server: ServerProcess, token: str) -> None:
    """Until ``token``'s expensive requests are full: its lineage is refused (polled: a
    state, not a time; the deadline only ends a test that would otherwise hang)."""
    deadline = time.monotonic() + 120
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        while (status := client.get(f"/v1/runs/{RUN}/lineage").status_code) != 429:
            assert time.monotonic() < deadline, f"the held queries were never admitted: {status}"
            time.sleep(1)  # its Retry-After: the next refusal comes at once


def wait_for_bulk(server: ServerProcess, weight: int) -> None:
    """Until the server counts ``weight`` of bulk requests in flight (polled, as above)."""
    deadline = time.monotonic() + 120
    while (seen := bulk_in_flight(server)) != weight:
        assert time.monotonic() < deadline, f"bulk in flight: {seen}, not {weight}"
        time.sleep(0.05)


def refused_bulk(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    pattern = (
        r'^ckpt_requests_refused_total\{error="too_many_in_flight",route_class="bulk"\} (\S+)$'
    )
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_flood_of_bulk_requests_leaves_resumable_heartbeats_and_commits_served(
    server: ServerProcess,
) -> None:
    store = DirectoryStore(server.store)
    with server.client() as admin:
        attempt = register(admin, RUN)
        save(admin, store, RUN, attempt, step=10)
    flooder = new_token(server, role="admin", name="flooder")
    reader = new_token(server, role="read", name="scheduler")
    trainer = new_token(server, role="run", run=RUN, name="trainer")
    with held_queries(server, flooder, HELD):
        wait_until_full(server, flooder)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            as_flooder = {"Authorization": f"Bearer {flooder}"}
            as_reader = {"Authorization": f"Bearer {reader}"}
            page = client.get("/v1/runs", params={"limit": 500}, headers=as_flooder)
            lineage = client.get(f"/v1/runs/{RUN}/lineage", headers=as_reader)
            resumable = client.get(f"/v1/runs/{RUN}/resumable", headers=as_reader)
        with httpx.Client(
            base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {trainer}"}
        ) as as_trainer:
            beat = as_trainer.post(f"/v1/attempts/{attempt['attempt_id']}/heartbeat", json={})
            saved = save(as_trainer, store, RUN, register(as_trainer, RUN), step=20)
        in_flight = bulk_in_flight(server)
        refused = refused_bulk(server)
    # Bulk requests beyond the budget: refused at once, whoever asks.
    for over in (page, lineage):
        assert over.status_code == 429, over.text
        assert over.headers["retry-after"] == "1"
        assert over.json()["error"] == "too_many_in_flight"
    assert "CKPT_MAX_BULK_IN_FLIGHT" in lineage.json()["message"]
    assert in_flight == BUDGET  # the bulk class full, by the flooder alone
    assert refused >= 3  # the flooder's lineage, its page, the reader's lineage
    # The priority class: served while the bulk class is full.
    assert resumable.status_code == 200, resumable.text
    assert resumable.json()["step"] == 10
    assert beat.status_code == 200, beat.text
    assert saved["step"] == 20
    # The held queries gone, the budget is free again.
    wait_for_bulk(server, 0)
    with server.client() as admin:
        assert admin.get("/v1/runs", params={"limit": 500}).status_code == 200
        assert admin.get(f"/v1/runs/{RUN}/lineage").status_code == 200
