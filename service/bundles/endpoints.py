from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from ckpt.core.contract import Layer, SaveFigures
from service.bulk import json_body, parse_body, rendered
from service.bundles import quarantine as quarantines
from service.bundles import service
from service.bundles.commit import commit_bundle
from service.bundles.schemas import (
    BlobsMissing,
    BlobsQuery,
    BundleOpen,
    BundleOut,
    BundlePatch,
    Commit,
    Committed,
    LayerPut,
    LayersPut,
    Quarantine,
    RecordedLayer,
    RecordedLayers,
    SaveOut,
    Unquarantine,
)
from service.deps import ContextDep, IdPath, PrincipalDep, RankPath, RunPath
from service.errors import (
    ConflictError,
    FencedError,
    ForbiddenError,
    IncompleteError,
    IntactError,
    InvalidRequestError,
    NotFoundError,
    StoreUnavailableError,
    responses,
)

router = APIRouter(prefix="/v1", tags=["bundles"])
# A write to a bundle: refused for another run's token, a missing bundle, a bad body.
WRITE = (ForbiddenError, NotFoundError, InvalidRequestError)


@router.post(
    "/runs/{run}/bundles",
    status_code=201,
    responses=responses(*WRITE, FencedError, ConflictError),
)
def open_bundle(
    run: RunPath, request: BundleOpen, principal: PrincipalDep, context: ContextDep
) -> BundleOut:
    """Open a pending bundle at a step (idempotent per attempt and step)."""
    return service.open_bundle(context, principal, name=run, request=request)


@router.put(
    "/bundles/{bundle}/layers/{rank}/{layer}",
    responses=responses(*WRITE, FencedError, ConflictError),
)
def record_layer(
    *,
    bundle: IdPath,
    rank: RankPath,
    layer: Layer,
    put: LayerPut,
    principal: PrincipalDep,
    context: ContextDep,
) -> RecordedLayer:
    """Record one rank's layer: its blobs and tensor index (idempotent)."""
    return service.record_layer(
        context, principal, bundle_id=bundle, rank=rank, layer=layer, put=put
    )


@router.post(
    "/bundles/{bundle}/layers/{rank}",
    responses=responses(*WRITE, FencedError, ConflictError),
)
def record_layers(
    *,
    bundle: IdPath,
    rank: RankPath,
    put: LayersPut,
    principal: PrincipalDep,
    context: ContextDep,
) -> RecordedLayers:
    """Record every layer of one rank in one request: all or none (idempotent); with the
    figures of the rank's earlier saves, if sent."""
    recorded = service.record_layers(context, principal, bundle_id=bundle, rank=rank, put=put)
    for save in put.saves:
        try:
            service.report_save(
                context, principal, bundle_id=save.bundle, rank=rank, figures=save.figures
            )
        except (ForbiddenError, NotFoundError, InvalidRequestError):
            continue  # a save's figures only: the layers are recorded
    return RecordedLayers(recorded=recorded)


@router.put("/bundles/{bundle}/saves/{rank}", responses=responses(*WRITE))
def report_save(
    *,
    bundle: IdPath,
    rank: RankPath,
    figures: SaveFigures,
    principal: PrincipalDep,
    context: ContextDep,
) -> SaveOut:
    """Record what one rank's save of the bundle cost (a second report replaces it)."""
    return service.report_save(context, principal, bundle_id=bundle, rank=rank, figures=figures)


@router.post(
    "/blobs/missing",
    response_model=BlobsMissing,
    openapi_extra=json_body(BlobsQuery),
    responses=responses(ForbiddenError, InvalidRequestError, StoreUnavailableError),
)
async def blobs_missing(request: Request, principal: PrincipalDep, context: ContextDep) -> Response:
    """Which of these blobs the store does not hold yet (upload those)."""
    # Up to 10,000 blobs: parsed and answered on a worker thread, in slices (bulk.py), not
    # on the event loop.
    query = await parse_body(request, BlobsQuery)

    def answer() -> Response:
        return rendered(service.blobs_missing(context, principal, query))

    return await run_in_threadpool(answer)


@router.post(
    "/bundles/{bundle}/commit",
    responses=responses(*WRITE, FencedError, IncompleteError, ConflictError, StoreUnavailableError),
)
def commit(
    bundle: IdPath, request: Commit, principal: PrincipalDep, context: ContextDep
) -> Committed:
    """Verify every layer and blob, then make the bundle complete and the run's head."""
    return commit_bundle(context, principal, bundle_id=bundle, request=request)


@router.get(
    "/bundles/{bundle}", responses=responses(ForbiddenError, NotFoundError, InvalidRequestError)
)
def get_bundle(bundle: IdPath, principal: PrincipalDep, context: ContextDep) -> BundleOut:
    """Manifest, status and per-rank per-layer completeness of a bundle."""
    return service.get_bundle(context, principal, bundle_id=bundle)


@router.post(
    "/bundles/{bundle}/quarantine",
    responses=responses(*WRITE, FencedError, IntactError, ConflictError, StoreUnavailableError),
)
def quarantine(
    bundle: IdPath, request: Quarantine, principal: PrincipalDep, context: ContextDep
) -> BundleOut:
    """Set aside a complete bundle whose blob failed verification (the service reads the
    blob back first; every complete bundle using it is quarantined), or, as an admin, a
    bundle alone."""
    return quarantines.quarantine(context, principal, bundle_id=bundle, request=request)


@router.post(
    "/bundles/{bundle}/unquarantine",
    responses=responses(*WRITE, IncompleteError, ConflictError, StoreUnavailableError),
)
def unquarantine(
    bundle: IdPath,
    principal: PrincipalDep,
    context: ContextDep,
    request: Unquarantine | None = None,
) -> BundleOut:
    """Make a quarantined bundle complete again once every blob reads back intact (admin)."""
    return quarantines.unquarantine(
        context, principal, bundle_id=bundle, request=request or Unquarantine()
    )


@router.patch("/bundles/{bundle}", responses=responses(*WRITE))
def patch_bundle(
    bundle: IdPath, patch: BundlePatch, principal: PrincipalDep, context: ContextDep
) -> BundleOut:
    """Pin or unpin a bundle: retention never deletes a pinned bundle."""
    return service.patch_bundle(context, principal, bundle_id=bundle, patch=patch)
