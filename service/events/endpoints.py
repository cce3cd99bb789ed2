from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.deps import ContextDep, IdPath, PrincipalDep, RunPath
from service.errors import ForbiddenError, InvalidRequestError, NotFoundError, responses
from service.events import service
from service.events.schemas import EventPage

router = APIRouter(prefix="/v1", tags=["events"])

AfterQuery = Annotated[
    int | None, Query(ge=0, le=2**62, description="the previous page's next: events after it")
]
LimitQuery = Annotated[int, Query(ge=1, le=1000, description="events a page holds")]
ERRORS = responses(ForbiddenError, NotFoundError, InvalidRequestError)


@router.get("/bundles/{bundle}/events", responses=ERRORS)
def bundle_events(
    bundle: IdPath,
    principal: PrincipalDep,
    context: ContextDep,
    after: AfterQuery = None,
    limit: LimitQuery = 100,
) -> EventPage:
    """The bundle's audit log: each change of its state (who, what, when, why), oldest first."""
    return service.bundle_events(context, principal, bundle_id=bundle, after=after, limit=limit)


@router.get("/runs/{run}/events", responses=ERRORS)
def run_events(
    run: RunPath,
    principal: PrincipalDep,
    context: ContextDep,
    after: AfterQuery = None,
    limit: LimitQuery = 100,
) -> EventPage:
    """The audit log of every bundle of the run, oldest first, a page at a time."""
    return service.run_events(context, principal, name=run, after=after, limit=limit)
