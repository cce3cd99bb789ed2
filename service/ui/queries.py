"""The dashboard's SQL: aggregates computed by the database, a page of runs at a time.

The runs page asks two things. First, which runs are on the page, with their state, last
activity and attempt figures (attempts, preemptions, steps lost and computed): all kept in
``run_activity`` by every write to attempts, read off its index in page order. Then the rest
of those runs' figures only (at most a page of them), each in one grouped query: the
resumable bundle (a recursive walk from the head, as ``lineage.resumable`` does), the head's
step and the save figures' bytes."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Select,
    bindparam,
    false,
    func,
    select,
)
from sqlalchemy.orm import Session

from service.models import (
    TRAINING,
    Bundle,
    BundleStatus,
    Run,
    RunActivity,
    Save,
)
from service.runs.repository import RUN_IDS, bounded_steps_lost, resumable_walk

# A SELECT of any columns.
Statement = Select[*tuple[Any, ...]]
PAGE_SIZE = 50
STATES = (TRAINING, "preempted", "lost", "finished", "failed")  # the filter's choices


@dataclass(frozen=True)
class RunListing:
    """A run as the page order sees it."""

    id: int
    name: str
    state: str
    active_at: datetime
    attempts: int
    preemptions: int
    steps_lost: int
    steps_computed: int  # the steps all attempts trained, repeats included
    bundles: int


@dataclass(frozen=True)
class RunFigures:
    """What the runs page and the run summary show of a run, beyond its state."""

    attempts: int = 0
    preemptions: int = 0
    steps_lost: int = 0
    steps_lost_exact: bool = True  # False: a lower bound (``bounded_steps_lost``)
    steps_computed: int = 0  # the steps all attempts trained, repeats included
    head_step: int | None = None
    resumable_step: int | None = None
    resumable_at: datetime | None = None  # when the resumable bundle committed
    bytes_stored: int = 0  # what the run's saves uploaded
    payload_bytes: int = 0  # what they would have uploaded without deduplication

    @property
    def steps_kept(self) -> float | None:
        """Steps kept over steps computed; None before any step. Not goodput (time), which
        weighs time (``service.runs.goodput``)."""
        if self.steps_computed <= 0:
            return None
        return max(0, self.steps_computed - self.steps_lost) / self.steps_computed

    @property
    def dedup_saving(self) -> int:
        return max(0, self.payload_bytes - self.bytes_stored)


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
    """The runs page's statement for these filters, built once (its values are bound): a
    range of the index on ``run_activity (active_at, run_id)`` (or ``(state, active_at,
    run_id)``), read backwards, each row joined to its run."""
    query = (
        select(
            Run.id,
            Run.name,
            RunActivity.state,
            RunActivity.active_at,
            RunActivity.attempts,
            RunActivity.preemptions,
            RunActivity.steps_lost,
            RunActivity.steps_computed,
            RunActivity.bundles,
        )
        .join(RunActivity, RunActivity.run_id == Run.id)
        .order_by(RunActivity.active_at.desc(), RunActivity.run_id.desc())
        .offset(bindparam("offset"))
        .limit(bindparam("limit"))
    )
    if prefix:
        query = query.where(Run.name.like(bindparam("pattern"), escape="/"))
    if only:
        query = query.where(Run.name == bindparam("only"))
    return query.where(RunActivity.state == bindparam("state")) if state else query


def run_listing(session: Session, *, run: Run) -> RunListing:
    """One run's state and last activity, as the runs page shows them."""
    rows, _ = list_runs(session, prefix=None, state=None, only=run.name, page=1, per_page=1)
    return rows[0]


def figures(
    session: Session, *, listings: Collection[RunListing], with_bytes: bool = True
) -> dict[int, RunFigures]:
    """The figures of these runs, by run id: their attempts' (kept in ``run_activity``, read
    with the listing) and the rest, each part one grouped query over them. ``with_bytes=False``
    leaves the bytes out (0), for a page that does not show them."""
    found: dict[int, dict[str, Any]] = {
        listing.id: {
            "attempts": listing.attempts,
            "preemptions": listing.preemptions,
            "steps_lost": listing.steps_lost,
            "steps_computed": listing.steps_computed,
        }
        for listing in listings
    }
    if not found:
        return {}
    parts = [_resumable, _heads, _bounded] + ([_bytes] if with_bytes else [])
    dialect = session.get_bind().dialect.name
    for part in parts:
        rows = session.execute(part(dialect), {"run_ids": list(found)})
        for run_id, *values in rows:
            found[run_id].update(_named(part, values))
    return {run_id: RunFigures(**values) for run_id, values in found.items()}


# Each part of the figures: a statement built once per database (run ids bound, expanding),
# and the names of the values its rows hold after the run id.
NAMES = {
    "_resumable": ("resumable_step", "resumable_at"),
    "_heads": ("head_step",),
    "_bounded": ("steps_lost_exact",),
    "_bytes": ("bytes_stored", "payload_bytes"),
}


# Sums: None over no rows, and a Decimal on PostgreSQL (a sum of BIGINT is NUMERIC).
SUMS = {"bytes_stored", "payload_bytes"}


def _named(part: Callable[[str], Statement], values: list[Any]) -> dict[str, Any]:
    """A part's row as figures, by name."""
    named = dict(zip(NAMES[part.__name__], values, strict=True))
    return {name: int(value or 0) if name in SUMS else value for name, value in named.items()}


@functools.cache
def _bounded(dialect: str) -> Statement:
    """The runs whose steps lost are a lower bound (an attempt marked lost), with False."""
    found = bounded_steps_lost().subquery()
    return select(found.c.run_id, false())


@functools.cache
def _resumable(dialect: str) -> Statement:
    """The newest complete bundle on each run's live branch (``lineage.resumable``'s rule):
    its step and when it committed."""
    walk = resumable_walk()
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
    from the index ``ix_save_run_figures`` (run_id first) alone: a range of it per
    run, no join through ``bundle`` (each save names its bundle's run)."""
    return (
        select(Save.run_id, func.sum(Save.new_bytes), func.sum(Save.payload_bytes))
        .where(Save.run_id.in_(RUN_IDS))
        .group_by(Save.run_id)
    )
