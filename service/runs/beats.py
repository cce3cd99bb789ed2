"""A heartbeat's reads and writes of the catalog, the fleet's steady load: the attempt
locked as every change of it is (``repository.attempt_to_change``), read into instances in
no session; and a plain heartbeat in one statement."""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import Select, bindparam, func, or_, select
from sqlalchemy.orm import Session

from service.auth.repository import TokenRow
from service.models import Attempt, Bundle, Role, Run, Token
from service.runs.activity import beat_writes
from service.runs.repository import attempt_to_change
from service.sql import detached

_RUN_OF_BEAT = (Run.name, Run.epoch)  # and its id, the attempt's run_id
_BEAT_COLUMNS = (*(c.label(f"run_{c.key}") for c in _RUN_OF_BEAT), *Attempt.__table__.columns)


def get_attempt_to_beat(session: Session, *, attempt_id: int) -> tuple[Run, Attempt, int] | None:
    """``get_attempt_to_change`` for a heartbeat, the fleet's steady load: the same locks,
    read as columns into a run (its id, name and epoch) and an attempt in no session, so no
    identity map and no flush: the caller writes what it changes (``activity.beat_activity``).
    That cut the CPU of a heartbeat's work by a third (docs/performance.md)."""
    statement = attempt_to_change(_BEAT_COLUMNS)
    row = session.connection().execute(statement, {"attempt_id": attempt_id}).first()
    if row is None:
        return None
    return _beat_row(row._asdict())


def beat_at_once(
    session: Session,
    *,
    attempt_id: int,
    writer: str | None,
    token_hash: str | None = None,
    changes: dict[str, Any],
    rank: int,
    advance_limit: int,
) -> tuple[Run, Attempt, TokenRow | None] | None:
    """A heartbeat of an attempt training unfenced, in one statement: its checks in SQL, its
    locks those of ``get_attempt_to_change``, its writes ``activity.beat_writes``. ``writer``:
    the run a run token may write (None: an admin's); or ``token_hash``, a bearer token not
    yet authenticated, which the statement checks as ``auth.repository.find_token`` does
    and finds a run token of the attempt's run; ``changes``: the attempt's new column values
    (``heartbeat_at``, and ``last_step`` at most ``advance_limit`` ahead of what it
    reached). Run in autocommit, it is a heartbeat's one round trip (four in a transaction,
    five with the token read first). Returns the run and the attempt as they were before it,
    and the token as ``find_token`` reads it (with ``token_hash``); None, having written
    nothing, if a check failed (or no such attempt): the caller's full path says which."""
    token = token_hash is not None
    statement = _beat_at_once(
        frozenset(changes), writer=writer is not None, token=token, step="last_step" in changes
    )
    values = {f"new_{name}": value for name, value in changes.items()}
    values |= {"attempt_id": attempt_id, "writer": writer, "token_hash": token_hash}
    values |= {"beating_rank": rank, "beat_at": changes["heartbeat_at"], "limit": advance_limit}
    row = session.connection().execute(statement, values).first()
    if row is None:
        return None
    found = row._asdict()
    token_row = _token_row(found) if token else None
    run, attempt, _ = _beat_row(found)
    return run, attempt, token_row


_TOKEN_COLUMNS = (Token.id, Token.name, Token.role, Token.run_name, Token.expires_at)


@functools.cache
def _beat_at_once(changed: frozenset[str], *, writer: bool, token: bool, step: bool) -> Select[Any]:
    """``beat_at_once``'s statement, built once for each kind of heartbeat."""
    start = func.coalesce(Bundle.step, 0)
    checks = [Attempt.epoch == Run.epoch, Attempt.ended_at.is_(None)]
    columns = _BEAT_COLUMNS
    if token:  # find_token's checks, and those of a run token that may write the run
        columns += tuple(c.label(f"token_{c.key}") for c in _TOKEN_COLUMNS)
        checks += [
            Token.token_hash == bindparam("token_hash"),
            Token.revoked_at.is_(None),
            or_(Token.expires_at.is_(None), Token.expires_at > bindparam("beat_at")),
            Token.role == Role.RUN.value,
            Token.run_name == Run.name,
        ]
    elif writer:
        checks.append(Run.name == bindparam("writer"))
    if step:
        known = func.greatest(func.coalesce(Attempt.last_step, 0), start)
        checks.append(bindparam("new_last_step") <= known + bindparam("limit"))
    beating = attempt_to_change(columns).where(*checks).cte("beating")
    return select(beating).add_cte(*beat_writes(beating, changed, step=step))


def _token_row(values: dict[str, Any]) -> TokenRow:
    """The token's columns of a row of ``beat_at_once``, removed from it, as ``find_token``
    reads them."""
    token = {c.key: values.pop(f"token_{c.key}") for c in _TOKEN_COLUMNS}
    return TokenRow(**token)


def _beat_row(values: dict[str, Any]) -> tuple[Run, Attempt, int]:
    """A row of ``_BEAT_COLUMNS`` and ``start`` as a run and an attempt in no session."""
    start = values.pop("start")
    run_values = {c.key: values.pop(f"run_{c.key}") for c in _RUN_OF_BEAT}
    run = detached(Run, {"id": values["run_id"], **run_values})
    return run, detached(Attempt, values), start
