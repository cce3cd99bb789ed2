"""The database seam: engines, the one place transactions commit, and migrations."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, exc, make_url, text
from sqlalchemy.orm import Session, sessionmaker

from service.yielding import step_aside

Transaction = Callable[[], AbstractContextManager[Session]]


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets foreign keys, WAL and write-locking transactions."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        # More connections than FastAPI's 40 worker threads: a request never waits on the pool.
        # Plans made for each execution: a plan cached for a statement reused on one
        # connection (psycopg prepares it on its fifth run) was made for the tables as they
        # were then: one made while the blob table was nearly empty scans it whole for a set
        # of 1,000 hashes (0.7 s instead of 2 ms). Planning these small queries costs less.
        # A random page costs what a sequential one does (the default, 4, is a spinning
        # disk's): the catalog's hot rows are in memory or on SSD. At 4, a commit's lock
        # and update of 1,000 blob rows scanned the whole blob table until it held
        # 100,000-150,000 rows (13 ms each at 60,000 and growing, 5 ms through the index).
        engine = create_engine(
            parsed,
            pool_size=20,
            max_overflow=30,
            hide_parameters=True,
            connect_args={
                "options": "-c plan_cache_mode=force_custom_plan -c random_page_cost=1.1"
            },
        )
        _ping_when_idle(engine)
        _aside_between_reads(engine)
        return engine
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        parsed,
        connect_args={"check_same_thread": False, "timeout": 60},
        hide_parameters=True,  # errors may be logged: never with client text in them
    )

    @event.listens_for(engine, "connect")
    def _on_connect(connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, decide when a transaction begins.
        connection.isolation_level = None
        cursor = connection.cursor()
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA busy_timeout = 60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # SQLite has no row locks: taking the write lock up front serializes writers the way
        # Postgres's row locks do, and avoids deadlocks from read-to-write lock upgrades.
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


# A connection back in the pool for less than this is handed out again without a ping: it
# answered a moment ago. SQLAlchemy's pre-ping pinged at every checkout, a round trip to
# PostgreSQL that a heartbeat paid twice (its token, then its work), 2 of its 10; HikariCP
# skips the check on the same grounds (``aliveBypassWindowMs``, 500 ms).
PING_AFTER_IDLE_SECONDS = 0.5


def _ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection at checkout only when it has been idle a while; one that
    fails the ping is replaced, and every connection pooled before it too (a restarted
    database). One that died within the moment fails its statement, which invalidates the
    pool and answers 503 ``retry`` (``service.app``)."""

    @event.listens_for(engine, "checkin")
    def _returned(_connection: Any, record: Any) -> None:
        record.info["returned_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(connection: Any, record: Any, _proxy: Any) -> None:
        returned = record.info.get("returned_at")  # None: a new connection
        if returned is None or time.monotonic() - returned < PING_AFTER_IDLE_SECONDS:
            return
        dialect = engine.dialect
        try:
            dialect.do_ping(connection)
        except dialect.loaded_dbapi.Error as err:
            if dialect.is_disconnect(err, connection, None):
                raise exc.InvalidatePoolError() from err
            raise


def _aside_between_reads(engine: Engine) -> None:
    """Before each statement of a bulk request's ``reads`` (autocommit: no transaction, no
    lock held between statements), step aside while a priority request is in flight
    (``service.yielding``)."""

    @event.listens_for(engine, "before_cursor_execute")
    def _aside(connection: Any, *_: Any) -> None:
        if connection.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            step_aside()


def transactions(engine: Engine) -> Transaction:
    """A factory of units of work: each commits on success and rolls back on any exception."""
    factory = sessionmaker(engine, expire_on_commit=False)

    @contextmanager
    def transaction() -> Iterator[Session]:
        with factory() as session, session.begin():
            yield session

    return transaction


def reads(engine: Engine) -> Transaction:
    """A factory of read-only units of work. On PostgreSQL they send no ``BEGIN`` and no
    ``COMMIT``, two of the few round trips of a small request: each statement sees what
    was committed when it started, as it would in a transaction at READ COMMITTED (the
    catalog's isolation), so a read that needs no lock reads the same; and a write of one
    statement there is a transaction of its own (a heartbeat's, ``runs.repository.
    beat_at_once``). On SQLite, plain transactions (its ``BEGIN IMMEDIATE`` takes the
    write lock the others take)."""
    if engine.dialect.name == "sqlite":
        return transactions(engine)
    factory = sessionmaker(
        engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False
    )

    @contextmanager
    def read() -> Iterator[Session]:
        with factory() as session:
            yield session

    return read


def migrations_dir() -> Path:
    """``migrations``: the package next to this one (found by path, not imported)."""
    return Path(__file__).resolve().parents[1] / "migrations"


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["database_url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema to ``revision`` (under a lock on Postgres: replicas may race).

    Alembic's own lines (one a migration, each with its whole docstring) are not logged:
    one line says what changed, none when nothing did."""
    from alembic import command

    with _alembic_quiet() as quiet:
        command.upgrade(alembic_config(url), revision)
    if quiet.applied:
        log.info("catalog schema upgraded to %s (%d migrations)", quiet.target, quiet.applied)


log = logging.getLogger("ckpt.service")
_RUNNING = re.compile(r"Running upgrade \S* ?-> (\S+?),")


@contextmanager
def _alembic_quiet() -> Iterator[_MigrationLines]:
    """Alembic's informational lines dropped meanwhile, and counted."""
    quiet = _MigrationLines()
    migration_log = logging.getLogger("alembic.runtime.migration")
    migration_log.addFilter(quiet)
    try:
        yield quiet
    finally:
        migration_log.removeFilter(quiet)


class _MigrationLines(logging.Filter):
    """Drops Alembic's informational lines, counting the migrations they announce."""

    def __init__(self) -> None:
        super().__init__()
        self.applied = 0
        self.target = ""

    def filter(self, record: logging.LogRecord) -> bool:
        found = _RUNNING.search(record.getMessage())
        if found:
            self.applied += 1
            self.target = found.group(1)
        return record.levelno > logging.INFO


def schema_revision(engine: Engine) -> tuple[str | None, str]:
    """(the database's revision, the migrations' head)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config(str(engine.url))).get_current_head()
    assert head is not None
    with engine.connect() as connection, _alembic_quiet():
        current = MigrationContext.configure(connection).get_current_revision()
    return current, head


def ping(engine: Engine) -> None:
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))
