"""Alembic environment: the URL comes from ``ckpt migrate`` (or CKPT_DATABASE_URL)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from service.db import make_engine
from service.models import Base
from service.settings import Settings

# Postgres: one migrator at a time, whatever starts it (Job, replicas, CLI).
_LOCK_KEY = 0x636B7074  # "ckpt"


def run_migrations() -> None:
    config = context.config
    url = config.attributes.get("database_url") or Settings.from_env().database_url
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            _migrate(connection)
    finally:
        engine.dispose()


def _migrate(connection: object) -> None:
    is_postgres = connection.dialect.name == "postgresql"  # type: ignore[attr-defined]
    is_sqlite = connection.dialect.name == "sqlite"  # type: ignore[attr-defined]
    if is_sqlite:
        _sqlite_foreign_keys(connection, on=False)
    if is_postgres:
        connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _LOCK_KEY})  # type: ignore[attr-defined]
        connection.commit()  # type: ignore[attr-defined]
    try:
        context.configure(
            connection=connection,  # type: ignore[arg-type]
            target_metadata=Base.metadata,
            render_as_batch=True,  # SQLite alters tables by copying them
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    finally:
        if is_postgres:
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _LOCK_KEY})  # type: ignore[attr-defined]
            connection.commit()  # type: ignore[attr-defined]
        if is_sqlite:
            _sqlite_foreign_keys(connection, on=True)


def _sqlite_foreign_keys(connection: object, *, on: bool) -> None:
    """Turn SQLite's foreign keys off for the migrations, and on again. A batch migration
    copies a table and drops the old one: with foreign keys on, the drop deletes every row
    that references it ON DELETE CASCADE (a bundle's layers and saves). The pragma does
    nothing inside a transaction, so it goes to the driver between transactions."""
    connection.commit()  # type: ignore[attr-defined]
    raw = connection.connection.dbapi_connection  # type: ignore[attr-defined]
    raw.execute(f"PRAGMA foreign_keys = {'ON' if on else 'OFF'}")


run_migrations()
