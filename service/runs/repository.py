from __future__ import annotations

import functools
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    CTE,
    BindParameter,
    ColumnElement,
    Select,
    and_,
    bindparam,
    case,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session, aliased

from service.lineage import AttemptNode
from service.models import (
    NEW,
    TRAINING,
    Attempt,
    AttemptRank,
    Bundle,
    BundleStatus,
    EndReason,
    Rollback,
    Run,
    RunActivity,
    utcnow,
)
from service.sql import Lock, insert, locked


def get_run(session: Session, *, name: str, lock: Lock = Lock.NONE) -> Run | None:
    return session.scalar(locked(select(Run).where(Run.name == name), lock))


def get_run_by_id(session: Session, *, run_id: int, lock: Lock = Lock.NONE) -> Run:
    run = session.scalar(locked(select(Run).where(Run.id == run_id), lock))
    assert run is not None, f"run {run_id} vanished"
    return run


def ensure_run(
    session: Session, *, name: str, keep_last: int | None = None, keep_every: int | None = None
) -> tuple[Run, bool]:
    """The run, locked for update, created if absent; and whether it was created."""
    result = session.execute(
        insert(session, Run)
        .values(name=name, created_at=utcnow(), epoch=0, keep_last=keep_last, keep_every=keep_every)
        .on_conflict_do_nothing(index_elements=["name"])
        .returning(Run.id)
    )
    created = result.first() is not None
    run = get_run(session, name=name, lock=Lock.UPDATE)
    assert run is not None
    if created:
        refresh_activity(session, run_ids=[run.id])
    return run, created


def refresh_activity(session: Session, *, run_ids: Iterable[int], settle: bool = True) -> None:
    """Bring the runs' ``run_activity`` rows up to date with their attempts (creating them if
    absent): every write to attempts calls it, in its own transaction.

    ``settle`` sums the figures of all the run's attempts again, and counts its bundles (a
    registration, an end, an attempt marked lost: once per attempt or so); without it (a
    heartbeat of the newest attempt) only the newest attempt's own part changes, in
    constant time.
    """
    for run_id in sorted(set(run_ids)):
        newest = session.execute(_newest_attempt(run_id)).first()
        if newest is None:
            created = session.scalar(select(Run.created_at).where(Run.id == run_id))
            bundles = _count_bundles(session, run_id)
            _upsert_activity(
                session, run_id, state=NEW, active_at=created, bundles=bundles, **NO_FIGURES
            )
            continue
        ended_at, reason, heartbeat_at, started_at, last_step, start = newest
        state = TRAINING if ended_at is None else reason
        active_at = ended_at or heartbeat_at or started_at
        own = max(0, (last_step if last_step is not None else start) - start)
        if settle:
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
        else:
            session.execute(
                update(RunActivity)
                .where(RunActivity.run_id == run_id)
                .values(
                    state=state,
                    active_at=active_at,
                    steps_computed=RunActivity.earlier_steps_computed + own,
                    writes=RunActivity.writes + 1,
                )
            )


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


def page_runs(session: Session, *, after: str | None, limit: int, prefix: str | None) -> list[Run]:
    query = select(Run).order_by(Run.name).limit(limit)
    if after is not None:
        query = query.where(Run.name > after)
    if prefix:
        query = query.where(Run.name.startswith(prefix, autoescape=True))
    return list(session.scalars(query))


RUN_IDS: BindParameter[Any] = bindparam("run_ids", expanding=True)


@functools.cache
def resumable_walk() -> CTE:
    """Each run's live branch (``run_ids``, bound) walked from its head through parents to
    the first complete bundle (``lineage.resumable``'s rule), one recursive query for many
    runs: its rows' ``status`` is complete for the one each run resumes from."""
    start = (
        select(
            Run.id.label("run_id"),
            Bundle.id,
            Bundle.parent_id,
            Bundle.status,
            Bundle.step,
            Bundle.committed_at,
        )
        .join(Bundle, Bundle.id == Run.head_bundle_id)
        .where(Run.id.in_(RUN_IDS))
        .cte("walk", recursive=True)
    )
    parent = aliased(Bundle, name="parent")
    return start.union_all(
        select(
            start.c.run_id,
            parent.id,
            parent.parent_id,
            parent.status,
            parent.step,
            parent.committed_at,
        ).join(
            parent,
            and_(parent.id == start.c.parent_id, start.c.status != BundleStatus.COMPLETE),
        )
    )


def run_figures(session: Session, *, run_ids: Collection[int]) -> dict[int, RunFigures]:
    """What the API shows of these runs beyond their own row, in four queries however many
    runs: the head, the bundle each resumes from, the bundles by status, the steps lost."""
    ids = {"run_ids": sorted(set(run_ids))}
    found = {run_id: RunFigures() for run_id in ids["run_ids"]}
    if not found:
        return found
    heads = session.execute(
        select(Run.id, Bundle.id, Bundle.step, Bundle.status)
        .join(Bundle, Bundle.id == Run.head_bundle_id)
        .where(Run.id.in_(RUN_IDS)),
        ids,
    )
    for run_id, bundle_id, step, status in heads:
        found[run_id].head = BundleRefRow(bundle_id, step, status)
    walk = resumable_walk()
    resumable = session.execute(
        select(walk.c.run_id, walk.c.id, walk.c.step, walk.c.status).where(
            walk.c.status == BundleStatus.COMPLETE
        ),
        ids,
    )
    for run_id, bundle_id, step, status in resumable:
        found[run_id].resumable = BundleRefRow(bundle_id, step, status)
    counts = session.execute(
        select(Bundle.run_id, Bundle.status, func.count())
        .where(Bundle.run_id.in_(RUN_IDS))
        .group_by(Bundle.run_id, Bundle.status),
        ids,
    )
    for run_id, status, count in counts:
        found[run_id].bundles[status] = count
    lost = session.execute(
        select(RunActivity.run_id, RunActivity.steps_lost).where(RunActivity.run_id.in_(RUN_IDS)),
        ids,
    )
    for run_id, steps in lost:
        found[run_id].steps_lost = steps
    return found


class BundleRefRow(NamedTuple):
    id: int
    step: int
    status: str


@dataclass
class RunFigures:
    head: BundleRefRow | None = None
    resumable: BundleRefRow | None = None
    bundles: dict[str, int] = field(default_factory=dict)  # by status
    steps_lost: int = 0


def add_attempt(
    session: Session,
    *,
    run: Run,
    pod: str | None,
    node: str | None,
    pool: str | None = None,
    resumed_from_id: int | None,
) -> Attempt:
    attempt = Attempt(
        run_id=run.id,
        epoch=run.epoch,
        pod=pod,
        node=node,
        pool=pool,
        started_at=utcnow(),
        resumed_from_id=resumed_from_id,
    )
    session.add(attempt)
    session.flush()
    return attempt


def get_attempt(session: Session, *, attempt_id: int, lock: Lock = Lock.NONE) -> Attempt | None:
    return session.scalar(locked(select(Attempt).where(Attempt.id == attempt_id), lock))


def run_attempts(session: Session, *, run_id: int) -> list[Attempt]:
    return list(
        session.scalars(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.epoch))
    )


def next_attempt(session: Session, *, run_id: int, epoch: int) -> Attempt | None:
    """The run's attempt that registered after the one at ``epoch``."""
    return session.scalar(
        select(Attempt)
        .where(Attempt.run_id == run_id, Attempt.epoch > epoch)
        .order_by(Attempt.epoch)
        .limit(1)
    )


def last_attempt(session: Session, *, run_id: int) -> Attempt | None:
    return session.scalar(
        select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.epoch.desc()).limit(1)
    )


def attempt_nodes(session: Session, *, run_id: int) -> list[AttemptNode]:
    """The run's attempts with the step each resumed from: what steps lost are made of."""
    rows = session.execute(
        select(Attempt.id, Attempt.epoch, Attempt.last_step, Attempt.end_reason, Bundle.step)
        .outerjoin(Bundle, Bundle.id == Attempt.resumed_from_id)
        .where(Attempt.run_id == run_id)
    )
    return [
        AttemptNode(id=id_, epoch=epoch, last_step=last_step, end_reason=reason, resumed_step=step)
        for id_, epoch, last_step, reason, step in rows
    ]


def mark_lost(session: Session, *, silent_since: datetime, now: datetime) -> list[Attempt]:
    """End as lost, at ``now``, every attempt not ended whose last heartbeat (or, without one,
    its registration) is older than ``silent_since``; returns them.

    Locks as heartbeats and ends do, runs before attempts: a heartbeat in flight either
    commits first (and Postgres re-checks the row, which is then no longer silent) or waits.
    """
    last_sign = func.coalesce(Attempt.heartbeat_at, Attempt.started_at)
    rank_silent = (
        select(AttemptRank.attempt_id)
        .where(AttemptRank.attempt_id == Attempt.id, AttemptRank.heartbeat_at < silent_since)
        .exists()
    )
    silent = (Attempt.ended_at.is_(None), or_(last_sign < silent_since, rank_silent))
    run_ids = list(
        session.scalars(select(Attempt.run_id).where(*silent).distinct().order_by(Attempt.run_id))
    )
    if not run_ids:
        return []
    session.execute(locked(select(Run.id).where(Run.id.in_(run_ids)).order_by(Run.id), Lock.SHARE))
    lost = list(
        session.scalars(
            locked(
                select(Attempt).where(*silent, Attempt.run_id.in_(run_ids)).order_by(Attempt.id),
                Lock.NO_KEY_UPDATE,
            )
        )
    )
    for attempt in lost:
        attempt.ended_at = now
        attempt.end_reason = EndReason.LOST
    session.flush()
    refresh_activity(session, run_ids=run_ids)
    return lost


def rank_silent(session: Session, *, attempt_id: int, silent_since: datetime) -> bool:
    """Whether a rank of the attempt has not beaten since ``silent_since``."""
    return (
        session.scalar(
            select(AttemptRank.rank)
            .where(AttemptRank.attempt_id == attempt_id, AttemptRank.heartbeat_at < silent_since)
            .limit(1)
        )
        is not None
    )


def beat_rank(session: Session, *, attempt_id: int, rank: int, at: datetime) -> None:
    """Record a heartbeat of one rank of the attempt."""
    statement = insert(session, AttemptRank).values(
        attempt_id=attempt_id, rank=rank, heartbeat_at=at
    )
    session.execute(
        statement.on_conflict_do_update(
            index_elements=["attempt_id", "rank"],
            set_={"heartbeat_at": statement.excluded.heartbeat_at},
        )
    )


def lineage_bundles(
    session: Session,
    *,
    run_id: int,
    columns: Iterable[str],
    before: int | None = None,
    limit: int | None = None,
) -> list[Row[Any]]:
    """The run's bundles, oldest first, with only these columns (never the manifest); with
    ``limit``, only its newest ``limit`` bundles with an id below ``before``."""
    selected = [getattr(Bundle, name) for name in columns]
    query = select(*selected).where(Bundle.run_id == run_id)
    if limit is None:
        return list(session.execute(query.order_by(Bundle.id)))
    if before is not None:
        query = query.where(Bundle.id < before)
    return list(session.execute(query.order_by(Bundle.id.desc()).limit(limit)))[::-1]


def live_branch_from(session: Session, *, head_id: int | None, low: int) -> list[int]:
    """The head and its ancestors down to id ``low``, newest first: one recursive query
    (a parent is always older than its child, so the walk ends)."""
    if head_id is None:
        return []
    walk = (
        select(Bundle.id, Bundle.parent_id).where(Bundle.id == head_id).cte("live", recursive=True)
    )
    parent = aliased(Bundle, name="parent")
    walk = walk.union_all(
        select(parent.id, parent.parent_id)
        .select_from(walk)
        .join(
            parent,
            and_(parent.id == walk.c.parent_id, parent.id < walk.c.id, walk.c.parent_id >= low),
        )
    )
    found = session.scalars(select(walk.c.id).where(walk.c.id >= low).order_by(walk.c.id.desc()))
    return list(found)


def page_attempts(
    session: Session, *, run_id: int, attempt_ids: Collection[int], bundle_ids: Collection[int]
) -> list[Attempt]:
    """The run's attempts that own one of ``bundle_ids`` or resumed from one, by epoch."""
    if not bundle_ids:
        return []
    return list(
        session.scalars(
            select(Attempt)
            .where(
                Attempt.run_id == run_id,
                or_(Attempt.id.in_(sorted(attempt_ids)), Attempt.resumed_from_id.in_(bundle_ids)),
            )
            .order_by(Attempt.epoch)
        )
    )


def forks_among(session: Session, *, run_id: int, parent_ids: Collection[int]) -> list[int]:
    """Those of ``parent_ids`` with two children or more (in any page)."""
    if not parent_ids:
        return []
    query = (
        select(Bundle.parent_id)
        .where(Bundle.run_id == run_id, Bundle.parent_id.in_(parent_ids))
        .group_by(Bundle.parent_id)
        .having(func.count() > 1)
        .order_by(Bundle.parent_id)
    )
    return [parent for parent in session.scalars(query) if parent is not None]


def add_rollback(
    session: Session, *, run: Run, from_bundle_id: int | None, to_bundle_id: int
) -> Rollback:
    rollback = Rollback(
        run_id=run.id,
        from_bundle_id=from_bundle_id,
        to_bundle_id=to_bundle_id,
        epoch=run.epoch,
        created_at=utcnow(),
    )
    session.add(rollback)
    session.flush()
    return rollback


def run_rollbacks(session: Session, *, run_id: int) -> list[Rollback]:
    return list(
        session.scalars(select(Rollback).where(Rollback.run_id == run_id).order_by(Rollback.id))
    )


def group_run_ids(session: Session, *, run: Run) -> list[int]:
    """The run and every run in its dedup group (the run alone without one)."""
    if run.dedup_group is None:
        return [run.id]
    return list(session.scalars(select(Run.id).where(Run.dedup_group == run.dedup_group)))
