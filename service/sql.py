"""The SQL idioms both databases spell differently: upserts, row locks and sets of values."""

from __future__ import annotations

import enum
import string
from collections.abc import Collection
from typing import Any, TypeVar, cast

import psycopg
from psycopg.adapt import Dumper
from sqlalchemy import BigInteger, ColumnElement, Select, any_, inspect, literal
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, InstrumentedAttribute, Session, configure_mappers
from sqlalchemy.orm.attributes import instance_dict, set_committed_value
from sqlalchemy.types import UserDefinedType


class Lock(enum.Enum):
    NONE = "none"
    SHARE = "share"  # others may read and share-lock, not change
    UPDATE = "update"  # exclusive until the transaction ends
    # Exclusive too, but lets others insert rows that reference this one (Postgres's FOR NO
    # KEY UPDATE): what changing a row's non-key columns needs.
    NO_KEY_UPDATE = "no_key_update"


S = TypeVar("S", bound=Select[Any])
T = TypeVar("T")
M = TypeVar("M", bound=DeclarativeBase)


def locked_of(*locks: tuple[Lock, type[DeclarativeBase]]) -> str:
    """The row-lock clauses of a statement that locks rows of several tables, one
    ``(lock, model)`` each, in that order (PostgreSQL takes them so: the run first, as every
    write locks); for ``suffix_with(..., dialect="postgresql")``."""
    return " ".join(
        f"{_FOR[lock]} OF {model.__tablename__}" for lock, model in locks if lock is not Lock.NONE
    )


_FOR = {Lock.SHARE: "FOR SHARE", Lock.UPDATE: "FOR UPDATE", Lock.NO_KEY_UPDATE: "FOR NO KEY UPDATE"}


def locked(statement: S, lock: Lock) -> S:
    """``statement`` with a row lock (SQLite ignores it: its transactions lock the file)."""
    if lock is Lock.NONE:
        return statement
    return statement.with_for_update(read=lock is Lock.SHARE, key_share=lock is Lock.NO_KEY_UPDATE)


def insert(session: Session, table: type[DeclarativeBase]) -> Any:
    """An INSERT that knows ``on_conflict_do_nothing`` / ``_do_update`` on this database."""
    return insert_for(session.get_bind().dialect.name, table)


def insert_for(dialect: str, table: type[DeclarativeBase]) -> Any:
    """``insert`` for the database named ``dialect`` (a statement built once, for a session
    that comes later)."""
    return postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)


def one_of(
    session: Session,
    column: ColumnElement[str] | InstrumentedAttribute[str],
    words: Collection[str],
) -> ColumnElement[bool]:
    """``column IN words``, for words of ASCII letters and digits (such as SHA-256 hexes):
    on PostgreSQL ``= ANY(array)``, one bound parameter however many (an IN list binds each:
    1,000 blobs cost more to send than to look up), written as one array literal (psycopg's
    own list dumper quotes element by element: 2.7 ms more per 1,000)."""
    if session.get_bind().dialect.name == "postgresql":
        return column == any_(literal(_Words(words), _WordArray()))
    return column.in_(list(words))


def ids_in(
    session: Session,
    column: ColumnElement[int] | InstrumentedAttribute[int],
    ids: Collection[int],
) -> ColumnElement[bool]:
    """``column IN ids``: on PostgreSQL ``= ANY(array)``, one bound parameter however many
    (1,000 ids in an IN list cost more to bind, and for psycopg to parse, than to update)."""
    if session.get_bind().dialect.name == "postgresql":
        return column == any_(literal(sorted(ids), postgresql.ARRAY(BigInteger)))
    return column.in_(sorted(ids))


def plain_words(words: Collection[str]) -> _Words:
    """``words`` (ASCII letters and digits) as a ``varchar[]`` parameter of a textual
    statement, sent as one array literal (see ``one_of``)."""
    return _Words(words)


class _Words:
    """Words of ASCII letters and digits as an array literal, which they need neither
    quoted nor escaped in (checked with bytes methods: a regular expression, or
    ``str.isalnum``, took longer than the quoting it saves)."""

    __slots__ = ("literal",)
    _PLAIN = (string.ascii_letters + string.digits + ",").encode()

    def __init__(self, words: Collection[str]) -> None:
        listed = list(words)
        joined = ",".join(listed)
        encoded = joined.encode() if joined.isascii() else b"?"
        if listed and (
            "" in listed
            or encoded.translate(None, self._PLAIN)
            or encoded.count(b",") != len(listed) - 1  # a word with a comma in it
            or b",null," in b"," + encoded.lower() + b","  # the literal's word for a NULL
        ):
            raise ValueError(f"not a set of plain words: {sorted(listed)[:3]}")
        self.literal = b"{" + encoded + b"}"


class _WordArray(UserDefinedType[_Words]):
    """A ``varchar[]`` parameter whose value is a ``_Words``, sent as it is."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "VARCHAR[]"

    def bind_processor(self, dialect: Dialect) -> None:
        return None


class _WordsDumper(Dumper):
    oid = psycopg.adapters.types["varchar"].array_oid

    def dump(self, obj: _Words) -> bytes:
        return obj.literal


psycopg.adapters.register_dumper(_Words, _WordsDumper)


def detached(cls: type[M], values: dict[str, Any]) -> M:
    """An instance of the mapped ``cls`` holding ``values`` (its columns) as if loaded, in no
    session: no flush writes it, and what changes after is ``take_changes``' to find."""
    mapper = inspect(cls)
    if not mapper.configured:  # no query has run in this process yet
        configure_mappers()
    instance = cast(M, mapper.class_manager.new_instance())
    instance_dict(instance).update(values)  # as the ORM's loading does
    return instance


def take_changes(instance: DeclarativeBase) -> dict[str, Any]:
    """The columns of a loaded ``instance`` changed since it was loaded (or last flushed),
    now marked as written: the caller writes them in a statement of its own, and the
    session's flush no longer does."""
    state = inspect(instance)
    changes: dict[str, Any] = {}
    for key in list(state.committed_state):  # the attributes set since: their values before
        history = state.attrs[key].history
        if history.added and key in state.mapper.column_attrs:
            changes[key] = history.added[0]
    for key, value in changes.items():
        set_committed_value(instance, key, value)
    return changes
