from __future__ import annotations

from collections.abc import Collection
from typing import cast

from sqlalchemy import Table, insert, literal, select
from sqlalchemy.orm import Session

from service.models import Bundle, BundleEvent, utcnow
from service.sql import ids_in


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
    bundle_ids: Collection[int],
    actor: str,
    action: str,
    status: str,
    reason: str | None,
) -> None:
    """The same event for many bundles, in one ``INSERT ... SELECT`` (the runs' ids come from
    the bundles' rows; as many rows of parameters cost a round trip each)."""
    if not bundle_ids:
        return
    table = cast(Table, BundleEvent.__table__)
    values = {"at": utcnow(), "actor": actor, "action": action, "status": status, "reason": reason}
    rows = select(
        Bundle.id, Bundle.run_id, *(literal(v, table.c[name].type) for name, v in values.items())
    ).where(ids_in(session, Bundle.id, bundle_ids))
    session.execute(
        insert(table).from_select(["bundle_id", "run_id", *values], rows.order_by(Bundle.id))
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
