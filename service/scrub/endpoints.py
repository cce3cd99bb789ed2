from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from service.auth.service import require_admin
from service.deps import ContextDep, PrincipalDep
from service.errors import ForbiddenError, StoreUnavailableError, responses
from service.scrub import service
from service.scrub.service import ScrubReport

router = APIRouter(prefix="/v1", tags=["scrub"])


@router.post("/scrub", responses=responses(ForbiddenError, StoreUnavailableError))
async def scrub(principal: PrincipalDep, context: ContextDep) -> ScrubReport:
    """Run one pass of the scrubber now, at CKPT_SCRUB_BYTES_PER_SECOND (admin only)."""
    require_admin(principal)
    return await run_in_threadpool(service.scrub, context)
