from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from ckpt.core.contract import Layer, SaveFigures
from ckpt.service.bundles import service
from ckpt.service.bundles.commit import commit_bundle
from ckpt.service.bundles.schemas import (
    BlobsMissing,
    BlobsQuery,
    BundleOpen,
    BundleOut,
    BundlePatch,
    Commit,
    Committed,
    IncompleteBody,
    LayerPut,
    Quarantine,
    RecordedLayer,
    SaveOut,
)
from ckpt.service.deps import ContextDep, IdPath, PrincipalDep, RunPath

router = APIRouter(prefix="/v1", tags=["bundles"])

RankPath = Annotated[int, Path(ge=0, le=16383)]
CONFLICTS: dict[int | str, dict[str, Any]] = {
    409: {"description": "fenced, or the catalog's state forbids it"}
}


@router.post("/runs/{run}/bundles", status_code=201, responses=CONFLICTS)
def open_bundle(
    run: RunPath, request: BundleOpen, principal: PrincipalDep, context: ContextDep
) -> BundleOut:
    """Open a pending bundle at a step (idempotent per attempt and step)."""
    return service.open_bundle(context, principal, name=run, request=request)


@router.put("/bundles/{bundle}/layers/{rank}/{layer}", responses=CONFLICTS)
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


@router.put("/bundles/{bundle}/saves/{rank}")
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


@router.post("/blobs/missing")
def blobs_missing(query: BlobsQuery, principal: PrincipalDep, context: ContextDep) -> BlobsMissing:
    """Which of these blobs the store does not hold yet (upload those)."""
    return service.blobs_missing(context, principal, query)


@router.post(
    "/bundles/{bundle}/commit",
    responses={409: {"model": IncompleteBody, "description": "incomplete, or fenced"}},
)
def commit(
    bundle: IdPath, request: Commit, principal: PrincipalDep, context: ContextDep
) -> Committed:
    """Verify every layer and blob, then make the bundle complete and the run's head."""
    return commit_bundle(context, principal, bundle_id=bundle, request=request)


@router.get("/bundles/{bundle}")
def get_bundle(bundle: IdPath, principal: PrincipalDep, context: ContextDep) -> BundleOut:
    """Manifest, status and per-rank per-layer completeness of a bundle."""
    return service.get_bundle(context, principal, bundle_id=bundle)


@router.post("/bundles/{bundle}/quarantine", responses=CONFLICTS)
def quarantine(
    bundle: IdPath, request: Quarantine, principal: PrincipalDep, context: ContextDep
) -> BundleOut:
    """Set aside a complete bundle that failed verification (the agent reports it)."""
    return service.quarantine(context, principal, bundle_id=bundle, request=request)


@router.patch("/bundles/{bundle}")
def patch_bundle(
    bundle: IdPath, patch: BundlePatch, principal: PrincipalDep, context: ContextDep
) -> BundleOut:
    """Pin or unpin a bundle: retention never deletes a pinned bundle."""
    return service.patch_bundle(context, principal, bundle_id=bundle, patch=patch)
