"""Tokens that expire, an admin token rotated without downtime (two valid at once), and a
readiness probe that names what failed without printing the driver's error."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from service.app import create_app
from service.models import Token
from service.settings import Settings
from tests.service.conftest import MakeServer, Server, serve
from tests.service.test_operations import ckpt, server_env

OLD_ADMIN = "old-admin-token-0123456789"
NEW_ADMIN = "new-admin-token-0123456789"


def create(client: httpx.Client, **body: Any) -> dict[str, Any]:
    answer = client.post("/v1/tokens", json={"role": "read", **body})
    assert answer.status_code == 201, answer.text
    created: dict[str, Any] = answer.json()
    return created


def expire(server: Server, token_id: int) -> None:
    """Move a token's expiry into the past (rather than wait for it), and out of the server's
    memory of the tokens it saw, which holds the expiry it read (``service.auth.cache``)."""
    past = datetime.now(UTC) - timedelta(seconds=1)
    with server.context.transaction() as session:
        session.execute(update(Token).where(Token.id == token_id).values(expires_at=past))
    server.context.tokens.forget(token_id)


def test_a_token_expires(server: Server) -> None:
    with server.client() as admin:
        before = datetime.now(UTC)
        created = create(admin, name="dashboard", expires_in_seconds=3600)
        forever = create(admin, name="ops")
        with server.client(created["token"]) as client:
            assert client.get("/v1/runs").status_code == 200
            expire(server, created["id"])
            refused = client.get("/v1/runs")
        listed = {token["id"]: token for token in admin.get("/v1/tokens").json()}
    expires_at = datetime.fromisoformat(created["expires_at"])
    assert before + timedelta(seconds=3599) <= expires_at <= datetime.now(UTC) + timedelta(hours=1)
    assert forever["expires_at"] is None
    assert refused.status_code == 401, refused.text
    assert refused.headers["www-authenticate"] == "Bearer"
    message = refused.json()["message"]
    assert "expired at" in message and f"token {created['id']} (dashboard)" in message
    assert listed[created["id"]]["expires_at"] is not None
    assert listed[forever["id"]]["expires_at"] is None


@pytest.mark.parametrize("seconds", [0, -1, 1.5, "3600", "30d", 10 * 366 * 86400 + 1, True])
def test_an_expiry_is_a_whole_number_of_seconds(server: Server, seconds: object) -> None:
    with server.client() as admin:
        answer = admin.post("/v1/tokens", json={"role": "read", "expires_in_seconds": seconds})
        listed = admin.get("/v1/tokens").json()
    assert answer.status_code == 422, answer.text
    assert "expires_in_seconds" in answer.json()["message"]
    assert listed == []


def test_token_cli_creates_and_lists_expiring_tokens(server: Server, tmp_path: Path) -> None:
    env = server_env(server)
    created = ckpt(
        "token", "create", "--role", "read", "--name", "temp", "--expires-in", "30d",
        env=env, cwd=tmp_path,
    )  # fmt: skip
    listed = ckpt("token", "list", env=env, cwd=tmp_path)
    as_json = ckpt("token", "list", "--json", env=env, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    assert "valid until" in created.stderr
    with server.client(created.stdout.strip()) as client:
        assert client.get("/v1/runs").status_code == 200
    (token,) = [t for t in _json(as_json.stdout) if t["name"] == "temp"]
    expires_at = datetime.fromisoformat(token["expires_at"])
    assert timedelta(days=29) < expires_at - datetime.now(UTC) <= timedelta(days=30)
    assert "EXPIRES" in listed.stdout and f"{expires_at:%Y-%m-%d %H:%M}" in listed.stdout


def _json(text: str) -> list[dict[str, Any]]:
    import json

    tokens: list[dict[str, Any]] = json.loads(text)
    return tokens


@pytest.fixture(params=["postgres", "sqlite"])
def rotating(request: pytest.FixtureRequest, make_server: MakeServer) -> Server:
    """A control plane in the middle of rotating its admin token: the old and the new."""
    backend: str = request.param
    return make_server(backend, admin_token=f"{OLD_ADMIN}, {NEW_ADMIN}")


def test_two_admin_tokens_are_valid_during_a_rotation(rotating: Server) -> None:
    for token in (OLD_ADMIN, NEW_ADMIN):
        with rotating.client(token) as client:
            answer = client.post("/v1/tokens", json={"role": "read"})
            assert answer.status_code == 201, answer.text
    for wrong in (f"{OLD_ADMIN},{NEW_ADMIN}", OLD_ADMIN[:-1], "x"):
        with rotating.client(wrong) as client:
            assert client.get("/v1/tokens").status_code == 401


def test_each_admin_token_must_be_long_enough() -> None:
    with pytest.raises(ValueError, match="CKPT_ADMIN_TOKEN must be at least 16 characters"):
        Settings(admin_token=f"{NEW_ADMIN},short")
    assert Settings(admin_token=f"{NEW_ADMIN},{OLD_ADMIN},").admin_token is not None


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_readyz_names_the_failed_check_and_nothing_more(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Unauthenticated, /readyz says "unreachable"; the driver's error (host, port, file)
    goes to the server's log."""
    store = tmp_path / "not-a-directory"
    store.write_text("")
    (tmp_path / "not-a-database").mkdir()
    url = (
        "postgresql+psycopg://ckpt@127.0.0.1:1/nowhere?connect_timeout=2"
        if backend == "postgres"
        else f"sqlite:///{tmp_path}/not-a-database"  # a directory: cannot be opened
    )
    settings = Settings(
        database_url=url, store=str(store), admin_token="x" * 20, auto_migrate=False
    )
    app = create_app(settings)
    address, stop = serve(app)
    try:
        with caplog.at_level(logging.WARNING, logger="ckpt.service"):
            answer = httpx.get(f"{address}/readyz", timeout=30)
    finally:
        stop()
        app.state.context.close()
    assert answer.status_code == 503, answer.text
    assert answer.json()["checks"] == {
        "database": "unreachable",
        "schema": "unknown",
        "store": "unreachable",
    }
    for secret in ("127.0.0.1", ":1", "not-a-d", "Error", "nowhere"):
        assert secret not in answer.text
    logged = " ".join(record.getMessage() for record in caplog.records)
    assert "the database is unreachable" in logged and "Error" in logged
    assert "the store is unreachable" in logged
