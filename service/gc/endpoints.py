from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from service.auth.service import require_admin
from service.deps import ContextDep, PrincipalDep
from service.errors import (
    ForbiddenError,
    InvalidRequestError,
    StoreUnavailableError,
    responses,
)
from service.gc import service
from service.gc.service import GcReport

router = APIRouter(prefix="/v1", tags=["gc"])


@router.post("/gc", responses=responses(ForbiddenError, InvalidRequestError, StoreUnavailableError))
async def collect(principal: PrincipalDep, context: ContextDep, dry_run: bool = False) -> GcReport:
    """Run retention and garbage collection now (admin only)."""
    require_admin(principal)
    return await run_in_threadpool(service.collect, context, dry_run=dry_run)
