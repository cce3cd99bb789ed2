"""The two SQL idioms both databases spell differently: upserts and row locks."""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import Any, TypeVar

from sqlalchemy import ARRAY, ColumnElement, Select, any_, literal
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import DeclarativeBase, InstrumentedAttribute, Session


class Lock(enum.Enum):
    NONE = "none"
    SHARE = "share"  # others may read and share-lock, not change
    UPDATE = "update"  # exclusive until the transaction ends
    # Exclusive too, but lets others insert rows that reference this one (Postgres's FOR NO
    # KEY UPDATE): what changing a row's non-key columns needs.
    NO_KEY_UPDATE = "no_key_update"


S = TypeVar("S", bound=Select[Any])
T = TypeVar("T")


def locked(statement: S, lock: Lock) -> S:
    """``statement`` with a row lock (SQLite ignores it: its transactions lock the file)."""
    if lock is Lock.NONE:
        return statement
    return statement.with_for_update(read=lock is Lock.SHARE, key_share=lock is Lock.NO_KEY_UPDATE)


def insert(session: Session, table: type[DeclarativeBase]) -> Any:
    """An INSERT that knows ``on_conflict_do_nothing`` / ``_do_update`` on this database."""
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def one_of(
    session: Session, column: ColumnElement[T] | InstrumentedAttribute[T], values: Collection[T]
) -> ColumnElement[bool]:
    """``column IN values``: on PostgreSQL ``= ANY(array)``, one bound parameter however many
    values (an IN list binds each: 1,000 blobs cost more to send than to look up)."""
    if session.get_bind().dialect.name == "postgresql":
        return column == any_(literal(list(values), ARRAY(column.type)))
    return column.in_(list(values))
