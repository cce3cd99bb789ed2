"""Throwaway PostgreSQL databases, for the tests and the benchmarks: made on a server by its
admin URL (``postgresql://user@host:port/db``), named by the SQLAlchemy URL ckpt reads."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg


def create_database(admin_url: str, *, prefix: str, connect_timeout: int = 10) -> str:
    """A new, empty database on the server of ``admin_url``; its SQLAlchemy URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=connect_timeout) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    server = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    return f"{server}/{name}"


def drop_database(admin_url: str, url: str) -> None:
    """Drop the database ``url`` names (connections to it are closed first)."""
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def throwaway_database(admin_url: str, *, prefix: str = "ckpt_bench") -> Iterator[str]:
    """A new database for the block's length; yields its SQLAlchemy URL."""
    url = create_database(admin_url, prefix=prefix)
    try:
        yield url
    finally:
        drop_database(admin_url, url)
