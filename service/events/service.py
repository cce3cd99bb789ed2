"""Write an audit event for each change of a bundle's state, and read them back a page at a
time. Events are written in the transaction that makes the change: a change that rolls
back leaves no event."""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.auth.principal import Principal
from service.auth.service import require_read
from service.bundles import repository as bundles_repository
from service.context import Context
from service.errors import NotFoundError
from service.events import repository
from service.events.schemas import Action, EventOut, EventPage
from service.models import Bundle, BundleEvent
from service.runs import repository as runs_repository


def record(
    session: Session, bundle: Bundle, *, actor: str, action: Action, reason: str | None = None
) -> None:
    """The audit event of a change ``actor`` made to ``bundle`` (its status after it)."""
    repository.add_event(
        session,
        bundle_id=bundle.id,
        run_id=bundle.run_id,
        actor=actor,
        action=action,
        status=bundle.status,
        reason=reason,
    )


def bundle_events(
    context: Context, principal: Principal, *, bundle_id: int, after: int | None, limit: int
) -> EventPage:
    with context.read() as session:
        bundle = bundles_repository.get_bundle(session, bundle_id=bundle_id)
        if bundle is None:
            raise NotFoundError(f"no bundle with id {bundle_id}")
        run = runs_repository.get_run_by_id(session, run_id=bundle.run_id)
        require_read(principal, run.name)
        rows = repository.page_events(session, bundle_id=bundle.id, after=after, limit=limit + 1)
        return _page(rows, run=run.name, limit=limit)


def run_events(
    context: Context, principal: Principal, *, name: str, after: int | None, limit: int
) -> EventPage:
    require_read(principal, name)
    with context.read() as session:
        run = runs_repository.get_run(session, name=name)
        if run is None:
            raise NotFoundError(f"no run named {name!r}")
        rows = repository.page_events(session, run_id=run.id, after=after, limit=limit + 1)
        return _page(rows, run=run.name, limit=limit)


def _page(rows: list[BundleEvent], *, run: str, limit: int) -> EventPage:
    """``limit`` events of ``rows`` (one more was read to learn whether a next page exists)."""
    events = [_out(row, run) for row in rows[:limit]]
    return EventPage(events=events, next=events[-1].id if len(rows) > limit else None)


def _out(row: BundleEvent, run: str) -> EventOut:
    return EventOut(
        id=row.id,
        bundle_id=row.bundle_id,
        run=run,
        at=row.at,
        actor=row.actor,
        action=Action(row.action),
        status=row.status,
        reason=row.reason,
    )
