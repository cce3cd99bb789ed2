"""``ckpt catalog rebuild``: recreate the catalog from the manifests in the store.

A manifest is a bundle's commit record, so the store alone says which bundles exist. For
each manifest whose run has no bundle at that step, a bundle is added: complete if the store
holds every blob it lists with the right size (hashes are checked on restore) and the
catalog knows none of them damaged, failed otherwise; each gets an audit event (actor
``rebuild``). Parent edges come from the manifest's catalog reference when it has one, else
from the previous step; the head moves to the newest complete bundle. Each rebuilt manifest
is rewritten with its new catalog id. Attempts are not in the store and are not recreated.
Running it twice adds nothing the second time.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import UTC, datetime

from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session

from ckpt.core.contract import CatalogRef, Manifest
from ckpt.core.errors import StoreError
from ckpt.core.storage import keys
from service.bundles import layers, repository
from service.context import Context
from service.errors import StoreUnavailableError
from service.events import service as events
from service.events.schemas import Action, System
from service.models import Bundle, BundleStatus, Run, utcnow
from service.runs import repository as runs_repository

log = logging.getLogger("ckpt.rebuild")


class RebuildReport(BaseModel):
    runs: int = 0
    added: list[str] = []  # "run@step"
    failed: list[str] = []  # added as failed: blobs missing from the store
    skipped: int = 0  # already in the catalog
    unreadable: list[str] = []  # manifest keys that did not parse


def rebuild(context: Context) -> RebuildReport:
    report = RebuildReport()
    by_run: dict[str, list[Manifest]] = defaultdict(list)
    try:
        found = [
            o.key
            for o in context.store.list_objects("runs/")
            if keys.manifest_position(o.key) is not None
        ]
        for key in found:
            try:
                manifest = Manifest.model_validate_json(context.store.get(key))
            except (ValidationError, ValueError) as err:
                log.warning("skipping %s: %s", key, err)
                report.unreadable.append(key)
                continue
            by_run[manifest.run].append(manifest)
    except StoreError as err:
        raise StoreUnavailableError(f"cannot read the store: {err}") from err
    for run, manifests in sorted(by_run.items()):
        report.runs += 1
        _rebuild_run(context, run, sorted(manifests, key=lambda m: m.position), report)
    return report


def _rebuild_run(
    context: Context, name: str, manifests: list[Manifest], report: RebuildReport
) -> None:
    with context.transaction() as session:
        run, _ = runs_repository.ensure_run(session, name=name)
        present = repository.run_positions(session, run_id=run.id, statuses=list(BundleStatus))
        new_ids: dict[int, int] = {}  # the manifest's catalog id -> the rebuilt bundle's id
        previous: int | None = None
        newest = None
        for manifest in manifests:
            if manifest.position in present:
                report.skipped += 1
                previous = present[manifest.position].id
                continue
            complete = _blobs_present(context, manifest) and not _damaged(session, manifest)
            ref = manifest.catalog
            parent = new_ids.get(ref.parent_id, previous) if ref and ref.parent_id else previous
            bundle = _add_bundle(session, run, manifest, parent=parent, complete=complete)
            if ref:
                new_ids[ref.bundle_id] = bundle.id
            _renumber(context, session_bundle=bundle, manifest=manifest, parent=parent)
            label = f"{name}@{manifest.step}" + (
                f".{manifest.micro_step}" if manifest.micro_step else ""
            )
            (report.added if complete else report.failed).append(label)
            previous = bundle.id
            if complete:
                newest = bundle
        if newest is not None:
            head = session.get(type(newest), run.head_bundle_id) if run.head_bundle_id else None
            if head is None or (head.step, head.micro_step) < (newest.step, newest.micro_step):
                run.head_bundle_id = newest.id


def _add_bundle(
    session: Session, run: Run, manifest: Manifest, *, parent: int | None, complete: bool
) -> Bundle:
    """The manifest's bundle and its layers, as they were recorded; its blobs claimed."""
    bundle = repository.add_bundle(
        session,
        run_id=run.id,
        attempt_id=None,
        parent_id=parent,
        step=manifest.step,
        micro_step=manifest.micro_step,
        world_size=manifest.world_size,
        status=BundleStatus.COMPLETE if complete else BundleStatus.FAILED,
        reason=None if complete else "rebuilt: blobs missing from the store, or damaged",
        committed_at=_parse(manifest.created_at),
        versions=manifest.versions.model_dump(mode="json"),
        manifest=manifest.model_dump(mode="json"),
        imported=manifest.imported.model_dump(mode="json") if manifest.imported else None,
    )
    action = Action.COMMITTED if complete else Action.FAILED
    events.record(session, bundle, actor=System.REBUILD, action=action, reason=bundle.reason)
    for record in manifest.ranks:
        for layer, layer_record in record.layers.items():
            repository.claim_blobs(session, sizes={b.sha256: b.size for b in layer_record.blobs})
            layers.insert_layer(
                session,
                bundle_id=bundle.id,
                rank=record.rank,
                layer=layer,
                new=layers.NewLayer(
                    payload_bytes=layer_record.payload_bytes,
                    record=layer_record.model_dump(mode="json"),
                    blobs=[b.sha256 for b in layer_record.blobs],
                ),
            )
    return bundle


def _renumber(
    context: Context, *, session_bundle: Bundle, manifest: Manifest, parent: int | None
) -> None:
    """Point the manifest (in the catalog and the store) at its new catalog id, so that
    retention later recognizes the store's manifest as this bundle's."""
    epoch = manifest.catalog.epoch if manifest.catalog else 0
    renumbered = manifest.model_copy(
        update={"catalog": CatalogRef(bundle_id=session_bundle.id, parent_id=parent, epoch=epoch)}
    )
    session_bundle.manifest = renumbered.model_dump(mode="json")
    context.store.put(
        keys.manifest_key(manifest.run, *manifest.position),
        [renumbered.model_dump_json(indent=1).encode()],
    )


def _blobs_present(context: Context, manifest: Manifest) -> bool:
    blobs = {
        b.sha256: b.size for r in manifest.ranks for rec in r.layers.values() for b in rec.blobs
    }
    return all(context.store.size(keys.blob_key(sha)) == size for sha, size in blobs.items())


def _damaged(session: Session, manifest: Manifest) -> bool:
    """Whether the catalog knows a blob of the manifest to be damaged."""
    shas = {b.sha256 for r in manifest.ranks for rec in r.layers.values() for b in rec.blobs}
    known = repository.blobs_by_sha(session, shas=shas)
    return any(blob.damaged_at is not None for blob in known.values())


def _parse(timestamp: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(timestamp)
    except ValueError:
        return utcnow()
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
