"""A process keeps the catalog tokens it authenticated for ``CKPT_TOKEN_CACHE_SECONDS``: a
job's heartbeats and ``/resumable`` do not read their token each time. A revocation through
the process is at once, one elsewhere (the CLI, another replica) once the entry lapses, and
an expiry at its time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from service.auth import cache
from service.auth.cache import TokenCache
from service.auth.principal import Principal
from service.models import Role
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import register
from tests.service.test_auth import create_token
from tests.service.test_operations import ckpt, server_env


@contextmanager
def token_reads(server: Server) -> Iterator[list[str]]:
    """The statements that read the token table while the block runs."""
    seen: list[str] = []

    def listen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "FROM token " in statement or statement.rstrip().endswith("FROM token"):
            seen.append(statement)

    event.listen(server.context.engine, "before_cursor_execute", listen)
    try:
        yield seen
    finally:
        event.remove(server.context.engine, "before_cursor_execute", listen)


def served_until(server: Server, token: str, path: str, *, status: int, within: float) -> float:
    """Ask ``path`` with ``token`` until it is answered ``status``; the seconds that took."""
    began = time.monotonic()
    with server.client(token) as client:
        while (answer := client.get(path)).status_code != status:
            assert time.monotonic() - began < within, (answer.status_code, answer.text)
            time.sleep(0.05)
    return time.monotonic() - began


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_a_token_seen_lately_is_not_read_again(make_server: MakeServer, backend: str) -> None:
    kept, off = make_server(backend), make_server(backend, token_cache_seconds=0)
    reads = {}
    for name, server in (("kept", kept), ("off", off)):
        with server.client() as admin:
            token = create_token(admin, role="read")["token"]
        with token_reads(server) as seen, server.client(token) as client:
            for _ in range(5):
                assert client.get("/v1/runs").status_code == 200
        reads[name] = len(seen)
    assert reads == {"kept": 1, "off": 5}


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_a_token_revoked_elsewhere_is_refused_once_its_entry_lapses(
    make_server: MakeServer, backend: str, run_name: str, tmp_path: Path
) -> None:
    server = make_server(backend, token_cache_seconds=1)
    with server.client() as admin:
        register(admin, run_name)
        created = create_token(admin, role="run", run=run_name)
    path = f"/v1/runs/{run_name}"
    served_until(server, created["token"], path, status=200, within=10)
    revoked = ckpt("token", "revoke", str(created["id"]), env=server_env(server), cwd=tmp_path)
    assert revoked.returncode == 0, revoked.stderr  # in the catalog: this process never heard
    assert served_until(server, created["token"], path, status=401, within=10) < 10


def test_a_kept_token_expires_at_its_time(make_server: MakeServer) -> None:
    server = make_server("postgres", token_cache_seconds=3600)
    with server.client() as admin:
        created = create_token(admin, role="read", expires_in_seconds=1)
    served_until(server, created["token"], "/v1/runs", status=200, within=10)
    served_until(server, created["token"], "/v1/runs", status=401, within=30)
    assert datetime.now(UTC) >= datetime.fromisoformat(created["expires_at"])


def principal(token_id: int) -> Principal:
    return Principal(name=f"t{token_id}", role=Role.READ, token_id=token_id)


def test_the_cache_forgets_lapsed_revoked_and_overflowing_entries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr("service.auth.cache.time.monotonic", lambda: now[0])
    tokens = TokenCache(seconds=2)
    tokens.put("a", principal(1), expires_at=None, read_at=100.0)
    tokens.put("b", principal(2), expires_at=None, read_at=100.0)
    assert tokens.get("a") == principal(1) and tokens.get("c") is None
    now[0] = 101.0
    tokens.forget(1)
    assert tokens.get("a") is None and tokens.get("b") == principal(2)
    # A read that began before the revocation committed, done after it: not kept, however
    # late it comes (a heartbeat's statement may wait for its locks longer than an entry
    # lives).
    tokens.put("a", principal(1), expires_at=None, read_at=100.5)
    assert tokens.get("a") is None
    now[0] = 110.0
    tokens.put("a", principal(1), expires_at=None, read_at=100.9)
    assert tokens.get("a") is None
    assert tokens.get("b") is None  # lapsed: 2 s from its read
    tokens.put("a", principal(1), expires_at=None, read_at=109.0)  # read since: kept
    assert tokens.get("a") == principal(1)
    now[0] = 111.0  # an entry lives 2 s from its read, not from when it was kept
    assert tokens.get("a") is None
    monkeypatch.setattr(cache, "MAX_ENTRIES", 3)
    tokens = TokenCache(seconds=2)
    for token_id in range(4):
        tokens.put(str(token_id), principal(token_id), expires_at=None, read_at=now[0])
    assert [tokens.get(str(i)) is not None for i in range(4)] == [False, False, False, True]
    off = TokenCache(seconds=0)
    off.put("a", principal(1), expires_at=None, read_at=now[0])
    assert off.get("a") is None
