from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import Bundle, BundleStatus, Run


def runs(session: Session) -> list[Run]:
    return list(session.scalars(select(Run).order_by(Run.id)))


def complete_bundle_ids(session: Session) -> list[int]:
    """Every complete bundle, newest first."""
    return list(
        session.scalars(
            select(Bundle.id)
            .where(Bundle.status == BundleStatus.COMPLETE)
            .order_by(Bundle.committed_at.desc(), Bundle.id.desc())
        )
    )
