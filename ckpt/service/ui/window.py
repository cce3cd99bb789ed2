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

from sqlalchemy import ColumnElement, and_, false, func, or_, select, true
from sqlalchemy.orm import Session

from ckpt.service import lineage
from ckpt.service.models import Attempt, Bundle, Run, Save
from ckpt.service.runs.service import attempt_node
from ckpt.service.ui.drawing import Hidden, Lane, Mark, Picture, SavePoint

MAX_LANES = 300
MAX_BUNDLES = 3000
WINDOW_LANES = 60
WINDOW_BUNDLES = 600
CHART_POINTS = 300  # bundles in the save-figures chart


@dataclass(frozen=True)
class BundleRow:
    id: int
    step: int
    status: str
    attempt_id: int | None
    parent_id: int | None
    pinned: bool

    def node(self) -> lineage.Node:
        return lineage.Node(
            id=self.id,
            step=self.step,
            status=self.status,
            parent_id=self.parent_id,
            attempt_id=self.attempt_id,
        )


@dataclass(frozen=True)
class RunWindow:
    """The drawn part of a run: its attempts (oldest first) and the picture of them."""

    attempts: list[Attempt]
    steps_lost: dict[int, int | None]  # by attempt id
    picture: Picture
    saves: list[SavePoint]


BUNDLE_COLUMNS = (
    Bundle.id,
    Bundle.step,
    Bundle.status,
    Bundle.attempt_id,
    Bundle.parent_id,
    Bundle.pinned,
)


def run_window(session: Session, run: Run) -> RunWindow:
    """The run's attempts and bundles to draw, with what is left out summed up."""
    attempts_count = select(func.count()).where(Attempt.run_id == run.id).scalar_subquery()
    bundles_count = select(func.count()).where(Bundle.run_id == run.id).scalar_subquery()
    total_attempts, total_bundles = session.execute(select(attempts_count, bundles_count)).one()
    whole = total_attempts <= MAX_LANES and total_bundles <= MAX_BUNDLES
    attempts = _newest_attempts(session, run.id, limit=MAX_LANES if whole else WINDOW_LANES)
    if not whole:
        attempts = _fitting(session, attempts, max_bundles=WINDOW_BUNDLES)
    where = _drawn(run, attempts, whole=whole)
    rows = {
        row.id: BundleRow(*row)
        for row in session.execute(select(*BUNDLE_COLUMNS).where(where).order_by(Bundle.step))
    }
    hidden = None
    if not whole:
        lanes = {a.id for a in attempts}
        drawn = sum(1 for row in rows.values() if row.attempt_id in lanes)
        hidden = Hidden(lanes=total_attempts - len(attempts), bundles=total_bundles - drawn)
    window = _assemble(run, attempts, rows, hidden)
    # The newest bundles only: more points than pixels tell nothing.
    steps = [row.step for row in rows.values()][-CHART_POINTS:]
    charted = and_(where, Bundle.step >= steps[0]) if steps else false()
    return replace(window, saves=save_points(session, where=charted))


def _newest_attempts(session: Session, run_id: int, *, limit: int) -> list[Attempt]:
    newest = session.scalars(
        select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.epoch.desc()).limit(limit)
    )
    return list(reversed(list(newest)))


def _fitting(session: Session, attempts: Sequence[Attempt], *, max_bundles: int) -> list[Attempt]:
    """The newest of ``attempts`` whose bundles number at most ``max_bundles`` (one at least)."""
    counts = dict(
        session.execute(
            select(Bundle.attempt_id, func.count())
            .where(Bundle.attempt_id.in_([a.id for a in attempts]))
            .group_by(Bundle.attempt_id)
        ).all()
    )
    kept: list[Attempt] = []
    total = 0
    for attempt in reversed(attempts):
        total += counts.get(attempt.id, 0)
        if kept and total > max_bundles:
            break
        kept.append(attempt)
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
    nodes = {bundle_id: row.node() for bundle_id, row in rows.items()}
    live = set(lineage.ancestry(run.head_bundle_id, nodes))
    step_of = {bundle_id: row.step for bundle_id, row in rows.items()}.get
    lost = lineage.steps_lost_by_attempt(attempt_node(a, step_of) for a in attempts)
    lanes = [
        Lane(
            attempt_id=a.id,
            epoch=a.epoch,
            start_step=(step_of(a.resumed_from_id) or 0) if a.resumed_from_id else 0,
            last_step=a.last_step,
            ended=a.end_reason or "running",
            resumed_from_id=a.resumed_from_id,
            steps_lost=lost[a.id],
        )
        for a in attempts
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


def save_points(session: Session, *, where: ColumnElement[bool]) -> list[SavePoint]:
    """The save figures of the bundles ``where`` selects, each over its ranks: the slowest
    rank's stall and persist, the payload over the slowest persist, and the new bytes of all
    ranks (read from the index ``ix_save_figures`` alone).

    On PostgreSQL each bundle's saves are a LATERAL subquery (one index probe per bundle),
    where a join lets the planner hash the whole save table.
    """
    figures = (
        func.max(Save.stall_seconds).label("stall"),
        func.max(Save.persist_seconds).label("persist"),
        func.sum(Save.payload_bytes).label("payload"),
        func.sum(Save.new_bytes).label("new"),
    )
    if session.get_bind().dialect.name == "postgresql":
        per_bundle = select(*figures).where(Save.bundle_id == Bundle.id).lateral("per_bundle")
        columns = [per_bundle.c[name] for name in ("stall", "persist", "payload", "new")]
        query = select(Bundle.step, *columns).join(per_bundle, true()).where(where)
    else:
        query = (
            select(Bundle.step, *figures)
            .join(Save, Save.bundle_id == Bundle.id)
            .where(where)
            .group_by(Bundle.id, Bundle.step)
        )
    return [
        SavePoint(
            step=step,
            stall_seconds=float(stall),
            persist_seconds=float(persist),
            throughput=float(payload) / persist if persist else 0.0,
            new_bytes=int(new),
        )
        for step, stall, persist, payload, new in session.execute(query.order_by(Bundle.step))
        if stall is not None  # no rank reported
    ]
