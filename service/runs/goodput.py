"""A run's goodput (time): the one figure ``GET /v1/runs/{run}/goodput``, the dashboard and
``ckpt demo`` show under that name (``ckpt.core.goodput`` defines it). The dashboard's
other figure, steps kept over steps computed, is a different one with its own name."""

from __future__ import annotations

from dataclasses import asdict

from sqlalchemy.orm import Session

from ckpt.core.goodput import TimeSpent, redo_seconds
from service import lineage
from service.models import Attempt, Run
from service.runs import repository
from service.runs.schemas import TimeOut


def run_time_spent(session: Session, run: Run) -> tuple[int, TimeSpent]:
    """How many of the run's attempts reported their time, and the sum of their time."""
    attempts = repository.run_attempts(session, run_id=run.id)
    lost = lineage.steps_lost_by_attempt(repository.attempt_nodes(session, run_id=run.id))
    spent = [time_spent(a, steps_lost=lost[a.id]) for a in attempts]
    reported = [item for item in spent if item is not None]
    return len(reported), sum(reported, TimeSpent())


def time_spent(attempt: Attempt, *, steps_lost: int | None) -> TimeSpent | None:
    """The attempt's time as its agent reported it; None before any report."""
    if attempt.train_seconds is None:
        return None
    train = attempt.train_seconds
    return TimeSpent(
        restart_seconds=attempt.restart_seconds or 0.0,
        stall_seconds=attempt.stall_seconds or 0.0,
        train_seconds=train,
        redo_seconds=redo_seconds(
            train_seconds=train, steps_trained=attempt.steps_trained or 0, steps_lost=steps_lost
        ),
    )


def time_out(spent: TimeSpent | None) -> TimeOut | None:
    if spent is None:
        return None
    return TimeOut(**asdict(spent), wall_seconds=spent.wall_seconds, goodput=spent.goodput)
