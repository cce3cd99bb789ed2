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


def test_a_connection_that_idled_is_pinged_and_replaced(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch, run_name: str
) -> None:
    monkeypatch.setattr(db, "PING_AFTER_IDLE_SECONDS", 0.0)  # every checkout has idled
    server = make_server("postgres")
    with server.client() as client:
        register(client, run_name)
        _close_connections(server)
        answer = client.get(f"/v1/runs/{run_name}")
        assert answer.status_code == 200, answer.text


def test_a_connection_used_a_moment_ago_fails_once_as_retry_then_is_replaced(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch, run_name: str
) -> None:
    monkeypatch.setattr(db, "PING_AFTER_IDLE_SECONDS", 3600.0)  # none has idled: no ping
    server = make_server("postgres")
    with server.client() as client:
        register(client, run_name)
        _close_connections(server)
        failed = client.get(f"/v1/runs/{run_name}")
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"] == "retry"
        assert failed.headers["Retry-After"] == "1"
        answer = client.get(f"/v1/runs/{run_name}")
        assert answer.status_code == 200, answer.text
