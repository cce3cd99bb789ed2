"""The derived table ``run_activity`` (each run's state, last activity and attempt figures),
brought up to date by every write to a run's attempts: ``refresh_activity``, the SQL that
derives the row from the run's attempts and bundles. (A new bundle only adds one to its
count, in ``bundles.repository``.)"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, bindparam, case, func, select, update
from sqlalchemy.orm import Session, aliased

from service.models import (
    NEW,
    TRAINING,
    Attempt,
    AttemptRank,
    Bundle,
    EndReason,
    Run,
    RunActivity,
)
from service.sql import insert, insert_for, take_changes


def refresh_activity(session: Session, *, run_ids: Iterable[int]) -> None:
    """Bring the runs' ``run_activity`` rows up to date with their attempts (creating them if
    absent), summing the figures of all each run's attempts again and counting its bundles:
    every write to attempts but a heartbeat calls it (a registration, an end, an attempt
    marked lost: once per attempt or so), in its own transaction."""
    for run_id in sorted(set(run_ids)):
        newest = session.execute(_newest_attempt(run_id)).first()
        if newest is None:
            created = session.scalar(select(Run.created_at).where(Run.id == run_id))
            bundles = _count_bundles(session, run_id)
            _upsert_activity(
                session, run_id, state=NEW, active_at=created, bundles=bundles, **NO_FIGURES
            )
            continue
        state, active_at, own = _newest_figures(*newest)
        attempts, preemptions, lost, earlier = session.execute(
            _settled_figures(), {"run_id": run_id}
        ).one()
        figures = {
            "bundles": _count_bundles(session, run_id),
            "attempts": attempts,
            "preemptions": int(preemptions or 0),
            "steps_lost": int(lost or 0),
            "earlier_steps_computed": int(earlier or 0),
            "steps_computed": int(earlier or 0) + own,
        }
        _upsert_activity(session, run_id, state=state, active_at=active_at, **figures)


def beat_activity(session: Session, attempt: Attempt, *, start: int, rank: int) -> None:
    """Write a heartbeat of ``rank`` of the run's newest ``attempt`` (resumed from step
    ``start``), which the caller holds locked and has changed (read in no session:
    ``beats.get_attempt_to_beat``): the attempt's changes, the rank's row
    (``attempt_rank``), and the run's activity, of which only that attempt's own part
    changes. On PostgreSQL one statement writes the three (data-modifying ``WITH``
    clauses): a heartbeat's writes, one round trip."""
    state, active_at, own = _newest_figures(
        attempt.ended_at,
        attempt.end_reason,
        attempt.heartbeat_at,
        attempt.started_at,
        attempt.last_step,
        start,
    )
    values: dict[str, Any] = {"run": attempt.run_id, "new_state": state, "at": active_at}
    values |= {"own": own, "beating_attempt": attempt.id, "beating_rank": rank}
    values["beat_at"] = attempt.heartbeat_at
    changes = take_changes(attempt)
    values |= {f"new_{name}": value for name, value in changes.items()}
    values["changed_attempt"] = attempt.id
    connection = session.connection()
    dialect = connection.dialect.name
    if dialect == "postgresql":
        connection.execute(_beat_all(frozenset(changes)), values)
        return
    connection.execute(_beat_rank(dialect), values)
    connection.execute(_beat(), values)
    if changes:
        connection.execute(_beat_attempt(frozenset(changes)), values)


def beat_writes(beating: Any, changed: frozenset[str], *, step: bool) -> list[Any]:
    """``beat_activity``'s three writes as data-modifying ``WITH`` clauses on PostgreSQL, for
    the attempt the CTE ``beating`` holds locked (its columns, and ``start``), if it holds
    one: the attempt's ``changed`` columns (parameters ``new_<column>``), the rank's row
    (``beating_rank``, ``beat_at``) and the run's activity of an attempt still training,
    which the new step (``step``: parameter ``new_last_step``) or its last sets."""
    attempt = (
        update(Attempt)
        .where(Attempt.id == beating.c.id)
        .values({name: bindparam(f"new_{name}") for name in sorted(changed)})
    )
    rank = insert_for("postgresql", AttemptRank).from_select(
        ["attempt_id", "rank", "heartbeat_at"],
        select(beating.c.id, bindparam("beating_rank"), bindparam("beat_at")),
    )
    rank = rank.on_conflict_do_update(
        index_elements=["attempt_id", "rank"], set_={"heartbeat_at": rank.excluded.heartbeat_at}
    )
    last = bindparam("new_last_step") if step else beating.c.last_step
    own = func.coalesce(last, beating.c.start) - beating.c.start
    activity = (
        update(RunActivity)
        .where(RunActivity.run_id == beating.c.run_id)
        .values(
            state=TRAINING,
            active_at=bindparam("beat_at"),
            steps_computed=RunActivity.earlier_steps_computed + _positive(own),
            writes=RunActivity.writes + 1,
        )
    )
    return [attempt.cte("attempt_beat"), rank.cte("rank_beat"), activity.cte("activity_beat")]


@functools.cache
def _beat() -> Any:
    """``beat_activity``'s UPDATE, built once (building it costs more than running it)."""
    return (
        update(RunActivity)
        .where(RunActivity.run_id == bindparam("run"))
        .values(
            state=bindparam("new_state"),
            active_at=bindparam("at"),
            steps_computed=RunActivity.earlier_steps_computed + bindparam("own"),
            writes=RunActivity.writes + 1,
        )
    )


@functools.cache
def _beat_all(changed: frozenset[str]) -> Any:
    """``_beat`` on PostgreSQL with the rank's upsert and the attempt's ``changed`` columns;
    built once for each set of columns (a heartbeat changes one of a few)."""
    statement = _beat().add_cte(_beat_rank("postgresql").cte("rank_beat"))
    if not changed:
        return statement
    return statement.add_cte(_beat_attempt(changed).cte("attempt_beat"))


@functools.cache
def _beat_attempt(changed: frozenset[str]) -> Any:
    """Write the attempt's ``changed`` columns (parameters ``new_<column>``,
    ``changed_attempt``)."""
    return (
        update(Attempt)
        .where(Attempt.id == bindparam("changed_attempt"))
        .values({name: bindparam(f"new_{name}") for name in sorted(changed)})
    )


@functools.cache
def _beat_rank(dialect: str) -> Any:
    """Record a heartbeat of one rank of an attempt (parameters ``beating_attempt``,
    ``beating_rank``, ``beat_at``; a column's own name is reserved)."""
    statement = insert_for(dialect, AttemptRank).values(
        attempt_id=bindparam("beating_attempt"),
        rank=bindparam("beating_rank"),
        heartbeat_at=bindparam("beat_at"),
    )
    return statement.on_conflict_do_update(
        index_elements=["attempt_id", "rank"],
        set_={"heartbeat_at": statement.excluded.heartbeat_at},
    )


def _newest_figures(  # noqa: PLR0917 (the columns of _newest_attempt, in order)
    ended_at: datetime | None,
    reason: str | None,
    heartbeat_at: datetime | None,
    started_at: datetime,
    last_step: int | None,
    start: int,
) -> tuple[str, datetime, int]:
    """The run's state, last activity and its newest attempt's steps, from that attempt."""
    state = TRAINING if ended_at is None else reason
    assert state is not None
    active_at = ended_at or heartbeat_at or started_at
    return state, active_at, max(0, (last_step if last_step is not None else start) - start)


NO_FIGURES = {
    "attempts": 0,
    "preemptions": 0,
    "steps_lost": 0,
    "steps_computed": 0,
    "earlier_steps_computed": 0,
}


def _count_bundles(session: Session, run_id: int) -> int:
    return session.scalar(select(func.count()).where(Bundle.run_id == run_id)) or 0


def _upsert_activity(session: Session, run_id: int, **values: Any) -> None:
    statement = insert(session, RunActivity).values(run_id=run_id, writes=1, **values)
    changed = {name: statement.excluded[name] for name in values}
    session.execute(
        statement.on_conflict_do_update(
            index_elements=["run_id"], set_={**changed, "writes": RunActivity.writes + 1}
        )
    )


def _newest_attempt(run_id: int) -> Select[*tuple[Any, ...]]:
    """The run's newest attempt: its end, activity, last step and the step it started at."""
    return (
        select(
            Attempt.ended_at,
            Attempt.end_reason,
            Attempt.heartbeat_at,
            Attempt.started_at,
            Attempt.last_step,
            func.coalesce(Bundle.step, 0),
        )
        .outerjoin(Bundle, Bundle.id == Attempt.resumed_from_id)
        .where(Attempt.run_id == run_id)
        .order_by(Attempt.epoch.desc())
        .limit(1)
    )


@functools.cache
def _settled_figures() -> Select[*tuple[Any, ...]]:
    """A run's attempts, preemptions, steps lost (``lineage.steps_lost``: each attempt next
    to its successor) and the steps every attempt but the newest computed."""
    resumed = aliased(Bundle, name="resumed")
    per_attempt = (
        select(
            Attempt.end_reason,
            Attempt.last_step,
            func.coalesce(resumed.step, 0).label("start"),
            func.lead(func.coalesce(resumed.step, 0))
            .over(partition_by=Attempt.run_id, order_by=Attempt.epoch)
            .label("next_start"),
            func.lead(Attempt.epoch)
            .over(partition_by=Attempt.run_id, order_by=Attempt.epoch)
            .label("next_epoch"),
        )
        .outerjoin(resumed, resumed.id == Attempt.resumed_from_id)
        .where(Attempt.run_id == bindparam("run_id"))
        .subquery("per_attempt")
    )
    a = per_attempt.c
    ended_short = and_(
        a.end_reason.is_not(None),
        a.end_reason != EndReason.FINISHED,
        a.last_step.is_not(None),
        a.next_epoch.is_not(None),
    )
    lost = case((ended_short, _positive(a.last_step - a.next_start)), else_=0)
    computed = _positive(func.coalesce(a.last_step, a.start) - a.start)
    earlier = case((a.next_epoch.is_not(None), computed), else_=0)
    preempted = case((a.end_reason == EndReason.PREEMPTED, 1), else_=0)
    return select(func.count(), func.sum(preempted), func.sum(lost), func.sum(earlier))


def _positive(value: ColumnElement[Any]) -> ColumnElement[Any]:
    return case((value > 0, value), else_=0)
