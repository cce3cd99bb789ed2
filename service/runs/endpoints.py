from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Query, Response

from service.bulk import json_answer, rendered
from service.deps import ContextDep, IdPath, PrincipalDep, PriorityDep, RunPath
from service.errors import (
    ConflictError,
    FencedError,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    responses,
)
from service.names import MAX_RANK, MAX_STEP, PRINTABLE
from service.runs import attempts, mtbf, replay, service
from service.runs.schemas import (
    AttemptCreate,
    AttemptEnd,
    AttemptNotice,
    AttemptOut,
    AttemptRegistered,
    Heartbeat,
    Lineage,
    PreemptionRate,
    Replay,
    ResumePoint,
    RollbackOut,
    RollbackRequest,
    RunCreate,
    RunGoodput,
    RunOut,
    RunPage,
    RunPatch,
    Verification,
)

router = APIRouter(prefix="/v1", tags=["runs"])
# A request about one run (or one attempt): refused for another run's token, not found, bad.
ONE = (ForbiddenError, NotFoundError, InvalidRequestError)


@router.post(
    "/runs",
    status_code=201,
    responses=responses(ForbiddenError, ConflictError, InvalidRequestError),
)
def create_run(request: RunCreate, principal: PrincipalDep, context: ContextDep) -> RunOut:
    """Create a run (optionally with its retention policy)."""
    return service.create_run(context, principal, request)


@router.get("/runs", response_model=RunPage, responses=responses(InvalidRequestError))
def list_runs(
    principal: PrincipalDep,
    context: ContextDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    after: Annotated[
        str | None, Query(max_length=128, pattern=PRINTABLE, description="the previous page's next")
    ] = None,
    prefix: Annotated[
        str | None, Query(max_length=128, pattern=PRINTABLE, description="names starting with this")
    ] = None,
) -> Response:
    """Runs by name, a page at a time."""
    return rendered(service.list_runs(context, principal, after=after, limit=limit, prefix=prefix))


@router.get("/runs/{run}", responses=responses(*ONE))
def get_run(run: RunPath, principal: PrincipalDep, context: ContextDep) -> RunOut:
    return service.get_run(context, principal, name=run)


@router.patch("/runs/{run}", responses=responses(*ONE))
def patch_run(
    run: RunPath, patch: RunPatch, principal: PrincipalDep, context: ContextDep
) -> RunOut:
    """Change the run's retention policy, or (admin only) its dedup group."""
    return service.patch_run(context, principal, name=run, patch=patch)


@router.post(
    "/runs/{run}/attempts",
    status_code=201,
    response_model=AttemptRegistered,
    responses=responses(ForbiddenError, InvalidRequestError),
)
async def register_attempt(run: RunPath, request: AttemptCreate, priority: PriorityDep) -> Response:
    """Register an attempt and get what it resumes from; fences every older attempt."""
    work = partial(attempts.register_attempt, name=run, request=request)
    return json_answer(await priority.serve(work), status_code=201)


@router.post("/attempts/{attempt}/heartbeat", responses=responses(*ONE, FencedError))
async def heartbeat(attempt: IdPath, beat: Heartbeat, priority: PriorityDep) -> AttemptOut:
    """Report that the attempt is alive (and its step); 409 once it is fenced. An attempt
    marked lost that heartbeats again is alive again."""
    return await priority.serve_bearer(partial(attempts.heartbeat, attempt_id=attempt, beat=beat))


@router.post("/attempts/{attempt}/notice", responses=responses(*ONE))
def notice(
    attempt: IdPath, notice: AttemptNotice, principal: PrincipalDep, context: ContextDep
) -> AttemptOut:
    """Record that the attempt read a cloud's notice of a coming preemption (AWS spot
    instance-action or rebalance recommendation, GCP preemption or maintenance, Azure
    Preempt event): the attempt shows the first one and when it came."""
    return attempts.notice(context, principal, attempt_id=attempt, notice=notice)


@router.get("/attempts/{attempt}/replay", responses=responses(*ONE))
def get_replay(
    attempt: IdPath,
    principal: PrincipalDep,
    context: ContextDep,
    *,
    rank: Annotated[int, Query(ge=0, le=MAX_RANK)] = 0,
    after_step: Annotated[int, Query(ge=0, le=MAX_STEP)] = 0,
    after_micro_step: Annotated[int, Query(ge=0, le=MAX_STEP)] = 0,
) -> Replay:
    """What the newest earlier attempt of the run with fingerprints of ``rank`` after the
    position (``after_step``, ``after_micro_step``) computed there: the steps this attempt
    replays after resuming from that position, to compare."""
    return replay.replay(
        context, principal, attempt_id=attempt, rank=rank, after=(after_step, after_micro_step)
    )


@router.put("/attempts/{attempt}/verification", responses=responses(*ONE, FencedError))
def put_verification(
    attempt: IdPath, verification: Verification, principal: PrincipalDep, context: ContextDep
) -> AttemptOut:
    """Record the attempt's verdict on its resume (verified, diverged, unverifiable), as its
    rank 0 reduced it over every rank; a second report replaces the first. 409 once fenced."""
    return replay.verify(context, principal, attempt_id=attempt, verification=verification)


@router.post("/attempts/{attempt}/end", responses=responses(*ONE, ConflictError))
def end_attempt(
    attempt: IdPath, end: AttemptEnd, principal: PrincipalDep, context: ContextDep
) -> AttemptOut:
    """Record how the attempt ended: finished, preempted or failed (replacing "lost", the
    service's verdict on an attempt whose heartbeats lapsed)."""
    return attempts.end_attempt(context, principal, attempt_id=attempt, end=end)


@router.get("/runs/{run}/resumable", response_model=ResumePoint, responses=responses(*ONE))
async def resumable(run: RunPath, priority: PriorityDep) -> Response:
    """The latest resumable bundle of the run's live branch; 404 when there is none."""
    return json_answer(await priority.serve(partial(service.resumable, name=run)))


@router.get("/runs/{run}/lineage", response_model=Lineage, responses=responses(*ONE))
def lineage(
    run: RunPath,
    principal: PrincipalDep,
    context: ContextDep,
    limit: Annotated[
        int | None, Query(ge=1, le=10_000, description="a page of this many bundles, newest first")
    ] = None,
    before: Annotated[
        int | None, Query(ge=1, description="the page of bundles older than this id: next_before")
    ] = None,
) -> Response:
    """Attempts, bundles, parent and resume edges, rollbacks and forks of the run; with
    ``limit``, a page of its newest bundles (before ``before``) and what concerns them."""
    if limit is None and before is None:
        return rendered(service.get_lineage(context, principal, name=run))
    return rendered(
        service.lineage_page(context, principal, name=run, limit=limit or 1000, before=before)
    )


@router.get("/runs/{run}/preemption-rate", responses=responses(*ONE))
def preemption_rate(
    run: RunPath,
    principal: PrincipalDep,
    context: ContextDep,
    pool: Annotated[str | None, Query(max_length=253, pattern=PRINTABLE)] = None,
) -> PreemptionRate:
    """The run's mean time between preemptions, from its attempts and those of its
    capacity pool (its newest attempt's, or ``pool``): what ``CKPT_EVERY=auto`` sizes the
    save interval by."""
    return mtbf.preemption_rate(context, principal, name=run, pool=pool)


@router.get("/runs/{run}/goodput", responses=responses(*ONE))
def goodput(run: RunPath, principal: PrincipalDep, context: ContextDep) -> RunGoodput:
    """Where the run's time went over all its attempts (restart, stall, train, redo) and
    its goodput: (train - redo) / (restart + stall + train)."""
    return service.run_goodput(context, principal, name=run)


@router.post("/runs/{run}/rollback", responses=responses(*ONE, ConflictError))
def rollback(
    run: RunPath, request: RollbackRequest, principal: PrincipalDep, context: ContextDep
) -> RollbackOut:
    """Make an older complete bundle the head: the next attempt resumes from it."""
    return service.rollback(context, principal, name=run, request=request)
