"""Bundles: open, record layers, commit (the completeness check), take each rank's save
figures, and read them back.

The commit protocol: a bundle is opened pending by the live attempt; each rank records its
layers (idempotently); commit checks that every (rank, layer) is recorded and that the store
holds every blob with the recorded size and SHA-256, then, in one transaction holding the
run's row lock, writes the manifest to the store, marks the bundle complete and moves the
run's head. Store reads happen outside any transaction; the decision is re-checked under
the lock, so concurrent commits from many ranks produce one complete bundle.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.orm import Session

from ckpt.core.contract import (
    CatalogRef,
    Layer,
    LayerRecord,
    Manifest,
    RankRecord,
    SaveFigures,
    Versions,
)
from ckpt.core.errors import StoreError
from ckpt.core.storage import ObjectStore, keys
from ckpt.service import completeness, lineage
from ckpt.service.auth.service import Principal, require_read, require_write, require_writer
from ckpt.service.bundles import repository
from ckpt.service.bundles.schemas import (
    BlobsMissing,
    BlobsQuery,
    BundleOpen,
    BundleOut,
    BundlePatch,
    Commit,
    Committed,
    LayerPut,
    Quarantine,
    RecordedLayer,
    SaveOut,
)
from ckpt.service.completeness import StoredBlob
from ckpt.service.context import Context
from ckpt.service.errors import (
    ConflictError,
    FencedError,
    IncompleteError,
    InvalidRequestError,
    NotFoundError,
    StoreUnavailableError,
)
from ckpt.service.metrics import Metrics
from ckpt.service.models import Attempt, Bundle, BundleStatus, Run, utcnow
from ckpt.service.runs import repository as runs_repository
from ckpt.service.runs.service import catalog_nodes, node
from ckpt.service.sql import Lock

log = logging.getLogger("ckpt.service")

_STORE_THREADS = 4
_COMMIT_ROUNDS = 3  # layers recorded while a commit checks blobs make it check again


def open_bundle(
    context: Context, principal: Principal, *, name: str, request: BundleOpen
) -> BundleOut:
    """Open a pending bundle at ``step`` for the live attempt (a retry returns the same one)."""
    require_write(principal, name)
    with context.transaction() as session:
        run = runs_repository.get_run(session, name=name, lock=Lock.UPDATE)
        attempt = runs_repository.get_attempt(session, attempt_id=request.attempt_id)
        if run is None or attempt is None or attempt.run_id != run.id:
            raise NotFoundError(f"run {name!r} has no attempt {request.attempt_id}")
        _check_epoch(context, run, attempt=attempt, claimed=request.epoch)
        found = repository.find_bundle(session, attempt_id=attempt.id, step=request.step)
        if found is None:
            _check_extends_head(session, run, attempt, step=request.step)
            parent = repository.latest_of_attempt(
                session,
                attempt_id=attempt.id,
                statuses=(BundleStatus.PENDING, BundleStatus.COMPLETE),
                below_step=request.step,
            )
            repository.insert_bundle(
                session,
                run_id=run.id,
                attempt_id=attempt.id,
                parent_id=parent.id if parent else attempt.resumed_from_id,
                step=request.step,
                world_size=request.world_size,
                versions=request.versions.model_dump(mode="json"),
            )
            found = repository.find_bundle(session, attempt_id=attempt.id, step=request.step)
            assert found is not None
        if found.world_size != request.world_size:
            raise ConflictError(
                f"bundle {found.id} (step {found.step}) was opened with world size "
                f"{found.world_size}, not {request.world_size}"
            )
        return bundle_out(session, found, run)


def record_layer(
    context: Context,
    principal: Principal,
    *,
    bundle_id: int,
    rank: int,
    layer: Layer,
    put: LayerPut,
) -> RecordedLayer:
    """Record one rank's layer; recording the same content again is a no-op."""
    with context.transaction() as session:
        bundle, run, attempt = _for_write(session, principal, bundle_id, lock=Lock.SHARE)
        _check_epoch(context, run, attempt=attempt, claimed=put.epoch)
        if rank >= bundle.world_size:
            raise InvalidRequestError(
                f"rank {rank} is out of range: bundle {bundle.id} has world size "
                f"{bundle.world_size} (ranks 0-{bundle.world_size - 1})"
            )
        record = put.record.model_dump(mode="json")
        existing = repository.get_layer(session, bundle_id=bundle.id, rank=rank, layer=layer)
        if existing is None:
            if bundle.status != BundleStatus.PENDING:
                raise ConflictError(
                    f"bundle {bundle.id} is {bundle.status}: layers are recorded only while "
                    "it is pending"
                )
            _claim(session, put.record)
            repository.insert_layer(
                session,
                bundle_id=bundle.id,
                rank=rank,
                layer=layer,
                payload_bytes=put.record.payload_bytes,
                record=record,
                blobs=[blob.sha256 for blob in put.record.blobs],
            )
            existing = repository.get_layer(session, bundle_id=bundle.id, rank=rank, layer=layer)
            assert existing is not None
        if existing.record != record:
            raise ConflictError(
                f"rank {rank}'s {layer} layer of bundle {bundle.id} is already recorded with "
                "other content; a layer is recorded once (open a bundle at a new step)"
            )
        return RecordedLayer(
            rank=rank,
            layer=layer,
            payload_bytes=existing.payload_bytes,
            num_blobs=len(put.record.blobs),
        )


def blobs_missing(context: Context, principal: Principal, query: BlobsQuery) -> BlobsMissing:
    """Which of these blobs the store does not hold (with the given size).

    Those it holds are claimed: garbage collection leaves them alone for its grace period,
    so the caller may skip uploading them and record them later.
    """
    require_writer(principal)
    sizes = {blob.sha256: blob.size for blob in query.blobs}
    found = _parallel(lambda sha: _size(context.store, sha), sizes)
    held = {sha: sizes[sha] for sha, size in zip(sizes, found, strict=True) if size == sizes[sha]}
    with context.transaction() as session:
        repository.claim_blobs(session, sizes=held)
    return BlobsMissing(missing=sorted(set(sizes) - set(held)))


def commit(context: Context, principal: Principal, *, bundle_id: int, request: Commit) -> Committed:
    """Make the bundle complete if nothing is missing; else 409 listing exactly what is."""
    for _ in range(_COMMIT_ROUNDS):
        with context.transaction() as session:
            bundle, run, attempt = _for_write(session, principal, bundle_id, lock=Lock.NONE)
            _check_epoch(context, run, attempt=attempt, claimed=request.epoch)
            if bundle.status == BundleStatus.COMPLETE:
                return Committed(
                    bundle=bundle_out(session, bundle, run), head_id=run.head_bundle_id
                )
            _check_pending(bundle)
            plan = _plan(session, bundle)
        stored = _check_blobs(context.store, plan)
        done = _finish_commit(
            context, principal, bundle_id, request=request, plan=plan, stored=stored
        )
        if done is not None:
            return done
    raise ConflictError(
        f"bundle {bundle_id}: layers kept being recorded while it was committed; commit again "
        "once every rank has recorded its layers"
    )


def get_bundle(context: Context, principal: Principal, *, bundle_id: int) -> BundleOut:
    with context.transaction() as session:
        bundle = repository.get_bundle(session, bundle_id=bundle_id)
        if bundle is None:
            raise NotFoundError(f"no bundle with id {bundle_id}")
        run = runs_repository.get_run_by_id(session, run_id=bundle.run_id)
        require_read(principal, run.name)
        return bundle_out(session, bundle, run)


def patch_bundle(
    context: Context, principal: Principal, *, bundle_id: int, patch: BundlePatch
) -> BundleOut:
    """Pin a bundle (retention never deletes it) or unpin it."""
    with context.transaction() as session:
        bundle = repository.get_bundle(session, bundle_id=bundle_id, lock=Lock.UPDATE)
        if bundle is None:
            raise NotFoundError(f"no bundle with id {bundle_id}")
        run = runs_repository.get_run_by_id(session, run_id=bundle.run_id)
        require_write(principal, run.name)
        bundle.pinned = patch.pinned
        return bundle_out(session, bundle, run)


def quarantine(
    context: Context, principal: Principal, *, bundle_id: int, request: Quarantine
) -> BundleOut:
    """Set aside a complete bundle whose stored bytes failed verification: it is never
    resumable again, and the run resumes from the complete bundle before it."""
    with context.transaction() as session:
        bundle, run, _ = _for_write(session, principal, bundle_id, lock=Lock.UPDATE)
        if bundle.status not in (BundleStatus.COMPLETE, BundleStatus.QUARANTINED):
            raise ConflictError(
                f"bundle {bundle.id} is {bundle.status}; only a complete bundle is quarantined"
            )
        if bundle.status == BundleStatus.COMPLETE:
            bundle.status = BundleStatus.QUARANTINED
            bundle.reason = request.reason
            log.error("run %s: bundle %d quarantined: %s", run.name, bundle.id, request.reason)
        return bundle_out(session, bundle, run)


def report_save(
    context: Context, principal: Principal, *, bundle_id: int, rank: int, figures: SaveFigures
) -> SaveOut:
    """Store what one rank's save of the bundle cost; reporting again replaces the figures.

    No epoch check: the figures are facts, even from a fenced attempt. Only a rank's first
    report counts in the metrics, so a retried report counts once.
    """
    with context.transaction() as session:
        # No row lock: nothing here changes the bundle or its run.
        bundle, _, _ = _for_write(session, principal, bundle_id, lock=Lock.NONE)
        if rank >= bundle.world_size:
            raise InvalidRequestError(
                f"rank {rank} is out of range: bundle {bundle.id} has world size "
                f"{bundle.world_size}, so its ranks are 0 to {bundle.world_size - 1}"
            )
        new = repository.put_save(
            session, bundle_id=bundle.id, rank=rank, figures=figures.model_dump()
        )
        saved = repository.get_save(session, bundle_id=bundle.id, rank=rank)
        assert saved is not None
        out = SaveOut.model_validate(saved)
    if new:  # only once committed: a report that failed is sent again
        _count_save(context.metrics, figures)
    return out


def bundle_out(session: Session, bundle: Bundle, run: Run) -> BundleOut:
    layers = repository.layers_of(session, bundle_id=bundle.id)
    recorded = {(row.rank, Layer(row.layer)) for row in layers}
    return BundleOut(
        id=bundle.id,
        run=run.name,
        step=bundle.step,
        world_size=bundle.world_size,
        status=bundle.status,
        reason=bundle.reason,
        attempt_id=bundle.attempt_id,
        parent_id=bundle.parent_id,
        pinned=bundle.pinned,
        created_at=bundle.created_at,
        committed_at=bundle.committed_at,
        recorded=[
            RecordedLayer(
                rank=row.rank,
                layer=Layer(row.layer),
                payload_bytes=row.payload_bytes,
                num_blobs=len(row.record.get("blobs", [])),
            )
            for row in layers
        ],
        missing_layers=completeness.missing_layers(world_size=bundle.world_size, recorded=recorded),
        manifest=Manifest.model_validate(bundle.manifest) if bundle.manifest else None,
        saves=[
            SaveOut.model_validate(row) for row in repository.saves_of(session, bundle_id=bundle.id)
        ],
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


def _check_blobs(store: ObjectStore, plan: _Plan) -> dict[str, StoredBlob]:
    """What the store holds of each blob: size always, SHA-256 unless verified before."""

    def check(sha: str) -> StoredBlob:
        size = _size(store, sha)
        if size != plan.sizes[sha] or sha in plan.verified:
            return StoredBlob(size=size)
        try:
            data = store.get(keys.blob_key(sha)) if size else b""
        except StoreError as err:
            raise StoreUnavailableError(f"cannot read blob {sha} from the store: {err}") from err
        return StoredBlob(size=len(data), sha256_ok=hashlib.sha256(data).hexdigest() == sha)

    return dict(zip(plan.sizes, _parallel(check, plan.sizes), strict=True))


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
        bundle, run, attempt = _for_write(session, principal, bundle_id, lock=Lock.UPDATE)
        _check_epoch(context, run, attempt=attempt, claimed=request.epoch)
        if bundle.status == BundleStatus.COMPLETE:
            return Committed(bundle=bundle_out(session, bundle, run), head_id=run.head_bundle_id)
        _check_pending(bundle)
        now_plan = _plan(session, bundle)
        if now_plan.records != plan.records:
            return None
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
        manifest = _manifest(bundle, run, attempt, plan.records)
        try:
            context.store.put(
                keys.manifest_key(run.name, bundle.step),
                [manifest.model_dump_json(indent=1).encode()],
            )
        except StoreError as err:
            raise StoreUnavailableError(f"cannot write the manifest: {err}") from err
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


def _count_save(metrics: Metrics, figures: SaveFigures) -> None:
    metrics.save_stall.observe(figures.stall_seconds)
    metrics.save_persist.observe(figures.persist_seconds)
    metrics.save_payload_bytes.inc(figures.payload_bytes)
    metrics.save_new_bytes.inc(figures.new_bytes)


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


def _for_write(
    session: Session, principal: Principal, bundle_id: int, *, lock: Lock
) -> tuple[Bundle, Run, Attempt | None]:
    """The bundle, its run and attempt, authorized for writing; rows locked run first."""
    found = repository.get_bundle(session, bundle_id=bundle_id)
    if found is None:
        raise NotFoundError(f"no bundle with id {bundle_id}")
    run = runs_repository.get_run_by_id(session, run_id=found.run_id, lock=lock)
    require_write(principal, run.name)
    bundle = repository.get_bundle(session, bundle_id=bundle_id, lock=lock)
    assert bundle is not None
    attempt = (
        runs_repository.get_attempt(session, attempt_id=bundle.attempt_id)
        if bundle.attempt_id is not None
        else None
    )
    return bundle, run, attempt


def _check_epoch(context: Context, run: Run, *, attempt: Attempt | None, claimed: int) -> None:
    """Fencing: only the run's current attempt, naming its own epoch, may write."""
    if attempt is not None and attempt.epoch == run.epoch == claimed:
        return
    context.metrics.fenced.inc()
    raise FencedError(
        f"epoch {claimed} is fenced: run {run.name!r} is at epoch {run.epoch} (a newer attempt "
        "registered, or the run was rolled back). Stop writing; this attempt's saves cannot "
        "move the run's head.",
        run_epoch=run.epoch,
    )


def _check_extends_head(session: Session, run: Run, attempt: Attempt, *, step: int) -> None:
    """A new bundle must continue the live branch: after what the attempt resumed from or
    already opened (a lower step would move the head backwards)."""
    base = repository.latest_of_attempt(session, attempt_id=attempt.id, statuses=list(BundleStatus))
    base = base or (
        session.get(Bundle, attempt.resumed_from_id) if attempt.resumed_from_id else None
    )
    if base is None and run.head_bundle_id is not None:
        head = session.get(Bundle, run.head_bundle_id)
        raise ConflictError(
            f"run {run.name!r} has a head (step {head.step if head else '?'}) that attempt "
            f"{attempt.id} did not resume from; saving would fork the run without a base. "
            "Register the attempt with resume=true, roll back, or use a new run"
        )
    if base is not None and step < base.step:
        raise ConflictError(
            f"step {step} is behind step {base.step}, where attempt {attempt.id} continues "
            "the run; to go back, roll back to an older bundle first"
        )


def _check_pending(bundle: Bundle) -> None:
    if bundle.status != BundleStatus.PENDING:
        raise ConflictError(
            f"bundle {bundle.id} is {bundle.status}"
            + (f" ({bundle.reason})" if bundle.reason else "")
            + "; only a pending bundle can be committed"
        )


def _claim(session: Session, record: LayerRecord) -> None:
    """Start the GC grace period of the record's blobs. Their catalog size is what some
    record said until a commit verifies the stored bytes; a commit compares each record's
    sizes with the store, never with another record's."""
    repository.claim_blobs(session, sizes={blob.sha256: blob.size for blob in record.blobs})


def _size(store: ObjectStore, sha: str) -> int | None:
    try:
        return store.size(keys.blob_key(sha))
    except StoreError as err:
        raise StoreUnavailableError(f"the store cannot be read: {err}") from err


T = TypeVar("T")
R = TypeVar("R")


def _parallel(action: Callable[[T], R], items: Iterable[T]) -> list[R]:
    with ThreadPoolExecutor(_STORE_THREADS, thread_name_prefix="ckpt-store") as pool:
        return list(pool.map(action, items))
