"""``ckpt server`` keeps an idle connection open longer than its clients keep one to reuse,
so the close is always the client's: uvicorn's 5 s was httpx's (the agent's) too, and a
request sent on a connection the server was closing at that moment got no HTTP answer
(``bench/fleet.py``: 1 heartbeat of 290, a ``RemoteProtocolError``). One process and
several, against real servers."""

from __future__ import annotations

import http.client
import select
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.server_process import ckpt_server
from tests.service.conftest import create_pg_database

CLIENT_KEEPS_SECONDS = 5.0  # httpx's keepalive_expiry, which the agent's client keeps
MARGIN_SECONDS = 1.0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_idle_connection_outlives_the_clients_reuse_of_it(
    workers: str, pg_databases: list[str], tmp_path: Path
) -> None:
    url = create_pg_database()
    pg_databases.append(url)
    with ckpt_server(tmp_path, database_url=url, env={"CKPT_WORKERS": workers}) as server:
        address = urlsplit(server.url)
        assert address.hostname and address.port
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        try:
            assert _health(connection) == 200
            assert connection.sock is not None
            # Readable: the server closed its end (EOF), or said something unasked.
            readable, _, _ = select.select(
                [connection.sock], [], [], CLIENT_KEEPS_SECONDS + MARGIN_SECONDS
            )
            assert not readable, "the server closed an idle connection a client may reuse"
            assert _health(connection) == 200  # on the same connection
        finally:
            connection.close()


def _health(connection: http.client.HTTPConnection) -> int:
    connection.request("GET", "/healthz")
    response = connection.getresponse()
    response.read()
    return response.status
