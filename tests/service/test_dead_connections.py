"""Pooled connections the database closed (a restart, a failover, an idle timeout): one that
idled is pinged at checkout and replaced; one used a moment ago is handed out without a
ping (``service.db.PING_AFTER_IDLE_SECONDS``), so its first statement finds it dead, the
request is answered 503 ``retry`` and the pool renewed, and the retry is served."""

from __future__ import annotations

import psycopg
import pytest

from service import db
from tests.service.conftest import PG_ADMIN, MakeServer, Server
from tests.service.helpers import register


def _close_connections(server: Server) -> None:
    """What a database restart does to the server's pooled connections."""
    database = server.context.engine.url.database
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        closed = admin.execute(
            "SELECT count(*) FROM pg_stat_activity, pg_terminate_backend(pid)"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,),
        ).fetchone()
    assert closed is not None and closed[0] >= 1, "the server had no connection to close"


@pytest.mark.parametrize(
    ("idle_seconds", "answers"),
    [
        pytest.param(0.0, [200], id="idled-pinged-and-replaced"),
        pytest.param(3600.0, [503, 200], id="used-a-moment-ago-fails-once-as-retry"),
    ],
)
def test_a_connection_the_database_closed_is_replaced(
    make_server: MakeServer,
    monkeypatch: pytest.MonkeyPatch,
    run_name: str,
    idle_seconds: float,
    answers: list[int],
) -> None:
    """``idle_seconds``: how long a connection must idle to be pinged (0: every checkout; an
    hour: none here). The requests after the connections closed get ``answers``."""
    monkeypatch.setattr(db, "PING_AFTER_IDLE_SECONDS", idle_seconds)
    server = make_server("postgres")
    with server.client() as client:
        register(client, run_name)
        _close_connections(server)
        got = [client.get(f"/v1/runs/{run_name}") for _ in answers]
    assert [answer.status_code for answer in got] == answers, got[0].text
    for failed in got[:-1]:
        assert failed.json()["error"] == "retry"
        assert failed.headers["Retry-After"] == "1"
