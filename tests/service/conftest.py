"""Fixtures for the control plane: real databases (a throwaway PostgreSQL database on
127.0.0.1:5432 and SQLite files), a directory store, and the app served by uvicorn on a
loopback port, spoken to over real HTTP."""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import uvicorn

from ckpt.core.storage import DirectoryStore
from service.app import create_app
from service.context import Context
from service.db import upgrade
from service.settings import Settings
from tests.databases import create_database, drop_database

PG_ADMIN = os.environ.get("CKPT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
ADMIN_TOKEN = "test-admin-token-0123456789"


def create_pg_database() -> str:
    """A new, empty database on the test PostgreSQL server; returns its SQLAlchemy URL.

    Without a reachable server the test is skipped, unless CKPT_REQUIRE_POSTGRES is set
    (CI sets it: there, a missing PostgreSQL fails the run).
    """
    try:
        return create_database(PG_ADMIN, prefix="ckpt_test", connect_timeout=5)
    except psycopg.OperationalError as err:
        if os.environ.get("CKPT_REQUIRE_POSTGRES"):
            raise
        pytest.skip(f"no PostgreSQL at {PG_ADMIN} (set CKPT_TEST_PG): {err}")


def drop_pg_database(url: str) -> None:
    drop_database(PG_ADMIN, url)


@pytest.fixture(scope="session")
def pg_databases() -> Iterator[list[str]]:
    """Every PostgreSQL database the session created; all dropped at the end."""
    created: list[str] = []
    yield created
    for url in created:
        drop_pg_database(url)


class Catalogs:
    """Migrated catalogs for the tests' control planes, made once and reused.

    A PostgreSQL database a test is done with is emptied (its connections closed, every
    table truncated, its ids restarted) and handed to the next test, rather than dropped
    and made again: each ``DROP DATABASE`` waits for a checkpoint (0.1-0.8 s while the other
    worker writes) and each new database for the migrations (0.25-1 s); one that a test
    left at another schema version is dropped. A SQLite catalog is a copy of one migrated
    file."""

    def __init__(self, root: Path, created: list[str]) -> None:
        self.root = root
        self.created = created  # dropped at the session's end
        self.idle: list[str] = []
        self.schema: str | None = None  # the migrated schema's fingerprint
        self.sqlite_template: Path | None = None

    def postgres(self) -> str:
        if self.idle:
            return self.idle.pop()
        url = create_pg_database()
        self.created.append(url)
        upgrade(url)
        if self.schema is None:
            self.schema = _schema(url)
        return url

    def give_back(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
        if _schema(url) != self.schema:
            return  # a test changed the schema: not reused (dropped at the end)
        with psycopg.connect(_psycopg_url(url), autocommit=True) as db:
            tables = db.execute(
                "SELECT quote_ident(tablename) FROM pg_tables"
                " WHERE schemaname = 'public' AND tablename <> 'alembic_version'"
            ).fetchall()
            db.execute(f"TRUNCATE {', '.join(t for (t,) in tables)} RESTART IDENTITY CASCADE")
        self.idle.append(url)

    def sqlite(self, path: Path) -> str:
        if self.sqlite_template is None:
            self.sqlite_template = self.root / "template.db"
            upgrade(f"sqlite:///{self.sqlite_template}")
        with (
            contextlib.closing(sqlite3.connect(self.sqlite_template)) as source,
            contextlib.closing(sqlite3.connect(path)) as target,
        ):
            source.backup(target)
        return f"sqlite:///{path}"


def _psycopg_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _schema(url: str) -> str:
    """A fingerprint of the database's schema: its version, columns, indexes and
    constraints."""
    with psycopg.connect(_psycopg_url(url)) as db:
        row = db.execute(
            """SELECT md5(concat_ws('|',
                (SELECT string_agg(version_num, ',') FROM alembic_version),
                (SELECT string_agg(concat_ws(' ', table_name, column_name, data_type,
                        is_nullable, column_default), ',' ORDER BY table_name, column_name)
                   FROM information_schema.columns WHERE table_schema = 'public'),
                (SELECT string_agg(indexdef, ',' ORDER BY indexname)
                   FROM pg_indexes WHERE schemaname = 'public'),
                (SELECT string_agg(pg_get_constraintdef(c.oid), ',' ORDER BY c.conname)
                   FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
                  WHERE n.nspname = 'public')))"""
        ).fetchone()
    assert row is not None
    return str(row[0])


@pytest.fixture(scope="session")
def catalogs(tmp_path_factory: pytest.TempPathFactory, pg_databases: list[str]) -> Catalogs:
    return Catalogs(tmp_path_factory.mktemp("catalogs"), pg_databases)


@dataclass
class Server:
    """A running control plane: its URL, admin token, catalog context and store."""

    url: str
    context: Context
    store: DirectoryStore
    admin_token: str = ADMIN_TOKEN

    def client(self, token: str | None = ADMIN_TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    @property
    def backend(self) -> str:
        return self.context.engine.dialect.name


class _Uvicorn(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # it runs in a thread
        pass


def serve(app: Any) -> tuple[str, Callable[[], None]]:
    """Serve ``app`` on a free loopback port in a thread; returns (url, stop)."""
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so; without it
    # every response waits ~40 ms for a delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = _Uvicorn(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the test server did not start")
        threading.Event().wait(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)
        sock.close()

    return f"http://127.0.0.1:{port}", stop


MakeServer = Callable[..., Server]


class _Servers:
    """Control planes started for one scope, stopped (and their catalogs given back) at its
    end."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, catalogs: Catalogs) -> None:
        self._tmp, self._catalogs = tmp_path_factory, catalogs
        self._stops: list[Callable[[], None]] = []
        self._contexts: list[Context] = []
        self._used: list[str] = []

    def make(self, backend: str, **overrides: Any) -> Server:
        root = self._tmp.mktemp("plane")
        if backend == "postgres":
            url = self._catalogs.postgres()
            self._used.append(url)
        else:
            url = self._catalogs.sqlite(root / "catalog.db")
        values: dict[str, Any] = {
            "database_url": url,
            "store": str(root / "store"),
            "admin_token": ADMIN_TOKEN,
            "admin_token_file": str(root / "admin-token"),
            "gc_interval_seconds": 0,
            "auto_migrate": False,
        }
        values.update(overrides)
        settings = Settings(**values)
        context = Context.create(settings)
        self._contexts.append(context)
        url_, stop = serve(create_app(settings, context=context))
        self._stops.append(stop)
        store = context.store
        assert isinstance(store, DirectoryStore)
        return Server(url=url_, context=context, store=store)

    def close(self) -> None:
        for stop in self._stops:
            stop()
        for context in self._contexts:
            context.close()
        for url in self._used:
            self._catalogs.give_back(url)


@pytest.fixture
def make_server(
    tmp_path_factory: pytest.TempPathFactory, catalogs: Catalogs
) -> Iterator[MakeServer]:
    """Start a fresh control plane: ``make_server("postgres" | "sqlite", **settings)``."""
    servers = _Servers(tmp_path_factory, catalogs)
    yield servers.make
    servers.close()


@pytest.fixture(scope="module")
def make_module_server(
    tmp_path_factory: pytest.TempPathFactory, catalogs: Catalogs
) -> Iterator[MakeServer]:
    """``make_server`` for a module's tests to share: stopped when the module is done."""
    servers = _Servers(tmp_path_factory, catalogs)
    yield servers.make
    servers.close()


@pytest.fixture(params=["postgres", "sqlite"])
def server(request: pytest.FixtureRequest, make_server: MakeServer) -> Server:
    """A fresh control plane on each database."""
    backend: str = request.param
    return make_server(backend)


@pytest.fixture
def run_name() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


def store_root(server: Server) -> Path:
    return server.store.root
