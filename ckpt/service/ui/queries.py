"""The dashboard's SQL: aggregates computed by the database, a page of runs at a time.

The runs page asks two things. First, which runs are on the page: each run's state and last
activity come from its newest attempt (the highest epoch), then the filters, the order and
the page apply. Then the figures of those runs only (at most a page of them), each in one
grouped query: attempts, preemptions, steps lost and computed (a window function pairs each
attempt with its successor, as ``lineage.steps_lost`` does), the resumable bundle (a
recursive walk from the head, as ``lineage.resumable`` does), the head's step and the save
figures' bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Select,
    and_,
    bindparam,
    case,
    func,
    literal,
    select,
)
from sqlalchemy.orm import Session, aliased

from ckpt.service.models import Attempt, Bundle, BundleStatus, EndReason, Run, Save

# A SELECT of any columns.
Statement = Select[*tuple[Any, ...]]
PAGE_SIZE = 50
STATES = ("training", "preempted", "lost", "finished", "failed")
NEW = "new"  # a run no attempt has registered for yet


@dataclass(frozen=True)
class RunListing:
    """A run as the page order sees it."""

    id: int
    name: str
    state: str
    active_at: datetime


@dataclass(frozen=True)
class RunFigures:
    """What the runs page and the run summary show of a run, beyond its state."""

    attempts: int = 0
    preemptions: int = 0
    steps_lost: int = 0
    steps_computed: int = 0  # the steps all attempts trained, repeats included
    head_step: int | None = None
    resumable_step: int | None = None
    resumable_at: datetime | None = None  # when the resumable bundle committed
    bytes_stored: int = 0  # what the run's saves uploaded
    payload_bytes: int = 0  # what they would have uploaded without deduplication

    @property
    def goodput(self) -> float | None:
        """Steps kept over steps computed; None before any step."""
        if self.steps_computed <= 0:
            return None
        return max(0, self.steps_computed - self.steps_lost) / self.steps_computed

    @property
    def dedup_saving(self) -> int:
        return max(0, self.payload_bytes - self.bytes_stored)


def _positive(value: ColumnElement[Any]) -> ColumnElement[Any]:
    return case((value > 0, value), else_=0)


def _newest(column: ColumnElement[Any]) -> ColumnElement[Any]:
    """``column`` of the run's newest attempt (the highest epoch): one probe of the index on
    ``attempt (run_id, epoch)`` per run."""
    return (
        select(column)
        .where(Attempt.run_id == Run.id)
        .order_by(Attempt.epoch.desc())
        .limit(1)
        .scalar_subquery()
    )


def list_runs(
    session: Session,
    *,
    prefix: str | None,
    state: str | None,
    only: str | None,
    page: int,
    per_page: int = PAGE_SIZE,
) -> tuple[list[RunListing], bool]:
    """A page of runs (1-based), most recently active first, and whether more follow.

    ``only`` restricts the list to one run's name (a run token sees only its run).
    """
    query = _runs_query(prefix=bool(prefix), only=only is not None, state=bool(state))
    values = {
        "pattern": _like_prefix(prefix or ""),
        "only": only,
        "state": state,
        "offset": (page - 1) * per_page,
        "limit": per_page + 1,
    }
    rows = [RunListing(*row) for row in session.execute(query, values)]
    return rows[:per_page], len(rows) > per_page


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape ``/``) matching the names that start with ``prefix``."""
    return prefix.replace("/", "//").replace("%", "/%").replace("_", "/_") + "%"


@functools.cache
def _runs_query(*, prefix: bool, only: bool, state: bool) -> Statement:
    """The runs page's statement for these filters, built once (its values are bound).

    The state and activity are subqueries: the database computes the activity of every run
    to sort them, and the state only of the page's runs (unless a state filter needs them
    all).
    """
    running = case((Attempt.ended_at.is_(None), literal("training")), else_=Attempt.end_reason)
    activity = func.coalesce(Attempt.ended_at, Attempt.heartbeat_at, Attempt.started_at)
    runs = select(
        Run.id,
        Run.name,
        func.coalesce(_newest(running), literal(NEW)).label("state"),
        func.coalesce(_newest(activity), Run.created_at).label("active_at"),
    )
    if prefix:
        runs = runs.where(Run.name.like(bindparam("pattern"), escape="/"))
    if only:
        runs = runs.where(Run.name == bindparam("only"))
    listed = runs.subquery("listed")
    query = (
        select(listed)
        .order_by(listed.c.active_at.desc(), listed.c.id.desc())
        .offset(bindparam("offset"))
        .limit(bindparam("limit"))
    )
    return query.where(listed.c.state == bindparam("state")) if state else query


def run_listing(session: Session, *, run: Run) -> RunListing:
    """One run's state and last activity, as the runs page shows them."""
    rows, _ = list_runs(session, prefix=None, state=None, only=run.name, page=1, per_page=1)
    return rows[0]


def figures(
    session: Session, *, run_ids: Collection[int], with_bytes: bool = True
) -> dict[int, RunFigures]:
    """The figures of these runs, by run id (a run without any still gets one).
    ``with_bytes=False`` leaves the bytes out (0), for a page that does not show them."""
    if not run_ids:
        return {}
    found: dict[int, dict[str, Any]] = {run_id: {} for run_id in run_ids}
    parts = [_attempt_figures, _resumable, _heads] + ([_bytes] if with_bytes else [])
    dialect = session.get_bind().dialect.name
    for part in parts:
        rows = session.execute(part(dialect), {"run_ids": list(run_ids)})
        for run_id, *values in rows:
            found[run_id].update(_named(part, values))
    return {run_id: RunFigures(**values) for run_id, values in found.items()}


# Each part of the figures: a statement built once per database (run ids bound, expanding),
# and the names of the values its rows hold after the run id.
RUN_IDS: BindParameter[Any] = bindparam("run_ids", expanding=True)
NAMES = {
    "_attempt_figures": ("attempts", "preemptions", "steps_lost", "steps_computed"),
    "_resumable": ("resumable_step", "resumable_at"),
    "_heads": ("head_step",),
    "_bytes": ("bytes_stored", "payload_bytes"),
}


# Sums: None over no rows, and a Decimal on PostgreSQL (a sum of BIGINT is NUMERIC).
SUMS = {"preemptions", "steps_lost", "steps_computed", "bytes_stored", "payload_bytes"}


def _named(part: Callable[[str], Statement], values: list[Any]) -> dict[str, Any]:
    """A part's row as figures, by name."""
    named = dict(zip(NAMES[part.__name__], values, strict=True))
    return {name: int(value or 0) if name in SUMS else value for name, value in named.items()}


@functools.cache
def _attempt_figures(dialect: str) -> Statement:
    """Attempts, preemptions, steps lost and computed: each attempt next to its successor."""
    resumed = aliased(Bundle, name="resumed")
    per_attempt = (
        select(
            Attempt.run_id,
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
        .where(Attempt.run_id.in_(RUN_IDS))
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
    preempted = case((a.end_reason == EndReason.PREEMPTED, 1), else_=0)
    return select(
        a.run_id, func.count(), func.sum(preempted), func.sum(lost), func.sum(computed)
    ).group_by(a.run_id)


@functools.cache
def _resumable(dialect: str) -> Statement:
    """The newest complete bundle on each run's live branch: walk from the head to its
    ancestors until a complete one (the rule of ``lineage.resumable``)."""
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
    walk = start.union_all(
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
    return select(walk.c.run_id, walk.c.step, walk.c.committed_at).where(
        walk.c.status == BundleStatus.COMPLETE
    )


@functools.cache
def _heads(dialect: str) -> Statement:
    return (
        select(Run.id, Bundle.step)
        .join(Bundle, Bundle.id == Run.head_bundle_id)
        .where(Run.id.in_(RUN_IDS))
    )


@functools.cache
def _bytes(dialect: str) -> Statement:
    """What the runs' saves uploaded, and what they would have without deduplication, read
    from the index on ``save (run_id, payload_bytes, new_bytes)`` alone: a range of it per
    run, no join through ``bundle`` (each save names its bundle's run)."""
    return (
        select(Save.run_id, func.sum(Save.new_bytes), func.sum(Save.payload_bytes))
        .where(Save.run_id.in_(RUN_IDS))
        .group_by(Save.run_id)
    )
