"""What the run page draws: the run's attempts and bundles, or, for a long run, a window of
the newest attempts and their bundles (plus the bundles that window's edges and head need).

A run with up to ``MAX_LANES`` attempts and ``MAX_BUNDLES`` bundles is drawn whole. A longer
one is drawn from its newest attempts, as many as fit in ``WINDOW_LANES`` lanes and
``WINDOW_BUNDLES`` bundles; the rest is summed up in one lane. Only the columns the picture
needs are read (never a manifest), through the indexes on ``attempt (run_id, epoch)`` and
``bundle (attempt_id, step)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sqlalchemy import BigInteger, ColumnElement, Float, cast, func, or_, select
from sqlalchemy.orm import Session

from service import lineage
from service.models import Attempt, Bundle, Run, Save
from service.runs.service import attempt_node
from service.ui import formats
from service.ui.drawing import Hidden, Lane, Mark, Picture
from service.ui.saves import SavePoint

MAX_LANES = 60  # a run up to this size is drawn whole
MAX_BUNDLES = 600
WINDOW_LANES = 30  # a screen of lanes
WINDOW_BUNDLES = 300  # as many marks as the axis has room for
CHART_POINTS = 300  # bundles in the save-figures chart


@dataclass(frozen=True)
class BundleRow(lineage.Node):
    """A bundle as the picture needs it: a node of the lineage, and whether it is pinned."""

    pinned: bool


@dataclass(frozen=True)
class RunWindow:
    """The drawn part of a run: its attempts (oldest first) and the picture of them."""

    attempts: list[Attempt]
    steps_lost: dict[int, int | None]  # by attempt id
    picture: Picture
    saves: list[SavePoint]


BUNDLE_COLUMNS = (  # in BundleRow's order
    Bundle.id,
    Bundle.step,
    Bundle.status,
    Bundle.parent_id,
    Bundle.attempt_id,
    Bundle.pinned,
)


def run_window(session: Session, run: Run, *, attempts: int, bundles: int) -> RunWindow:
    """The run's attempts and bundles to draw, with what is left out summed up (``attempts``
    and ``bundles``: how many the run has)."""
    whole = attempts <= MAX_LANES and bundles <= MAX_BUNDLES
    newest = _newest_attempts(session, run.id, limit=MAX_LANES if whole else WINDOW_LANES)
    drawn = newest if whole else _fitting(newest, max_bundles=WINDOW_BUNDLES)
    where = _drawn(run, [a for a, _ in drawn], whole=whole)
    rows = {
        row.id: BundleRow(*row)
        for row in session.connection()
        .execute(select(*BUNDLE_COLUMNS).where(where).order_by(Bundle.step))
        .all()
    }
    hidden = None
    if not whole:
        shown = sum(count for _, count in drawn)
        hidden = Hidden(lanes=attempts - len(drawn), bundles=max(0, bundles - shown))
    window = _assemble(run, [a for a, _ in drawn], rows, hidden)
    # The newest bundles only: more points than pixels tell nothing.
    charted = [row for row in rows.values()][-CHART_POINTS:]
    return replace(window, saves=save_points(session, run, charted))


def _newest_attempts(session: Session, run_id: int, *, limit: int) -> list[tuple[Attempt, int]]:
    """The run's newest ``limit`` attempts, oldest first, each with how many bundles it made
    (an index probe of ``bundle (attempt_id, step)`` each)."""
    bundles = select(func.count()).where(Bundle.attempt_id == Attempt.id).scalar_subquery()
    newest = session.execute(
        select(Attempt, bundles)
        .where(Attempt.run_id == run_id)
        .order_by(Attempt.epoch.desc())
        .limit(limit)
    )
    return [(attempt, count) for attempt, count in reversed(newest.all())]


def _fitting(
    attempts: Sequence[tuple[Attempt, int]], *, max_bundles: int
) -> list[tuple[Attempt, int]]:
    """The newest of ``attempts`` whose bundles number at most ``max_bundles`` (one at least)."""
    kept: list[tuple[Attempt, int]] = []
    total = 0
    for attempt, count in reversed(attempts):
        total += count
        if kept and total > max_bundles:
            break
        kept.append((attempt, count))
    return list(reversed(kept))


def _drawn(run: Run, attempts: Sequence[Attempt], *, whole: bool) -> ColumnElement[bool]:
    """Which bundles to draw: the run's (whole), or the attempts', with the head and the
    bundles the attempts resumed from."""
    if whole:
        return Bundle.run_id == run.id
    wanted = {a.resumed_from_id for a in attempts} | {run.head_bundle_id}
    extra = [bundle_id for bundle_id in wanted if bundle_id is not None]
    return or_(Bundle.attempt_id.in_([a.id for a in attempts]), Bundle.id.in_(extra))


def _assemble(
    run: Run,
    attempts: list[Attempt],
    rows: dict[int, BundleRow],
    hidden: Hidden | None,
) -> RunWindow:
    live = set(lineage.ancestry(run.head_bundle_id, rows))
    step_of = {bundle_id: row.step for bundle_id, row in rows.items()}.get
    lost = lineage.steps_lost_by_attempt(attempt_node(a, step_of) for a in attempts)
    older = hidden.lanes if hidden else 0  # a window holds the newest attempts
    lanes = [
        Lane(
            attempt_id=a.id,
            epoch=a.epoch,
            start_step=(step_of(a.resumed_from_id) or 0) if a.resumed_from_id else 0,
            last_step=a.last_step,
            ended=lineage.attempt_state(a.end_reason, fenced=a.epoch != run.epoch),
            resumed_from_id=a.resumed_from_id,
            steps_lost=lost[a.id],
            number=older + i + 1,
            pod=a.pod,
            node=a.node,
            verdict=a.verification["verdict"] if a.verification else None,
            verdict_detail=formats.verdict(a.verification) if a.verification else "",
        )
        for i, a in enumerate(attempts)
    ]
    marks = [
        Mark(
            id=row.id,
            step=row.step,
            status=row.status,
            attempt_id=row.attempt_id,
            pinned=row.pinned,
            live=row.id in live,
        )
        for row in rows.values()
    ]
    picture = Picture(
        run=run.name, lanes=lanes, marks=marks, head_id=run.head_bundle_id, hidden=hidden
    )
    return RunWindow(attempts=attempts, steps_lost=lost, picture=picture, saves=[])


def save_points(session: Session, run: Run, bundles: Sequence[BundleRow]) -> list[SavePoint]:
    """The save figures of ``bundles`` (the run's), each over its ranks: the slowest rank's
    stall, save tax (of the ranks that knew theirs; None when none did) and persist, the
    payload over the slowest persist, and the new bytes of all ranks.

    Read from the index ``ix_save_run_figures`` alone: the range of the run's bundle ids from
    the oldest of ``bundles`` (the newest bundles of a run have its highest ids), the few
    others in it left out here.
    """
    step_of = {row.id: row.step for row in bundles}
    if not step_of:
        return []
    found = session.connection().execute(
        select(
            Save.bundle_id,
            func.max(Save.stall_seconds),
            func.max(Save.tax_seconds),  # NULLs left out; NULL when every rank's is
            func.max(Save.persist_seconds),
            cast(func.sum(Save.payload_bytes), Float),  # not PostgreSQL's NUMERIC
            cast(func.sum(Save.new_bytes), BigInteger),
        )
        .where(Save.run_id == run.id, Save.bundle_id >= min(step_of))
        .group_by(Save.bundle_id)
    )
    points = [
        SavePoint(
            step=step_of[bundle_id],
            stall_seconds=stall,
            tax_seconds=tax,
            persist_seconds=persist,
            throughput=payload / persist if persist else 0.0,
            new_bytes=new,
        )
        for bundle_id, stall, tax, persist, payload, new in found.all()
        if bundle_id in step_of
    ]
    return sorted(points, key=lambda point: point.step)
