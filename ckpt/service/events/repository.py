from __future__ import annotations

from collections.abc import Collection
from typing import cast

from sqlalchemy import Table, insert, select
from sqlalchemy.orm import Session

from ckpt.service.models import BundleEvent, utcnow


def add_event(
    session: Session,
    *,
    bundle_id: int,
    run_id: int,
    actor: str,
    action: str,
    status: str,
    reason: str | None,
) -> None:
    session.add(
        BundleEvent(
            bundle_id=bundle_id,
            run_id=run_id,
            at=utcnow(),
            actor=actor,
            action=action,
            status=status,
            reason=reason,
        )
    )


def add_events(
    session: Session,
    *,
    bundles: Collection[tuple[int, int]],
    actor: str,
    action: str,
    status: str,
    reason: str | None,
) -> None:
    """The same event for many bundles (``bundles``: their ids and runs' ids), in one
    statement."""
    if not bundles:
        return
    at = utcnow()
    session.execute(
        insert(cast(Table, BundleEvent.__table__)),  # Core: the ORM's bulk path costs more
        [
            {
                "bundle_id": bundle_id,
                "run_id": run_id,
                "at": at,
                "actor": actor,
                "action": action,
                "status": status,
                "reason": reason,
            }
            for bundle_id, run_id in bundles
        ],
    )


def page_events(
    session: Session,
    *,
    bundle_id: int | None = None,
    run_id: int | None = None,
    after: int | None,
    limit: int,
) -> list[BundleEvent]:
    """Events of a bundle or of a run, oldest first, after the event with id ``after``."""
    query = select(BundleEvent).order_by(BundleEvent.id).limit(limit)
    if bundle_id is not None:
        query = query.where(BundleEvent.bundle_id == bundle_id)
    if run_id is not None:
        query = query.where(BundleEvent.run_id == run_id)
    if after is not None:
        query = query.where(BundleEvent.id > after)
    return list(session.scalars(query))
