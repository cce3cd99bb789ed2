"""Quarantine, fenced and reversible.

A complete bundle is set aside (never resumable again, the run resumes from the complete
bundle before it) by:

- an agent whose restore found one of its blobs bad. It names the blob and sends its
  attempt's epoch (fenced like every write). The service reads the blob back first:
  damaged, the blob is marked damaged, which quarantines every complete bundle using it
  (``damage.py``); intact, the answer is 409 ``intact`` and nothing changes (the agent's
  read went wrong on the way: it should retry).
- an admin, naming a blob (as above) or not (this bundle only).

An admin lifts a quarantine (``unquarantine``) once the service has read back every blob
of the bundle intact.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from ckpt.core.contract import Layer, LayerRecord
from service import completeness
from service.auth.principal import Principal
from service.auth.service import require_admin
from service.bundles import damage, isolation, repository
from service.bundles.blobs import read_back, read_back_all
from service.bundles.fencing import check_run_epoch, for_write
from service.bundles.schemas import BundleOut, Quarantine, Unquarantine
from service.bundles.service import bundle_out
from service.context import Context
from service.errors import (
    ConflictError,
    IncompleteError,
    IntactError,
    InvalidRequestError,
)
from service.events import service as events
from service.events.schemas import Action
from service.models import Bundle, BundleStatus, Run, utcnow
from service.sql import Lock


def quarantine(
    context: Context, principal: Principal, *, bundle_id: int, request: Quarantine
) -> BundleOut:
    """Quarantine the bundle: for its damaged ``blob`` (and with it every complete bundle
    using that blob), or, by an admin naming no blob, the bundle alone."""
    if request.blob is None:
        return _quarantine_alone(context, principal, bundle_id, request)
    with context.transaction() as session:
        bundle, _ = _quarantinable(context, session, principal, bundle_id, request, lock=Lock.NONE)
        size = _size_in(session, bundle, request.blob)
    read_at = utcnow()
    stored = read_back(context.store, request.blob, metrics=context.metrics, by="quarantine")
    problem = completeness.blob_problem(size, stored)
    if problem is None:
        raise IntactError(
            f"blob {request.blob} of bundle {bundle_id} reads back intact from the store "
            f"({size} bytes, its SHA-256 matches): nothing was quarantined. The read that "
            "failed went wrong between the store and the reader; retry it",
            blob=request.blob,
        )
    with context.transaction() as session:
        # The run share-locked (the epoch cannot move), the bundle left to ``mark_damaged``,
        # which locks blobs before bundles.
        bundle, run = _quarantinable(
            context, session, principal, bundle_id, request, lock=Lock.SHARE, bundle_lock=Lock.NONE
        )
        damage.mark_damaged(
            session,
            {request.blob: problem},
            read_at=read_at,
            actor=principal.actor,
            found_by=f"reported by {principal.actor}: {request.reason}",
        )
        return bundle_out(session, bundle, run)


def unquarantine(
    context: Context, principal: Principal, *, bundle_id: int, request: Unquarantine
) -> BundleOut:
    """Make a quarantined bundle complete again, once every blob of it reads back intact;
    else 409 ``incomplete`` listing the bad blobs."""
    require_admin(principal)
    with context.transaction() as session:
        bundle, run, _ = for_write(session, principal, bundle_id, lock=Lock.NONE)
        if bundle.status == BundleStatus.COMPLETE:  # a retry
            return bundle_out(session, bundle, run)
        _check_quarantined(bundle)
        records = _records(session, bundle)
    sizes = {blob.sha256: blob.size for record in records.values() for blob in record.blobs}
    read_at = utcnow()
    stored = read_back_all(context.store, sizes, metrics=context.metrics, by="quarantine")
    missing = completeness.missing(world_size=bundle.world_size, recorded=records, stored=stored)
    if missing:
        raise IncompleteError(
            f"bundle {bundle_id} stays quarantined: {completeness.summary(missing)}. Write "
            "those blobs again (a save of the run does), then retry",
            missing=missing.model_dump(mode="json"),
        )
    reason = request.reason or "every blob read back intact"
    return _lift(context, principal, bundle_id, sizes=sizes, read_at=read_at, reason=reason)


def _lift(
    context: Context,
    principal: Principal,
    bundle_id: int,
    *,
    sizes: dict[str, int],
    read_at: datetime,
    reason: str,
) -> BundleOut:
    """Complete the bundle again, its blobs (read intact since ``read_at``) verified."""
    with context.transaction() as session:
        bundle, run, _ = for_write(session, principal, bundle_id, lock=Lock.UPDATE)
        if bundle.status == BundleStatus.QUARANTINED:
            locked = repository.lock_blobs(session, shas=sizes)
            if damage.found_since(locked.values(), read_at):
                raise ConflictError(
                    f"a blob of bundle {bundle_id} was found damaged while it was being "
                    "checked; retry"
                )
            repository.mark_verified(session, sizes=sizes, hashed=sizes, at=utcnow(), locked=locked)
            bundle.status = BundleStatus.COMPLETE
            bundle.reason = None
            events.record(
                session, bundle, actor=principal.actor, action=Action.UNQUARANTINED, reason=reason
            )
        return bundle_out(session, bundle, run)


def _quarantine_alone(
    context: Context, principal: Principal, bundle_id: int, request: Quarantine
) -> BundleOut:
    with context.transaction() as session:
        bundle, run = _quarantinable(
            context, session, principal, bundle_id, request, lock=Lock.UPDATE
        )
        if bundle.status == BundleStatus.COMPLETE:
            damage.set_aside(session, bundle, actor=principal.actor, reason=request.reason)
        return bundle_out(session, bundle, run)


def _quarantinable(
    context: Context,
    session: Session,
    principal: Principal,
    bundle_id: int,
    request: Quarantine,
    *,
    lock: Lock,
    bundle_lock: Lock | None = None,
) -> tuple[Bundle, Run]:
    """The bundle and its run, once the caller may quarantine it: it may write the run, is
    not fenced, names a blob unless an admin, and the bundle is complete (or quarantined
    already: a retry)."""
    bundle, run, _ = for_write(session, principal, bundle_id, lock=lock, bundle_lock=bundle_lock)
    check_run_epoch(context, principal, run, claimed=request.epoch)
    if request.blob is None and isolation.limited(principal):
        raise InvalidRequestError(
            "name the blob that failed verification ('blob'): the service reads it back and "
            "quarantines the bundle only if it is damaged. Only an admin quarantines a "
            "bundle without one"
        )
    if bundle.status not in (BundleStatus.COMPLETE, BundleStatus.QUARANTINED):
        raise ConflictError(
            f"bundle {bundle.id} is {bundle.status}; only a complete bundle is quarantined"
        )
    return bundle, run


def _check_quarantined(bundle: Bundle) -> None:
    if bundle.status != BundleStatus.QUARANTINED:
        raise ConflictError(
            f"bundle {bundle.id} is {bundle.status}; only a quarantined bundle is unquarantined"
        )


def _records(session: Session, bundle: Bundle) -> dict[tuple[int, Layer], LayerRecord]:
    return {
        (row.rank, Layer(row.layer)): LayerRecord.model_validate(row.record)
        for row in repository.layers_of(session, bundle_id=bundle.id)
    }


def _size_in(session: Session, bundle: Bundle, sha: str) -> int:
    """The size ``bundle``'s layers record for blob ``sha``."""
    for record in _records(session, bundle).values():
        for blob in record.blobs:
            if blob.sha256 == sha:
                return blob.size
    raise InvalidRequestError(
        f"blob {sha} is not part of bundle {bundle.id}: name a blob its manifest lists"
    )
