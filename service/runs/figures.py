"""What the API shows of runs beyond their own rows (``run_figures``): the head, the bundle
each resumes from, its bundles by status and its steps lost (and whether they are exact),
in a constant number of queries however many runs."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.models import Bundle, BundleStatus, Run, RunActivity
from service.runs.repository import RUN_IDS, bounded_steps_lost, resumable_walk


def run_figures(session: Session, *, run_ids: Collection[int]) -> dict[int, RunFigures]:
    """What the API shows of these runs beyond their own row, in five queries however many
    runs: the head, the bundle each resumes from, the bundles by status, the steps lost and
    whether they are exact."""
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
    for run_id in session.scalars(bounded_steps_lost(), ids):
        found[run_id].steps_lost_exact = False
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
    steps_lost_exact: bool = True  # False: a lower bound (``bounded_steps_lost``)
