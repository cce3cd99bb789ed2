from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, select, text, update
from sqlalchemy.orm import Session

from service.models import MaintenancePass


def try_advisory_lock(connection: Connection, *, key: int) -> bool:
    """Take the session-level advisory lock ``key`` if no other session holds it (Postgres)."""
    taken = connection.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar()
    connection.commit()
    return bool(taken)


def advisory_unlock(connection: Connection, *, key: int) -> None:
    connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
    connection.commit()


def start_pass(session: Session, *, task: str, holder: str, at: datetime) -> int:
    row = MaintenancePass(task=task, holder=holder, started_at=at)
    session.add(row)
    session.flush()
    return row.id


def end_pass(session: Session, *, pass_id: int, at: datetime, outcome: str) -> None:
    session.execute(
        update(MaintenancePass)
        .where(MaintenancePass.id == pass_id)
        .values(ended_at=at, outcome=outcome)
    )


def passes(session: Session, *, task: str) -> list[MaintenancePass]:
    """Every pass of ``task``, oldest first."""
    return list(
        session.scalars(
            select(MaintenancePass)
            .where(MaintenancePass.task == task)
            .order_by(MaintenancePass.started_at, MaintenancePass.id)
        )
    )
