"""The fingerprints' SQL: what each rank of an attempt computed at each step, kept in a
ring of its newest positions, and read back by the attempt that replays those steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, exists, select, tuple_
from sqlalchemy.orm import Session

from service.models import Attempt, Fingerprint
from service.sql import insert

position = tuple_(Fingerprint.step, Fingerprint.micro_step)


def keep(
    session: Session, *, attempt_id: int, rank: int, rows: Sequence[dict[str, Any]], ring: int
) -> None:
    """Keep the rank's fingerprints (``step``, ``micro_step``, ``loss``, ``parts``) in its
    ring of the ``ring`` newest positions: one upsert (a position sent again replaces the
    earlier; sent twice in ``rows``, the last), one DELETE, however many."""
    last = {(row["step"], row["micro_step"]): row for row in rows}
    _put(session, attempt_id=attempt_id, rank=rank, rows=list(last.values()))
    _prune(session, attempt_id=attempt_id, rank=rank, keep=ring)


def _put(session: Session, *, attempt_id: int, rank: int, rows: list[dict[str, Any]]) -> None:
    # Parameters apart from the statement (executemany, sent as one multi-row INSERT): its
    # SQL is compiled once and cached; rows in .values() compiled it anew on each heartbeat.
    statement = insert(session, Fingerprint)
    statement = statement.on_conflict_do_update(
        index_elements=["attempt_id", "rank", "step", "micro_step"],
        set_={"loss": statement.excluded.loss, "parts": statement.excluded.parts},
    )
    session.execute(
        statement,
        [{"attempt_id": attempt_id, "rank": rank, **row} for row in rows],
        execution_options={"synchronize_session": False},
    )


def _prune(session: Session, *, attempt_id: int, rank: int, keep: int) -> None:
    """Delete all but the rank's ``keep`` newest positions (the subquery walks the primary
    key's ``keep`` newest entries to find where the ring starts)."""
    mine = (Fingerprint.attempt_id == attempt_id, Fingerprint.rank == rank)
    oldest_kept = (
        select(Fingerprint.step, Fingerprint.micro_step)
        .where(*mine)
        .order_by(Fingerprint.step.desc(), Fingerprint.micro_step.desc())
        .offset(keep - 1)
        .limit(1)
        .scalar_subquery()
    )
    session.execute(
        delete(Fingerprint).where(*mine, position < oldest_kept),
        execution_options={"synchronize_session": False},
    )


def replay_source(
    session: Session, *, run_id: int, before_epoch: int, rank: int, after: tuple[int, int]
) -> int | None:
    """The newest attempt of the run older than ``before_epoch`` with a fingerprint of
    ``rank`` after the position ``after``; None: none."""
    later = exists().where(
        Fingerprint.attempt_id == Attempt.id, Fingerprint.rank == rank, position > tuple_(*after)
    )
    return session.scalar(
        select(Attempt.id)
        .where(Attempt.run_id == run_id, Attempt.epoch < before_epoch, later)
        .order_by(Attempt.epoch.desc())
        .limit(1)
    )


def after(
    session: Session, *, attempt_id: int, rank: int, start: tuple[int, int]
) -> list[Fingerprint]:
    """The attempt's fingerprints of ``rank`` after the position ``start``, oldest first."""
    return list(
        session.scalars(
            select(Fingerprint)
            .where(
                Fingerprint.attempt_id == attempt_id,
                Fingerprint.rank == rank,
                position > tuple_(*start),
            )
            .order_by(Fingerprint.step, Fingerprint.micro_step)
        )
    )
