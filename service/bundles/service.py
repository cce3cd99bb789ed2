"""Bundles: open one, record its layers, say which blobs the store lacks, take each rank's
save figures, pin, and read bundles back. Committing a bundle is ``commit.py``'s job;
quarantining one ``quarantine.py``'s; who may write to one is ``fencing.py``'s.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from sqlalchemy.orm import Session

from ckpt.core.contract import Imported, Layer, LayerRecord, Manifest, SaveFigures
from service import completeness, models
from service.auth.principal import Principal
from service.auth.service import require_read, require_write, require_writer
from service.bundles import isolation, layers, repository
from service.bundles.blobs import stored_sizes
from service.bundles.fencing import check_epoch, for_write
from service.bundles.schemas import (
    BlobsMissing,
    BlobsQuery,
    BundleOpen,
    BundleOut,
    BundlePatch,
    LayerPut,
    LayersPut,
    RecordedLayer,
    SaveOut,
)
from service.context import Context
from service.errors import ConflictError, InvalidRequestError, NotFoundError
from service.events import service as events
from service.events.schemas import Action
from service.metrics import Metrics
from service.models import Attempt, Bundle, BundleStatus, Run
from service.runs import repository as runs_repository
from service.sql import Lock
from service.yielding import sorted_in_steps


def open_bundle(
    context: Context, principal: Principal, *, name: str, request: BundleOpen
) -> BundleOut:
    """Open a pending bundle at (``step``, ``micro_step``) for the live attempt (a retry
    returns the same one)."""
    require_write(principal, name)
    with context.transaction() as session:
        run = runs_repository.get_run(session, name=name, lock=Lock.UPDATE)
        attempt = runs_repository.get_attempt(session, attempt_id=request.attempt_id)
        if run is None or attempt is None or attempt.run_id != run.id:
            raise NotFoundError(f"run {name!r} has no attempt {request.attempt_id}")
        check_epoch(context, run, attempt=attempt, claimed=request.epoch)
        position = (request.step, request.micro_step)
        found = repository.find_bundle(session, attempt_id=attempt.id, position=position)
        if found is None:
            _check_extends_head(session, run, attempt, position=position)
            parent = repository.latest_of_attempt(
                session,
                attempt_id=attempt.id,
                statuses=(BundleStatus.PENDING, BundleStatus.COMPLETE),
                below=position,
            )
            inserted = repository.insert_bundle(
                session,
                run_id=run.id,
                attempt_id=attempt.id,
                parent_id=parent.id if parent else attempt.resumed_from_id,
                step=request.step,
                micro_step=request.micro_step,
                world_size=request.world_size,
                versions=request.versions.model_dump(mode="json"),
                imported=request.imported.model_dump(mode="json") if request.imported else None,
            )
            found = repository.find_bundle(session, attempt_id=attempt.id, position=position)
            assert found is not None
            if inserted:
                events.record(session, found, actor=principal.actor, action=Action.OPENED)
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
    every = LayersPut(epoch=put.epoch, layers={layer: put.record})
    return record_layers(context, principal, bundle_id=bundle_id, rank=rank, put=every)[0]


def record_layers(
    context: Context, principal: Principal, *, bundle_id: int, rank: int, put: LayersPut
) -> list[RecordedLayer]:
    """Record one rank's layers in one transaction (all or none); recording the same content
    again is a no-op, other content a 409 that records nothing."""
    with context.transaction() as session:
        bundle, run, attempt = for_write(session, principal, bundle_id, lock=Lock.SHARE)
        check_epoch(context, run, attempt=attempt, claimed=put.epoch)
        if rank >= bundle.world_size:
            raise InvalidRequestError(
                f"rank {rank} is out of range: bundle {bundle.id} has world size "
                f"{bundle.world_size} (ranks 0-{bundle.world_size - 1})"
            )
        found = layers.get_layers(session, bundle_id=bundle.id, rank=rank, layers=put.layers)
        new = {layer: record for layer, record in put.layers.items() if layer not in found}
        _claim(session, bundle, records=new.values())
        contents = {layer: record.model_dump(mode="json") for layer, record in put.layers.items()}
        inserted = layers.insert_layers(
            session,
            bundle_id=bundle.id,
            rank=rank,
            layers={
                layer: layers.NewLayer(
                    payload_bytes=record.payload_bytes,
                    record=contents[layer],
                    blobs=[blob.sha256 for blob in record.blobs],
                )
                for layer, record in new.items()
            },
        )
        if len(inserted) < len(new):  # another transaction recorded some meanwhile
            raced = [layer for layer in new if layer not in inserted]
            found |= layers.get_layers(session, bundle_id=bundle.id, rank=rank, layers=raced)
        for layer in put.layers:
            if layer not in inserted and found[layer].record != contents[layer]:
                raise ConflictError(
                    f"rank {rank}'s {layer} layer of bundle {bundle.id} is already recorded "
                    "with other content; a layer is recorded once (open a bundle at a new step)"
                )
        return [
            RecordedLayer(
                rank=rank,
                layer=layer,
                payload_bytes=record.payload_bytes,
                num_blobs=len(record.blobs),
            )
            for layer, record in put.layers.items()
        ]


def blobs_missing(context: Context, principal: Principal, query: BlobsQuery) -> BlobsMissing:
    """Which of these blobs the store does not hold (with the given size), or holds but
    found damaged since; for a run token also every blob its run's dedup group has not
    committed (run isolation: ``isolation.py``), whether the store holds it or not.

    Those it holds are claimed: garbage collection leaves them alone for its grace period,
    so the caller may skip uploading them and record them later.
    """
    require_writer(principal)
    sizes = {blob.sha256: blob.size for blob in query.blobs}
    with context.read() as session:
        candidates = _candidates(session, principal, shas=sizes)
    found = stored_sizes(context.store, candidates)
    present = {sha: sizes[sha] for sha in candidates if found[sha] == sizes[sha]}
    with context.transaction() as session:
        repository.claim_blobs(session, sizes=present)
    # Garbage collection may have deleted one between the read and the claim (it decides
    # under the blob's row lock, which the claim takes): read again what was claimed.
    again = stored_sizes(context.store, present)
    held = {sha for sha, size in present.items() if again[sha] == size}
    return BlobsMissing(missing=sorted_in_steps(set(sizes) - held))


def _candidates(session: Session, principal: Principal, *, shas: Collection[str]) -> list[str]:
    """The blobs that may count as held, if the store holds them: not found damaged, and
    for a run token committed by its dedup group."""
    known = repository.blobs_by_sha(session, shas=shas)
    healthy = [sha for sha in shas if sha not in known or known[sha].damaged_at is None]
    if not isolation.limited(principal):
        return healthy
    assert principal.run is not None
    run = runs_repository.get_run(session, name=principal.run)
    owned = isolation.owned(session, run, shas=healthy) if run is not None else set()
    return [sha for sha in healthy if sha in owned]


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
        if bundle.pinned != patch.pinned:
            bundle.pinned = patch.pinned
            action = Action.PINNED if patch.pinned else Action.UNPINNED
            events.record(session, bundle, actor=principal.actor, action=action)
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
        bundle, _, _ = for_write(session, principal, bundle_id, lock=Lock.NONE)
        if rank >= bundle.world_size:
            raise InvalidRequestError(
                f"rank {rank} is out of range: bundle {bundle.id} has world size "
                f"{bundle.world_size}, so its ranks are 0 to {bundle.world_size - 1}"
            )
        new = repository.put_save(
            session,
            bundle_id=bundle.id,
            run_id=bundle.run_id,
            rank=rank,
            figures=figures.model_dump(),
        )
        saved = repository.get_save(session, bundle_id=bundle.id, rank=rank)
        assert saved is not None
        out = SaveOut.model_validate(saved)
    if new:  # only once committed: a report that failed is sent again
        _count_save(context.metrics, figures)
    return out


def bundle_out(
    session: Session,
    bundle: Bundle,
    run: Run,
    *,
    recorded: Sequence[RecordedLayer] | None = None,
    manifest: Manifest | None = None,
) -> BundleOut:
    """The bundle as the API shows it; ``recorded`` (its layers) and ``manifest`` (its
    validated manifest) when the caller has them already (a commit of 1,000 blobs spent 11%
    of its time reading and validating them again)."""
    if recorded is None:
        recorded = recorded_layers(repository.layers_of(session, bundle_id=bundle.id))
    if manifest is None and bundle.manifest:
        manifest = Manifest.model_validate(bundle.manifest)
    imported = imported_of(bundle)
    return BundleOut(
        id=bundle.id,
        run=run.name,
        step=bundle.step,
        micro_step=bundle.micro_step,
        world_size=bundle.world_size,
        status=bundle.status,
        reason=bundle.reason,
        attempt_id=bundle.attempt_id,
        parent_id=bundle.parent_id,
        pinned=bundle.pinned,
        created_at=bundle.created_at,
        committed_at=bundle.committed_at,
        recorded=list(recorded),
        missing_layers=completeness.missing_layers(
            world_size=bundle.world_size,
            recorded={(r.rank, r.layer) for r in recorded},
            accepted=accepted_missing(imported),
        ),
        manifest=manifest,
        saves=[
            SaveOut.model_validate(row) for row in repository.saves_of(session, bundle_id=bundle.id)
        ],
        imported=imported,
        partial=imported is not None and imported.partial,
    )


def imported_of(bundle: Bundle) -> Imported | None:
    """How ``ckpt import`` made the bundle; None when a save did."""
    return Imported.model_validate(bundle.imported) if bundle.imported else None


def accepted_missing(imported: Imported | None) -> tuple[Layer, ...]:
    """The layers an imported, partial bundle (``imported_of``) commits without."""
    return imported.missing if imported is not None else ()


def recorded_layers(rows: Iterable[models.Layer]) -> list[RecordedLayer]:
    """The layers as a bundle shows them: which, their bytes and their number of blobs."""
    return [
        RecordedLayer(
            rank=row.rank,
            layer=Layer(row.layer),
            payload_bytes=row.payload_bytes,
            num_blobs=len(row.record.get("blobs", [])),
        )
        for row in rows
    ]


def _check_extends_head(
    session: Session, run: Run, attempt: Attempt, *, position: tuple[int, int]
) -> None:
    """A new bundle must continue the live branch: after what the attempt resumed from or
    already opened (an earlier position would move the head backwards)."""
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
    if base is not None and position < (base.step, base.micro_step):
        raise ConflictError(
            f"{_where(position)} is behind {_where((base.step, base.micro_step))}, where "
            f"attempt {attempt.id} continues "
            "the run; to go back, roll back to an older bundle first"
        )


def _where(position: tuple[int, int]) -> str:
    """``step 50``, or ``step 50, micro step 2``."""
    step, micro_step = position
    return f"step {step}" + (f", micro step {micro_step}" if micro_step else "")


def _claim(session: Session, bundle: Bundle, *, records: Collection[LayerRecord]) -> None:
    """Start the GC grace period of the blobs of layers seen for the first time, in one claim
    (rows locked in hash order, as every transaction that updates many blob rows locks them:
    a claim per layer would lock the union out of order, and deadlock with a scrub's
    ``mark_hashed``); only while the bundle is pending. Their catalog size is what some
    record said until a commit verifies the stored bytes; a commit compares each record's
    sizes with the store, never with another record's."""
    if not records:
        return
    if bundle.status != BundleStatus.PENDING:
        raise ConflictError(
            f"bundle {bundle.id} is {bundle.status}: layers are recorded only while it is pending"
        )
    sizes = {blob.sha256: blob.size for record in records for blob in record.blobs}
    repository.claim_blobs(session, sizes=sizes)


def _count_save(metrics: Metrics, figures: SaveFigures) -> None:
    metrics.save_stall.observe(figures.stall_seconds)
    if figures.tax_seconds is not None:  # unknown: no sample (not a tax of 0)
        metrics.save_tax.observe(figures.tax_seconds)
    metrics.save_persist.observe(figures.persist_seconds)
    metrics.save_payload_bytes.inc(figures.payload_bytes)
    metrics.save_new_bytes.inc(figures.new_bytes)
