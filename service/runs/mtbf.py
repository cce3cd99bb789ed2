"""The mean time between preemptions of a run and of its capacity pool, from attempt
history (``ckpt.core.interval`` has the estimator): what an agent with ``CKPT_EVERY=auto``
sizes its save interval by. Each estimate reads a bounded number of the newest attempts
(an index range), so its cost does not grow with a pool's age."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from ckpt.core.interval import History
from service.auth.principal import Principal
from service.auth.service import require_read
from service.context import Context
from service.errors import NotFoundError
from service.models import Attempt, EndReason, utcnow
from service.runs import repository
from service.runs.schemas import HistoryOut, PreemptionRate

NEWEST = 1000  # attempts read per estimate
PREEMPTED = (EndReason.PREEMPTED, EndReason.LOST)  # a failure is a crash, not the capacity's


def preemption_rate(
    context: Context, principal: Principal, *, name: str, pool: str | None
) -> PreemptionRate:
    """The run's estimate, with its pool's as the prior (the pool of its newest attempt,
    unless ``pool`` names one)."""
    require_read(principal, name)
    prior = context.settings.mtbf_prior_seconds
    now = utcnow()
    with context.transaction() as session:
        run = repository.get_run(session, name=name)
        if run is None:
            raise NotFoundError(f"run {name!r} not found")
        own = _history(_rows(session, Attempt.run_id == run.id), now=now)
        if pool is None:
            pool = session.scalar(
                select(Attempt.pool).where(Attempt.run_id == run.id).order_by(Attempt.id.desc())
            )
        shared = _history(_rows(session, Attempt.pool == pool), now=now) if pool else None
    pool_mtbf = shared.mtbf(prior_seconds=prior) if shared else prior
    mtbf = own.mtbf(prior_seconds=pool_mtbf)
    return PreemptionRate(
        mtbf_seconds=mtbf,
        prior_seconds=prior,
        run=_out(own, mtbf),
        pool=_out(shared, pool_mtbf, name=pool) if shared else None,
    )


def _rows(
    session: Session, where: ColumnElement[bool]
) -> Sequence[tuple[datetime, datetime | None, str | None]]:
    rows = session.execute(
        select(Attempt.started_at, Attempt.ended_at, Attempt.end_reason)
        .where(where)
        .order_by(Attempt.id.desc())
        .limit(NEWEST)
    )
    return [(started, ended, reason) for started, ended, reason in rows]


def _history(
    rows: Sequence[tuple[datetime, datetime | None, str | None]], *, now: datetime
) -> History:
    """Each attempt's time alive; a preemption for each preempted or lost one."""
    total = History()
    for started, ended, reason in rows:
        alive = max(((ended or now) - started).total_seconds(), 0.0)
        total += History(alive, int(reason in PREEMPTED))
    return total


def _out(history: History, mtbf: float, *, name: str | None = None) -> HistoryOut:
    return HistoryOut(
        name=name,
        exposure_seconds=history.exposure_seconds,
        preemptions=history.preemptions,
        mtbf_seconds=mtbf,
    )
