"""Commit: the completeness check that makes a pending bundle complete.

The protocol: a bundle is opened pending by the live attempt; each rank records its layers
(idempotently); commit checks that every (rank, layer) is recorded and that the store holds
every blob with the recorded size and SHA-256, then, in one transaction holding the run's
row lock, writes the manifest to the store, marks the bundle complete and moves the run's
head. Store reads happen outside any transaction; the decision is re-checked under the
lock, so concurrent commits from many ranks produce one complete bundle.

A blob is hashed once: later commits check only its presence and size, unless it was found
damaged since (``damage.py``), when it is read and hashed again; intact, its damage is
cleared. Blob health is read once, under the lock: a blob found damaged there that the
round only sized makes the commit check again, reading it back. A commit that finds a blob
absent or not matching its SHA-256 marks it damaged. For a run token, a blob its run's
dedup group never committed must have been written since the bundle was opened
(``isolation.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from ckpt.core.contract import CatalogRef, Layer, LayerRecord, Manifest, RankRecord, Versions
from ckpt.core.errors import StoreError
from ckpt.core.storage import ObjectStore, keys
from service import completeness, lineage
from service.auth.principal import Principal
from service.bundles import damage, isolation, repository
from service.bundles.blobs import stored_blobs
from service.bundles.fencing import check_epoch, for_write
from service.bundles.schemas import Commit, Committed, RecordedLayer
from service.bundles.service import accepted_missing, bundle_out, imported_of, recorded_layers
from service.completeness import BlobProblem, StoredBlob
from service.context import Context
from service.errors import ConflictError, IncompleteError, StoreUnavailableError
from service.events import service as events
from service.events.schemas import Action
from service.models import Attempt, Bundle, BundleStatus, Run, utcnow
from service.runs.service import catalog_nodes, node
from service.sql import Lock

log = logging.getLogger("ckpt.service")

_COMMIT_ROUNDS = 3  # layers recorded while a commit checks blobs make it check again


def commit_bundle(
    context: Context,
    principal: Principal,
    *,
    bundle_id: int,
    request: Commit,
    reason: str | None = None,
) -> Committed:
    """Make the bundle complete if nothing is missing; else 409 listing exactly what is.
    ``reason``: why, on the ``committed`` event, when it is not the writer's own commit."""
    damaged: frozenset[str] = frozenset()  # to read back: found damaged by a round's lock
    for _ in range(_COMMIT_ROUNDS):
        with context.transaction() as session:
            bundle, run, attempt = for_write(session, principal, bundle_id, lock=Lock.NONE)
            check_epoch(context, run, attempt=attempt, claimed=request.epoch)
            if bundle.status == BundleStatus.COMPLETE:
                return _committed(session, bundle, run)
            _check_pending(bundle)
            plan = _plan(session, bundle, run, principal=principal, damaged=damaged)
        read_at = utcnow()
        stored = stored_blobs(
            context.store,
            plan.sizes,
            metrics=context.metrics,
            damaged=plan.damaged,
            unproven=plan.unproven,
            opened_at=plan.opened_at,
        )
        _mark_damage_found(context, principal, bundle_id, stored, read_at=read_at)
        done = _finish_commit(
            context,
            principal,
            bundle_id,
            request=request,
            plan=plan,
            read_at=read_at,
            stored=stored,
            reason=reason,
        )
        if isinstance(done, Committed):
            return done
        damaged = done
    raise ConflictError(
        f"bundle {bundle_id}: layers kept being recorded (or its blobs found damaged) while it "
        "was committed; commit again once every rank has recorded its layers"
    )


@dataclass(frozen=True)
class _Plan:
    """What a commit must check: the recorded layers and the blobs they reference."""

    records: dict[tuple[int, Layer], LayerRecord]
    # Each recorded layer's row: compared under the lock (a record is never changed once
    # inserted, so a layer recorded since is a row not in this).
    layer_ids: dict[tuple[int, str], int]
    recorded: list[RecordedLayer]  # as the answer shows them
    sizes: dict[str, int]  # every referenced blob
    damaged: frozenset[str]  # those to read back: an earlier round found them damaged
    unproven: frozenset[str]  # those the run must show it wrote (run isolation)
    opened_at: datetime


def _plan(
    session: Session, bundle: Bundle, run: Run, *, principal: Principal, damaged: frozenset[str]
) -> _Plan:
    """The blobs' health is not read here: it is read once, under the lock, and a blob
    found damaged there that this round only sized is read back in the next (rare: the
    agent rewrites damaged blobs)."""
    rows = repository.layers_of(session, bundle_id=bundle.id)
    records = {(row.rank, Layer(row.layer)): LayerRecord.model_validate(row.record) for row in rows}
    sizes = {blob.sha256: blob.size for record in records.values() for blob in record.blobs}
    unproven = frozenset(
        set(sizes) - isolation.owned(session, run, shas=sizes)
        if isolation.limited(principal)
        else ()
    )
    return _Plan(
        records=records,
        layer_ids={(row.rank, row.layer): row.id for row in rows},
        recorded=recorded_layers(rows),
        sizes=sizes,
        damaged=damaged & sizes.keys(),
        unproven=unproven,
        opened_at=bundle.created_at,
    )


def _mark_damage_found(
    context: Context,
    principal: Principal,
    bundle_id: int,
    stored: Mapping[str, StoredBlob],
    *,
    read_at: datetime,
) -> None:
    """Blobs the store lacks, or holds with bytes that do not match their SHA-256, are
    damaged, whichever bundle references them (a wrong size may be the record's fault, and
    an unproven blob was not looked at)."""
    found = {
        sha: problem
        for sha, blob in stored.items()
        if blob.written is not False
        and (problem := _fact(blob)) in (BlobProblem.ABSENT, BlobProblem.WRONG_HASH)
    }
    if found:
        with context.transaction() as session:
            damage.mark_damaged(
                session,
                found,
                read_at=read_at,
                actor=principal.actor,
                found_by=f"the commit of bundle {bundle_id}",
            )


def _fact(blob: StoredBlob) -> BlobProblem | None:
    if blob.size is None:
        return BlobProblem.ABSENT
    return BlobProblem.WRONG_HASH if blob.sha256_ok is False else None


def _finish_commit(
    context: Context,
    principal: Principal,
    bundle_id: int,
    *,
    request: Commit,
    plan: _Plan,
    read_at: datetime,
    stored: Mapping[str, StoredBlob],
    reason: str | None,
) -> Committed | frozenset[str]:
    """Decide under the run's lock. Or check again, reading back the blobs answered: when
    layers were recorded since ``plan``, or the catalog says damaged a blob that the store
    showed whole (this round sized it only, or it was found damaged since ``read_at``)."""
    with context.transaction() as session:
        bundle, run, attempt = for_write(session, principal, bundle_id, lock=Lock.UPDATE)
        check_epoch(context, run, attempt=attempt, claimed=request.epoch)
        if bundle.status == BundleStatus.COMPLETE:
            return _committed(session, bundle, run)
        _check_pending(bundle)
        if repository.layer_ids(session, bundle_id=bundle.id) != plan.layer_ids:
            return plan.damaged
        # The blobs' rows stay locked until the bundle is complete: a blob found damaged
        # meanwhile waits, then quarantines it.
        rows = repository.lock_blobs(session, shas=plan.sizes)
        unsettled = _unsettled(plan, rows, stored, read_at=read_at)
        if unsettled:
            return plan.damaged | unsettled
        _check_complete(context, bundle, run, plan=plan, stored=stored)
        manifest = _manifest(bundle, run, attempt, plan.records)
        _write_manifest(context.store, manifest)
        # The attempt reached this step: a floor for its steps lost should it be killed
        # before its next heartbeat.
        if attempt is not None:
            attempt.last_step = max(attempt.last_step or 0, bundle.step)
        _complete(
            context,
            session,
            bundle,
            run,
            plan=plan,
            stored=stored,
            locked=rows,
            manifest=manifest,
            actor=principal.actor,
            reason=reason,
        )
        return _committed(session, bundle, run, recorded=plan.recorded, manifest=manifest)


def _unsettled(
    plan: _Plan,
    rows: Mapping[str, repository.Health],
    stored: Mapping[str, StoredBlob],
    *,
    read_at: datetime,
) -> frozenset[str]:
    """The blobs the store showed whole that the catalog says damaged: sized only (a size
    cannot tell a rewritten blob from a rotten one), or found damaged since they were read
    back at ``read_at``. A blob read back whole that was damaged before is not: the commit
    clears its damage."""
    return frozenset(
        sha
        for sha, row in rows.items()
        if row.damaged_at is not None
        and completeness.blob_problem(plan.sizes[sha], stored[sha]) is None
        and (sha not in plan.damaged or row.damaged_at >= read_at)
    )


def _check_complete(
    context: Context, bundle: Bundle, run: Run, *, plan: _Plan, stored: Mapping[str, StoredBlob]
) -> None:
    """Refuse the commit, listing exactly what is missing, unless nothing is."""
    missing = completeness.missing(
        world_size=bundle.world_size,
        recorded=plan.records,
        stored=stored,
        accepted=accepted_missing(imported_of(bundle)),
    )
    if missing:
        context.metrics.rejected.labels(reason="incomplete").inc()
        raise IncompleteError(
            f"bundle {bundle.id} (run {run.name!r}, step {bundle.step}) is not complete: "
            f"{completeness.summary(missing)}; record or upload what is listed and commit again",
            missing=missing.model_dump(mode="json"),
        )


def _write_manifest(store: ObjectStore, manifest: Manifest) -> None:
    """The commit record: written before the catalog says complete, so a complete bundle
    always has its manifest in the store."""
    try:
        store.put(
            keys.manifest_key(manifest.run, *manifest.position),
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
    stored: Mapping[str, StoredBlob],
    locked: Mapping[str, repository.Health],
    manifest: Manifest,
    actor: str,
    reason: str | None,
) -> None:
    """Mark the blobs found whole (those the store's checksum confirmed: hashed too) and the
    bundle complete, and move the run's head."""
    now = utcnow()
    repository.mark_verified(
        session,
        sizes={
            sha: size
            for sha, size in plan.sizes.items()
            if sha not in locked or not damage.trusted(locked[sha])
        },
        hashed={sha for sha, blob in stored.items() if blob.sha256_ok},
        at=now,
        locked=locked,
    )
    bundle.status = BundleStatus.COMPLETE
    bundle.committed_at = now
    bundle.manifest = manifest.model_dump(mode="json")
    events.record(session, bundle, actor=actor, action=Action.COMMITTED, reason=reason)
    run.head_bundle_id = lineage.head_after_commit(
        run.head_bundle_id, node(bundle), catalog_nodes(session)
    )
    context.metrics.committed.inc()
    context.metrics.committed_bytes.inc(sum(r.payload_bytes for r in plan.records.values()))
    log.info("run %s: bundle %d (step %d) complete", run.name, bundle.id, bundle.step)


def _committed(
    session: Session,
    bundle: Bundle,
    run: Run,
    *,
    recorded: Sequence[RecordedLayer] | None = None,
    manifest: Manifest | None = None,
) -> Committed:
    return Committed(
        bundle=bundle_out(session, bundle, run, recorded=recorded, manifest=manifest),
        head_id=run.head_bundle_id,
    )


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
        micro_step=bundle.micro_step,
        world_size=bundle.world_size,
        created_at=bundle.created_at.isoformat(),
        versions=Versions.model_validate(bundle.versions),
        ranks=tuple(RankRecord(rank=rank, layers=layers) for rank, layers in ranks.items()),
        catalog=CatalogRef(
            bundle_id=bundle.id,
            parent_id=bundle.parent_id,
            epoch=attempt.epoch if attempt else 0,
        ),
        imported=imported_of(bundle),
    )


def _check_pending(bundle: Bundle) -> None:
    if bundle.status != BundleStatus.PENDING:
        raise ConflictError(
            f"bundle {bundle.id} is {bundle.status}"
            + (f" ({bundle.reason})" if bundle.reason else "")
            + "; only a pending bundle can be committed"
        )
