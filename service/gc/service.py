"""Retention and garbage collection.

1. *Expire*: pending bundles older than the TTL fail.
2. *Retain*: per run, complete bundles outside its policy (keep the last N, every K-th
   step, pinned ones, the head, what the run resumes from, always the newest) are deleted:
   their manifest leaves the store, their rows stay for lineage. Quarantined bundles are
   kept by the same policy, applied to them apart.
3. *Mark and sweep*: blobs that no pending, complete or quarantined bundle references (a
   quarantine may be lifted) and whose grace period is over (since written, and since last
   recorded or reported present) are deleted from the store. Each is re-checked under its row lock just before it goes; recording a
   layer takes the same lock, so a blob that a save starts to use is never swept from under
   it, and a commit verifies presence after recording, so it can never complete a bundle
   with a blob that was swept.

A backlog (a policy set on runs of many bundles) is deleted in batches of at most
``CKPT_GC_BATCH_BUNDLES`` bundles, each its own short transaction that weighs its runs again:
no run stays locked, and no request waits, for more than one batch. ``/metrics`` shows the
progress: ``ckpt_gc_deleted_bundles_total`` batch by batch, ``ckpt_gc_backlog`` what the
batch's runs still hold to delete.

One pass runs at a time across replicas (``maintenance``), recorded in
``maintenance_pass``; each bundle a pass fails or deletes gets an audit event (actor
``gc``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel
from sqlalchemy.orm import Session

from ckpt.core.contract import Manifest
from ckpt.core.errors import StoreError
from ckpt.core.storage import StoredObject, keys
from service import retention
from service.context import Context
from service.errors import StoreUnavailableError
from service.events import repository as events_repository
from service.events.schemas import Action, System
from service.gc import repository
from service.maintenance.service import Task, exclusive
from service.models import BundleStatus, Run, utcnow
from service.retention import Kept
from service.settings import Settings

log = logging.getLogger("ckpt.gc")

_BLOB_PREFIX = "blobs/sha256/"
_BATCH = 200  # blobs swept at once (their rows locked meanwhile)
_AT_ONCE = 1000  # bundles whose status one statement changes
_RUNS_AT_ONCE = 100  # runs weighed together; see docs/performance.md#garbage-collection


class GcReport(BaseModel):
    dry_run: bool
    skipped: bool = False  # another process was collecting
    failed_bundles: list[int] = []
    deleted_bundles: list[int] = []
    deleted_blobs: int = 0
    deleted_bytes: int = 0
    young_blobs: int = 0  # unreferenced but inside their grace period

    @property
    def did_something(self) -> bool:
        """Whether the pass failed, deleted (or, dry, would delete) anything."""
        return bool(self.failed_bundles or self.deleted_bundles or self.deleted_blobs)


Progress = Callable[[], None]  # called after each batch of deletions, outside its transaction


def collect(
    context: Context,
    *,
    dry_run: bool = False,
    now: datetime | None = None,
    between_batches: Progress | None = None,
) -> GcReport:
    """One full pass of expire, retain and sweep; ``between_batches`` is called after each
    batch of deletions has committed (the metrics show it), before the next begins."""
    now = now or utcnow()
    report = GcReport(dry_run=dry_run)
    with exclusive(context, Task.GC) as current:
        if current is None:
            report.skipped = True
            return report
        report.failed_bundles = _expire(context, now=now, dry_run=dry_run)
        settings = context.settings
        server_policy = settings.keep_last is not None or settings.keep_every is not None
        # A policy keeps at least the newest max(keep_last, 1): runs with no more are skipped.
        server_keeps = max(settings.keep_last or 0, 1) if server_policy else None
        with context.transaction() as session:
            run_ids = repository.run_ids(session, server_keeps=server_keeps)
        for start in range(0, len(run_ids), _RUNS_AT_ONCE):
            batch = run_ids[start : start + _RUNS_AT_ONCE]
            report.deleted_bundles += _retain_all(
                context, batch, dry_run=dry_run, between_batches=between_batches
            )
        _sweep(context, report, now=now)
        current.outcome = report.model_dump_json()
    m = context.metrics
    if not dry_run:
        m.gc_deleted_blobs.inc(report.deleted_blobs)
        m.gc_deleted_bytes.inc(report.deleted_bytes)
    # An idle pass (every ten minutes by default) is not worth a line in the log.
    log.log(
        logging.INFO if report.did_something else logging.DEBUG, "gc: %s", report.model_dump_json()
    )
    return report


def _expire(context: Context, *, now: datetime, dry_run: bool) -> list[int]:
    """Fail the bundles still pending after the TTL; their ids."""
    ttl = timedelta(seconds=context.settings.pending_ttl_seconds)
    with context.transaction() as session:
        stale = repository.stale_pending(session, older_than=now - ttl, lock=not dry_run)
        if not dry_run:
            for start in range(0, len(stale), _AT_ONCE):
                _change(
                    session,
                    stale[start : start + _AT_ONCE],
                    status=BundleStatus.FAILED,
                    action=Action.FAILED,
                    reason="still pending after the TTL",
                )
        return stale


def _retain_all(
    context: Context, run_ids: list[int], *, dry_run: bool, between_batches: Progress | None
) -> list[int]:
    """``_retain`` these runs until their policies let nothing more go, in batches of at
    most ``CKPT_GC_BATCH_BUNDLES`` bundles: the ids deleted (or, dry, to delete).

    One dry weighing, its runs unlocked, groups the runs into batches; each batch then
    weighs its own runs again under their locks (a commit, a rollback or a pin may have
    come since), and a run holding more than a batch goes in several."""
    most = context.settings.gc_batch_bundles
    if dry_run:
        return _retain(context, run_ids, dry_run=True, most=most)[0]
    deleted: list[int] = []
    for group in _groups(context, run_ids, most=most):
        deleted += _delete_in_batches(context, group, most=most, between_batches=between_batches)
    return deleted


def _groups(context: Context, run_ids: list[int], *, most: int) -> list[list[int]]:
    """These runs in groups whose bundles to delete add up to at most ``most`` (a run with
    more is a group of its own); runs with none to delete are left out."""
    with context.transaction() as session:
        weighed = _weigh(context, session, run_ids, lock=False)
    counts = {run_id: len(ids) for run_id, ids in weighed.doomed.items()}
    groups: list[list[int]] = []
    size = most  # the current group is full: start one
    for run_id in (i for i in run_ids if counts.get(i)):
        if size + counts[run_id] > most:
            groups.append([])
            size = 0
        groups[-1].append(run_id)
        size += counts[run_id]
    return groups


def _delete_in_batches(
    context: Context, run_ids: list[int], *, most: int, between_batches: Progress | None
) -> list[int]:
    """Delete what these runs' policies let go, ``most`` at a time, each batch weighing
    them again: the ids."""
    metrics = context.metrics
    deleted: list[int] = []
    while True:
        done, left = _retain(context, run_ids, dry_run=False, most=most)
        deleted += done
        metrics.gc_backlog.set(left)
        if done:
            metrics.gc_deleted_bundles.inc(len(done))
            metrics.gc_batches.inc()
            if between_batches is not None:
                between_batches()
        if not left or not done:
            return deleted


def _retain(
    context: Context, run_ids: list[int], *, dry_run: bool, most: int
) -> tuple[list[int], int]:
    """Delete the complete bundles these runs' policies let go, and their quarantined ones
    the same policies, applied to them apart, let go, at most ``most`` of them: the ids,
    oldest first per run, and how many more they let go (dry: all of them, and 0).

    Three queries weigh the whole batch (its runs, locked; the bundle each resumes from;
    their bundles' columns): a transaction, a lock and a walk per run cost 5-7 ms each."""
    with context.transaction() as session:
        weighed = _weigh(context, session, run_ids, lock=not dry_run)
        runs, policies, kept, doomed = weighed.runs, weighed.policies, weighed.kept, weighed.doomed
        every = [bundle_id for ids in doomed.values() for bundle_id in ids]
        if dry_run:
            return every, 0
        now_ids = set(every[:most])
        positions = {b.id: (b.step, b.micro_step) for bundles in kept.values() for b in bundles}
        by_reason: dict[str, list[repository.Doomed]] = defaultdict(list)  # a reason per policy
        for run in runs:
            by_reason[f"retention ({policies[run.id]})"] += (
                repository.Doomed(i, run.id, *positions[i]) for i in doomed[run.id] if i in now_ids
            )
        names = {run.id: run.name for run in runs}
        for reason, bundles in by_reason.items():
            for start in range(0, len(bundles), _AT_ONCE):
                _delete(context, session, bundles[start : start + _AT_ONCE], reason, names)
        return every[:most], len(every) - len(now_ids)


@dataclass(frozen=True)
class _Weighed:
    """Runs, their policies, their bundles kept so far, and what the policies let go."""

    runs: list[Run]
    policies: dict[int, _Policy]
    kept: Mapping[tuple[int, str], Sequence[Kept]]
    doomed: dict[int, list[int]]


def _weigh(context: Context, session: Session, run_ids: list[int], *, lock: bool) -> _Weighed:
    """Three queries: the runs (locked if ``lock``), the bundle each resumes from, and
    their bundles' columns."""
    runs = repository.runs_by_id(session, ids=run_ids, lock=lock)
    starts = repository.resumable_ids(session, run_ids=run_ids)
    kept = repository.kept_in(session, run_ids=run_ids)
    policies = {run.id: _Policy.of(run, context.settings) for run in runs}
    doomed = {run.id: policies[run.id].doomed(run, kept, start=starts.get(run.id)) for run in runs}
    return _Weighed(runs=runs, policies=policies, kept=kept, doomed=doomed)


@dataclass(frozen=True)
class _Policy:
    """A run's retention: its own numbers, else the server's."""

    keep_last: int | None
    keep_every: int | None

    @classmethod
    def of(cls, run: Run, settings: Settings) -> _Policy:
        return cls(run.keep_last or settings.keep_last, run.keep_every or settings.keep_every)

    def __str__(self) -> str:
        return f"keep_last={self.keep_last}, keep_every={self.keep_every}"

    def doomed(
        self, run: Run, kept: Mapping[tuple[int, str], Sequence[Kept]], *, start: int | None
    ) -> list[int]:
        """What the policy lets go of ``run``'s ``kept`` bundles (``start``: the bundle the
        run resumes from, kept like the head)."""
        protected = {i for i in (run.head_bundle_id, start) if i}
        return [
            bundle_id
            for status in (BundleStatus.COMPLETE, BundleStatus.QUARANTINED)
            for bundle_id in retention.to_delete(
                kept.get((run.id, status), ()),
                keep_last=self.keep_last,
                keep_every=self.keep_every,
                protected=protected,
            )
        ]


def _delete(
    context: Context,
    session: Session,
    bundles: Sequence[repository.Doomed],
    reason: str,
    names: Mapping[int, str],
) -> None:
    """Delete these bundles of the runs ``names`` names: three statements however many, and
    their manifests from the store (on S3, one request per 1,000)."""
    _change(
        session,
        [b.id for b in bundles],
        status=BundleStatus.DELETED,
        action=Action.DELETED,
        reason=reason,
    )
    shared = repository.steps_shared(session, bundles=bundles)
    manifests = [(keys.manifest_key(names[b.run_id], b.step, b.micro_step), b) for b in bundles]
    context.store.delete_many(
        list(
            dict.fromkeys(  # two of these bundles may share a step, and a manifest
                key
                for key, b in manifests
                if (b.run_id, b.step) not in shared or _manifest_is(context, key, b.id)
            )
        )
    )


def _change(
    session: Session, ids: Sequence[int], *, status: BundleStatus, action: Action, reason: str
) -> None:
    """Give these bundles ``status``, with the audit event of each: two statements."""
    repository.set_status(session, ids=ids, status=status, reason=reason)
    events_repository.add_events(
        session, bundle_ids=ids, actor=System.GC, action=action, status=status, reason=reason
    )


def _manifest_is(context: Context, key: str, bundle_id: int) -> bool:
    """Whether the manifest at ``key`` is this bundle's (or unreadable: no bundle anyone can
    resume), rather than that of a later fork's bundle at the same step."""
    try:
        stored = Manifest.model_validate_json(context.store.get(key))
    except StoreError:
        return False  # already gone
    except ValueError:
        return True
    return stored.catalog is None or stored.catalog.bundle_id == bundle_id


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
        try:
            context.store.delete_many([keys.blob_key(sha) for sha in doomed])
        except StoreError as err:
            raise StoreUnavailableError(f"gc cannot delete blobs: {err}") from err
        report.deleted_blobs += len(doomed)
        report.deleted_bytes += sum(sizes[sha] for sha in doomed)
        repository.delete_blob_rows(session, shas=doomed)


def _sha(obj: StoredObject) -> str:
    return obj.key.rsplit("/", 1)[-1]


def _at(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)
