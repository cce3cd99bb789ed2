"""Retention and garbage collection.

1. *Expire*: pending bundles older than the TTL fail.
2. *Retain*: per run, complete bundles outside its policy (keep the last N, every K-th
   step, pinned ones, the head, what the run resumes from, always the newest) are deleted:
   their manifest leaves the store, their rows stay for lineage.
3. *Mark and sweep*: blobs that no pending or complete bundle references and whose grace
   period is over (since written, and since last recorded or reported present) are deleted
   from the store. Each is re-checked under its row lock just before it goes; recording a
   layer takes the same lock, so a blob that a save starts to use is never swept from under
   it, and a commit verifies presence after recording, so it can never complete a bundle
   with a blob that was swept.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel
from sqlalchemy import text

from ckpt.core.contract import Manifest
from ckpt.core.errors import StoreError
from ckpt.core.storage import StoredObject, keys
from ckpt.service import retention
from ckpt.service.context import Context
from ckpt.service.errors import StoreUnavailableError
from ckpt.service.gc import repository
from ckpt.service.models import Bundle, BundleStatus, utcnow
from ckpt.service.runs import repository as runs_repository
from ckpt.service.runs.service import resumable_bundle
from ckpt.service.sql import Lock

log = logging.getLogger("ckpt.gc")

_BLOB_PREFIX = "blobs/sha256/"
_BATCH = 200
_LOCK_KEY = 0x636B7067  # "ckpg": one collector at a time across replicas


class GcReport(BaseModel):
    dry_run: bool
    skipped: bool = False  # another process was collecting
    failed_bundles: list[int] = []
    deleted_bundles: list[int] = []
    deleted_blobs: int = 0
    deleted_bytes: int = 0
    young_blobs: int = 0  # unreferenced but inside their grace period


def collect(context: Context, *, dry_run: bool = False, now: datetime | None = None) -> GcReport:
    """One full pass of expire, retain and sweep."""
    now = now or utcnow()
    report = GcReport(dry_run=dry_run)
    with _exclusive(context) as acquired:
        if not acquired:
            report.skipped = True
            return report
        settings = context.settings
        with context.transaction() as session:
            report.failed_bundles = repository.expire_pending(
                session,
                older_than=now - timedelta(seconds=settings.pending_ttl_seconds),
                dry_run=dry_run,
            )
        with context.transaction() as session:
            names = repository.run_names(session)
        for name in names:
            report.deleted_bundles += _retain(context, name, dry_run=dry_run)
        _sweep(context, report, now=now)
    m = context.metrics
    if not dry_run:
        m.gc_deleted_blobs.inc(report.deleted_blobs)
        m.gc_deleted_bytes.inc(report.deleted_bytes)
        m.gc_deleted_bundles.inc(len(report.deleted_bundles))
    log.info("gc: %s", report.model_dump_json())
    return report


def _retain(context: Context, name: str, *, dry_run: bool) -> list[int]:
    settings = context.settings
    with context.transaction() as session:
        run = runs_repository.get_run(session, name=name, lock=Lock.UPDATE)
        assert run is not None
        keep_last = run.keep_last or settings.keep_last
        keep_every = run.keep_every or settings.keep_every
        complete = repository.complete_bundles(session, run_id=run.id)
        start = resumable_bundle(session, run)
        protected = {i for i in (run.head_bundle_id, start.id if start else None) if i}
        doomed = retention.to_delete(
            [
                retention.Kept(b.id, b.step, b.committed_at or b.created_at, b.pinned)
                for b in complete
            ],
            keep_last=keep_last,
            keep_every=keep_every,
            protected=protected,
        )
        if dry_run:
            return doomed
        by_id = {b.id: b for b in complete}
        for bundle_id in doomed:
            bundle = by_id[bundle_id]
            bundle.status = BundleStatus.DELETED
            bundle.reason = f"retention (keep_last={keep_last}, keep_every={keep_every})"
            _delete_manifest(context, name, bundle)
        return doomed


def _delete_manifest(context: Context, run: str, bundle: Bundle) -> None:
    """Remove the bundle's manifest from the store, unless a later fork's bundle at the same
    step has replaced it."""
    key = keys.manifest_key(run, bundle.step)
    try:
        stored = Manifest.model_validate_json(context.store.get(key))
    except StoreError:
        return  # already gone
    except ValueError:
        stored = None  # unreadable: not a bundle anyone can resume; remove it
    if stored is None or stored.catalog is None or stored.catalog.bundle_id == bundle.id:
        context.store.delete(key)


def _sweep(context: Context, report: GcReport, *, now: datetime) -> None:
    grace = timedelta(seconds=context.settings.blob_grace_seconds)
    try:
        stored = list(context.store.list_objects(_BLOB_PREFIX))
    except StoreError as err:
        raise StoreUnavailableError(f"gc cannot list the store: {err}") from err
    with context.transaction() as session:
        live = repository.live_references(session)
    candidates = [obj for obj in stored if _sha(obj) not in live]
    old = [obj for obj in candidates if _at(obj.modified) < now - grace]
    report.young_blobs = len(candidates) - len(old)
    for start in range(0, len(old), _BATCH):
        _sweep_batch(context, report, old[start : start + _BATCH], now=now, grace=grace)
    if not report.dry_run:
        with context.transaction() as session:
            orphans = repository.orphan_blob_rows(session, claimed_before=now - grace)
            held = {_sha(obj) for obj in stored}
            repository.delete_blob_rows(
                session, shas=[b.sha256 for b in orphans if b.sha256 not in held]
            )


def _sweep_batch(
    context: Context,
    report: GcReport,
    batch: list[StoredObject],
    *,
    now: datetime,
    grace: timedelta,
) -> None:
    sizes = {_sha(obj): obj.size for obj in batch}
    first_seen = {_sha(obj): _at(obj.modified) for obj in batch}
    with context.transaction() as session:
        if report.dry_run:
            claimed = repository.claimed_at(session, shas=sizes)
        else:
            rows = repository.lock_blobs(session, sizes=sizes, first_seen=first_seen)
            claimed = {sha: row.claimed_at for sha, row in rows.items()}
        # Rows another transaction holds were skipped: those blobs are in use, not candidates.
        candidates = list(sizes) if report.dry_run else list(claimed)
        used = repository.live_references(session, shas=candidates)
        unused = [sha for sha in candidates if sha not in used]
        doomed = [sha for sha in unused if claimed.get(sha, first_seen[sha]) < now - grace]
        report.young_blobs += len(unused) - len(doomed)
        if report.dry_run:
            report.deleted_blobs += len(doomed)
            report.deleted_bytes += sum(sizes[sha] for sha in doomed)
            return
        for sha in doomed:
            try:
                context.store.delete(keys.blob_key(sha))
            except StoreError as err:
                raise StoreUnavailableError(f"gc cannot delete blob {sha}: {err}") from err
            report.deleted_blobs += 1
            report.deleted_bytes += sizes[sha]
        repository.delete_blob_rows(session, shas=doomed)


def _sha(obj: StoredObject) -> str:
    return obj.key.rsplit("/", 1)[-1]


def _at(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)


@contextmanager
def _exclusive(context: Context) -> Iterator[bool]:
    """Hold the collector's lock: a Postgres advisory lock (SQLite has one process)."""
    if context.engine.dialect.name != "postgresql":
        yield True
        return
    with context.engine.connect() as connection:
        acquired = bool(
            connection.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": _LOCK_KEY}).scalar()
        )
        connection.commit()
        try:
            yield acquired
        finally:
            if acquired:
                connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _LOCK_KEY})
                connection.commit()
