"""The runs' SQL: runs, their attempts (and each rank's heartbeats), their lineage and
rollbacks. The table ``run_activity`` is kept by ``activity.py``; what the API shows of runs
beyond their rows is read by ``figures.py``."""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import CTE, BindParameter, Select, Text, and_, bindparam, cast, func, or_, select
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session, aliased, defer

from service.lineage import AttemptNode
from service.models import (
    Attempt,
    AttemptRank,
    Bundle,
    BundleStatus,
    EndReason,
    Rollback,
    Run,
    utcnow,
)
from service.runs.activity import refresh_activity
from service.sql import Lock, insert, locked, locked_of


def get_run(session: Session, *, name: str, lock: Lock = Lock.NONE) -> Run | None:
    return session.scalar(locked(select(Run).where(Run.name == name), lock))


def get_run_and_head(
    session: Session, *, name: str
) -> tuple[Run, Bundle | None, str | None] | None:
    """The run, its head bundle (but its manifest) and the head's manifest as the catalog
    holds its JSON (``manifest_text``), in one statement."""
    found = session.execute(_run_and_head(), {"name": name}).first()
    return (found[0], found[1], found[2]) if found else None


@functools.cache
def _run_and_head() -> Select[Run, Bundle, str]:
    """``/resumable``'s statement, built once: building it costs more than running it."""
    return (
        select(Run, Bundle, _MANIFEST_TEXT)
        .outerjoin(Bundle, Bundle.id == Run.head_bundle_id)
        .where(Run.name == bindparam("name"))
        .options(defer(Bundle.manifest))
    )


# A bundle's manifest as the catalog holds its JSON, not parsed (a 64-rank job's is 8 MB).
_MANIFEST_TEXT = cast(Bundle.manifest, Text)


def manifest_text(session: Session, *, bundle_id: int) -> str | None:
    """The bundle's manifest as the catalog holds its JSON (None: no such bundle)."""
    return session.scalar(select(_MANIFEST_TEXT).where(Bundle.id == bundle_id))


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


@functools.cache
def bounded_steps_lost() -> Select[int]:
    """The runs among ``run_ids`` whose steps lost are a lower bound: an attempt of theirs
    with a successor (an epoch below the run's) was marked lost (``lineage.steps_lost_exact``)."""
    return (
        select(Attempt.run_id)
        .join(Run, Run.id == Attempt.run_id)
        .where(
            Attempt.run_id.in_(RUN_IDS),
            Attempt.end_reason == EndReason.LOST,
            Attempt.epoch < Run.epoch,
        )
        .distinct()
    )


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


# The statements that lock an attempt for a change, built once: building one costs more CPU
# than running it. Two locks in one round trip, taken in the order of the FOR clauses
# (PostgreSQL locks a row's tables in that order): the run first, as every other write locks
# (opening a bundle locks the run, then references the attempt). SQLite has no row locks
# (BEGIN IMMEDIATE).
@functools.cache
def attempt_to_change(columns: tuple[Any, ...]) -> Select[Any]:
    return (
        select(*columns, func.coalesce(Bundle.step, 0).label("start"))
        .select_from(Run)
        .join(Attempt, Attempt.run_id == Run.id)
        .outerjoin(Bundle, Bundle.id == Attempt.resumed_from_id)
        .where(Attempt.id == bindparam("attempt_id"))
        .suffix_with(
            locked_of((Lock.SHARE, Run), (Lock.NO_KEY_UPDATE, Attempt)), dialect="postgresql"
        )
    )


def get_attempt_to_change(session: Session, *, attempt_id: int) -> tuple[Run, Attempt, int] | None:
    """The attempt locked for a change of its non-key columns, its run share-locked, and the
    step it resumed from (0: it started fresh)."""
    found = session.execute(attempt_to_change((Run, Attempt)), {"attempt_id": attempt_id})
    row = found.first()
    return (row[0], row[1], row[2]) if row else None


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


def rank_silent(session: Session, *, attempt_id: int, silent_since: datetime, beating: int) -> bool:
    """Whether a rank of the attempt but ``beating`` (which beats now) has not beaten since
    ``silent_since``."""
    return (
        session.scalar(
            select(AttemptRank.rank)
            .where(
                AttemptRank.attempt_id == attempt_id,
                AttemptRank.rank != beating,
                AttemptRank.heartbeat_at < silent_since,
            )
            .limit(1)
        )
        is not None
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
