"""Commit: the completeness check that makes a pending bundle complete.

The protocol: a bundle is opened pending by the live attempt; each rank records its layers
(idempotently); commit checks that every (rank, layer) is recorded and that the store holds
every blob with the recorded size and SHA-256, then, in one transaction holding the run's
row lock, writes the manifest to the store, marks the bundle complete and moves the run's
head. Store reads happen outside any transaction; the decision is re-checked under the
lock, so concurrent commits from many ranks produce one complete bundle.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy.orm import Session

from ckpt.core.contract import CatalogRef, Layer, LayerRecord, Manifest, RankRecord, Versions
from ckpt.core.errors import StoreError
from ckpt.core.storage import ObjectStore, keys
from ckpt.service import completeness, lineage
from ckpt.service.auth.service import Principal
from ckpt.service.bundles import repository
from ckpt.service.bundles.blobs import stored_blobs
from ckpt.service.bundles.fencing import check_epoch, for_write
from ckpt.service.bundles.schemas import Commit, Committed
from ckpt.service.bundles.service import bundle_out
from ckpt.service.completeness import StoredBlob
from ckpt.service.context import Context
from ckpt.service.errors import ConflictError, IncompleteError, StoreUnavailableError
from ckpt.service.models import Attempt, Bundle, BundleStatus, Run, utcnow
from ckpt.service.runs.service import catalog_nodes, node
from ckpt.service.sql import Lock

log = logging.getLogger("ckpt.service")

_COMMIT_ROUNDS = 3  # layers recorded while a commit checks blobs make it check again


def commit_bundle(
    context: Context, principal: Principal, *, bundle_id: int, request: Commit
) -> Committed:
    """Make the bundle complete if nothing is missing; else 409 listing exactly what is."""
    for _ in range(_COMMIT_ROUNDS):
        with context.transaction() as session:
            bundle, run, attempt = for_write(session, principal, bundle_id, lock=Lock.NONE)
            check_epoch(context, run, attempt=attempt, claimed=request.epoch)
            if bundle.status == BundleStatus.COMPLETE:
                return _committed(session, bundle, run)
            _check_pending(bundle)
            plan = _plan(session, bundle)
        stored = stored_blobs(context.store, plan.sizes, verified=plan.verified)
        done = _finish_commit(
            context, principal, bundle_id, request=request, plan=plan, stored=stored
        )
        if done is not None:
            return done
    raise ConflictError(
        f"bundle {bundle_id}: layers kept being recorded while it was committed; commit again "
        "once every rank has recorded its layers"
    )


@dataclass(frozen=True)
class _Plan:
    """What a commit must check: the recorded layers and the blobs they reference."""

    records: dict[tuple[int, Layer], LayerRecord]
    sizes: dict[str, int]  # every referenced blob
    verified: frozenset[str]  # those the service read back and hashed before


def _plan(session: Session, bundle: Bundle) -> _Plan:
    records = {
        (row.rank, Layer(row.layer)): LayerRecord.model_validate(row.record)
        for row in repository.layers_of(session, bundle_id=bundle.id)
    }
    sizes = {blob.sha256: blob.size for record in records.values() for blob in record.blobs}
    known = repository.blobs_by_sha(session, shas=sizes)
    verified = frozenset(sha for sha, blob in known.items() if blob.verified_at is not None)
    return _Plan(records=records, sizes=sizes, verified=verified)


def _finish_commit(
    context: Context,
    principal: Principal,
    bundle_id: int,
    *,
    request: Commit,
    plan: _Plan,
    stored: Mapping[str, StoredBlob],
) -> Committed | None:
    """Decide under the run's lock; None when layers changed since ``plan`` (check again)."""
    with context.transaction() as session:
        bundle, run, attempt = for_write(session, principal, bundle_id, lock=Lock.UPDATE)
        check_epoch(context, run, attempt=attempt, claimed=request.epoch)
        if bundle.status == BundleStatus.COMPLETE:
            return _committed(session, bundle, run)
        _check_pending(bundle)
        if _plan(session, bundle).records != plan.records:
            return None
        _check_complete(context, bundle, run, plan=plan, stored=stored)
        manifest = _manifest(bundle, run, attempt, plan.records)
        _write_manifest(context.store, manifest)
        _complete(context, session, bundle, run, plan=plan, manifest=manifest)
        return _committed(session, bundle, run)


def _check_complete(
    context: Context, bundle: Bundle, run: Run, *, plan: _Plan, stored: Mapping[str, StoredBlob]
) -> None:
    """Refuse the commit, listing exactly what is missing, unless nothing is."""
    missing = completeness.missing(
        world_size=bundle.world_size, recorded=plan.records, stored=stored
    )
    if missing:
        context.metrics.rejected.labels(reason="incomplete").inc()
        raise IncompleteError(
            f"bundle {bundle.id} (run {run.name!r}, step {bundle.step}) is not complete: "
            f"{_summary(missing)}; record or upload what is listed and commit again",
            missing=missing.model_dump(mode="json"),
        )


def _write_manifest(store: ObjectStore, manifest: Manifest) -> None:
    """The commit record: written before the catalog says complete, so a complete bundle
    always has its manifest in the store."""
    try:
        store.put(
            keys.manifest_key(manifest.run, manifest.step),
            [manifest.model_dump_json(indent=1).encode()],
        )
    except StoreError as err:
        raise StoreUnavailableError(f"cannot write the manifest: {err}") from err


def _complete(
    context: Context,
    session: Session,
    bundle: Bundle,
    run: Run,
    *,
    plan: _Plan,
    manifest: Manifest,
) -> None:
    """Mark the newly read blobs verified and the bundle complete, and move the run's head."""
    now = utcnow()
    repository.mark_verified(
        session,
        sizes={sha: size for sha, size in plan.sizes.items() if sha not in plan.verified},
        at=now,
    )
    bundle.status = BundleStatus.COMPLETE
    bundle.committed_at = now
    bundle.manifest = manifest.model_dump(mode="json")
    run.head_bundle_id = lineage.head_after_commit(
        run.head_bundle_id, node(bundle), catalog_nodes(session)
    )
    context.metrics.committed.inc()
    context.metrics.committed_bytes.inc(sum(r.payload_bytes for r in plan.records.values()))
    log.info("run %s: bundle %d (step %d) complete", run.name, bundle.id, bundle.step)


def _committed(session: Session, bundle: Bundle, run: Run) -> Committed:
    return Committed(bundle=bundle_out(session, bundle, run), head_id=run.head_bundle_id)


def _manifest(
    bundle: Bundle,
    run: Run,
    attempt: Attempt | None,
    records: Mapping[tuple[int, Layer], LayerRecord],
) -> Manifest:
    ranks: dict[int, dict[Layer, LayerRecord]] = {}
    for (rank, layer), record in sorted(records.items()):
        ranks.setdefault(rank, {})[layer] = record
    return Manifest(
        run=run.name,
        step=bundle.step,
        world_size=bundle.world_size,
        created_at=bundle.created_at.isoformat(),
        versions=Versions.model_validate(bundle.versions),
        ranks=tuple(RankRecord(rank=rank, layers=layers) for rank, layers in ranks.items()),
        catalog=CatalogRef(
            bundle_id=bundle.id,
            parent_id=bundle.parent_id,
            epoch=attempt.epoch if attempt else 0,
        ),
    )


def _summary(missing: completeness.Missing) -> str:
    parts = []
    if missing.ranks:
        parts.append(f"ranks {missing.ranks} recorded nothing")
    if missing.layers:
        parts.append(f"{len(missing.layers)} (rank, layer) parts unrecorded")
    for problem in completeness.BlobProblem:
        count = sum(1 for blob in missing.blobs if blob.problem is problem)
        if count:
            parts.append(f"{count} blob(s) {problem.value.replace('_', ' ')}")
    return ", ".join(parts)


def _check_pending(bundle: Bundle) -> None:
    if bundle.status != BundleStatus.PENDING:
        raise ConflictError(
            f"bundle {bundle.id} is {bundle.status}"
            + (f" ({bundle.reason})" if bundle.reason else "")
            + "; only a pending bundle can be committed"
        )
