"""``/metrics`` of a server with several worker processes adds up every worker's counts,
whichever worker answers the scrape (issue 32: each answered its own, so counters jumped
between scrapes and a monitor saw half the truth). Against a real ``ckpt server
--workers 2`` on PostgreSQL: each request's worker is known by the process that holds
its connection's server end (Linux: read in ``/proc``)."""

from __future__ import annotations

import http.client
import os
import re
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.server_process import ServerProcess, ckpt_server
from tests.service.conftest import create_pg_database

ROUTE = "/v1/runs/{run}"
COUNTED = re.compile(
    r'^ckpt_http_requests_total\{method="GET",route="/v1/runs/\{run\}",status="404"\} (\S+)$',
    re.MULTILINE,
)
MOST_CONNECTIONS = 200  # the kernel spreads them; this only ends a test that would loop


@pytest.fixture
def server(pg_databases: list[str], tmp_path: Path) -> Iterator[ServerProcess]:
    url = create_pg_database()
    pg_databases.append(url)
    with ckpt_server(tmp_path, database_url=url, env={"CKPT_WORKERS": "2"}) as running:
        yield running


class Connection:
    """One kept-alive HTTP connection, and the worker process that serves it."""

    def __init__(self, server: ServerProcess) -> None:
        address = urlsplit(server.url)
        assert address.hostname and address.port
        self.http = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        self.server = server

    def get(self, path: str) -> tuple[int, str, int]:
        """(status, body, the pid of the worker that answered)."""
        self.http.request("GET", path, headers={"Authorization": f"Bearer {self.server.token}"})
        response = self.http.getresponse()
        body = response.read().decode()
        return response.status, body, self._worker()

    def _worker(self) -> int:
        assert self.http.sock is not None
        held = _socket_inode(self.http.sock.getsockname()[1], self.http.sock.getpeername()[1])
        children = Path(f"/proc/{self.server.pid}/task/{self.server.pid}/children")
        for worker in map(int, children.read_text().split()):
            if f"socket:[{held}]" in _links(worker):
                return worker
        raise AssertionError(f"no worker of {self.server.pid} holds socket {held}")


def _socket_inode(client_port: int, server_port: int) -> str:
    """The inode of the server's end of a loopback connection (``/proc/net/tcp``)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = (int(end.rsplit(":", 1)[1], 16) for end in fields[1:3])
        if (local, remote) == (server_port, client_port):
            return fields[9]
    raise AssertionError(f"no connection from port {client_port}")


def _links(pid: int) -> set[str]:
    """What the process's open descriptors point at; one it closes meanwhile is left out."""
    directory = f"/proc/{pid}/fd"
    links = set()
    for name in os.listdir(directory):
        with suppress(FileNotFoundError):
            links.add(os.readlink(os.path.join(directory, name)))
    return links


def counted(connection: Connection) -> tuple[float, int]:
    status, text, worker = connection.get("/metrics")
    assert status == 200, text
    found = COUNTED.search(text)
    return (float(found.group(1)) if found else 0.0), worker


def test_metrics_add_up_every_workers_counts(server: ServerProcess) -> None:
    with ExitStack() as stack:
        connections: list[Connection] = []
        served: dict[int, int] = {}  # worker pid: requests of ROUTE it answered
        while len(served) < 2:  # until both workers have answered some
            assert len(connections) < MOST_CONNECTIONS, f"one worker took them all: {served}"
            connection = Connection(server)
            stack.callback(connection.http.close)
            connections.append(connection)
            for _ in range(len(connections) % 3 + 1):
                status, _, worker = connection.get("/v1/runs/nowhere")
                assert status == 404
                served[worker] = served.get(worker, 0) + 1
        scrapes: list[tuple[float, int]] = []
        for _ in range(3):
            for connection in connections:  # scraped through both workers
                scrapes.append(counted(connection))
                assert scrapes[-1][0] == sum(served.values()), (scrapes, served)
                status, _, worker = connection.get("/v1/runs/nowhere")
                served[worker] += 1
    assert len({worker for _, worker in scrapes}) == 2, scrapes
    counts = [count for count, _ in scrapes]
    assert counts == sorted(counts)  # never backwards
