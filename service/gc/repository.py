from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from datetime import datetime
from typing import NamedTuple, cast

from sqlalchemy import DateTime, Table, delete, func, or_, select, type_coerce, update
from sqlalchemy.orm import Session

from service.models import LIVE_STATUSES, Blob, Bundle, BundleStatus, Layer, LayerBlob, Run
from service.retention import Kept
from service.runs.repository import resumable_walk
from service.sql import ids_in, insert


def stale_pending(session: Session, *, older_than: datetime, lock: bool) -> list[int]:
    """The pending bundles opened before ``older_than``, by id (``lock``: locked for update;
    those another transaction holds are left for the next pass).

    Sorted here, not by the query: SQLite would rather walk the whole table in id order
    than read the partial index of pending bundles and sort."""
    query = select(Bundle.id).where(
        Bundle.status == BundleStatus.PENDING, Bundle.created_at < older_than
    )
    if lock:
        query = query.with_for_update(skip_locked=True)
    return sorted(session.scalars(query))


def run_ids(session: Session, *, server_keeps: int | None) -> list[int]:
    """The runs retention visits, by id: those with a retention policy of their own and,
    with a server-wide policy that always keeps the newest ``server_keeps`` bundles, those
    with more complete (or more quarantined) bundles than that; any other run keeps
    everything."""
    own = or_(Run.keep_last.is_not(None), Run.keep_every.is_not(None))
    if server_keeps is not None:
        crowded = (
            select(Bundle.run_id)
            .where(Bundle.status.in_((BundleStatus.COMPLETE, BundleStatus.QUARANTINED)))
            .group_by(Bundle.run_id, Bundle.status)
            .having(func.count() > server_keeps)
        )
        own = or_(own, Run.id.in_(crowded))
    return list(session.scalars(select(Run.id).where(own).order_by(Run.id)))


def runs_by_id(session: Session, *, ids: Collection[int], lock: bool) -> list[Run]:
    """These runs, by id (``lock``: locked for update, in id order; those another
    transaction holds, such as a commit, are left for the next pass)."""
    query = select(Run).where(Run.id.in_(sorted(ids))).order_by(Run.id)
    if lock:
        query = query.with_for_update(skip_locked=True)
    return list(session.scalars(query))


def resumable_ids(session: Session, *, run_ids: Collection[int]) -> dict[int, int]:
    """The bundle each of these runs resumes from (``lineage.resumable``), by run id: one
    recursive query for all of them."""
    walk = resumable_walk()
    rows = session.execute(
        select(walk.c.run_id, walk.c.id).where(walk.c.status == BundleStatus.COMPLETE),
        {"run_ids": sorted(run_ids)},
    )
    return {run_id: bundle_id for run_id, bundle_id in rows}


# Bundles whose blobs garbage collection keeps: the live ones, and quarantined ones (an
# admin may lift the quarantine; retention deletes them like complete ones).
KEPT_STATUSES = (*LIVE_STATUSES, BundleStatus.QUARANTINED)


def kept_in(session: Session, *, run_ids: Collection[int]) -> dict[tuple[int, str], list[Kept]]:
    """These runs' complete and quarantined bundles as retention sees them (the columns it
    needs only), by run id and status.

    A Core statement on the session's connection, its rows fetched at once, its times as
    the driver returns them (retention only compares them with each other): at a million
    bundles the ORM's loading, a fetch per row and a conversion of each time to UTC cost
    twice the query."""
    committed_at = type_coerce(
        func.coalesce(Bundle.committed_at, Bundle.created_at), DateTime(timezone=True)
    )
    rows = session.connection().execute(
        select(
            Bundle.run_id,
            Bundle.status,
            Bundle.id,
            Bundle.step,
            committed_at,
            Bundle.pinned,
            Bundle.micro_step,
        ).where(
            ids_in(session, Bundle.run_id, run_ids),
            Bundle.status.in_((BundleStatus.COMPLETE, BundleStatus.QUARANTINED)),
        )
    )
    found: dict[tuple[int, str], list[Kept]] = defaultdict(list)
    for run_id, status, bundle_id, step, at, pinned, micro_step in rows.all():
        found[run_id, status].append(Kept(bundle_id, step, at, pinned, micro_step))
    return found


class Doomed(NamedTuple):
    """A bundle retention deletes, as its deletion needs it."""

    id: int
    run_id: int
    step: int
    micro_step: int


def set_status(
    session: Session, *, ids: Collection[int], status: BundleStatus, reason: str
) -> None:
    """Give these bundles ``status`` for ``reason`` (a Core statement: the ORM's bulk path
    cost more than the update)."""
    table = cast(Table, Bundle.__table__)
    session.execute(
        update(table).where(ids_in(session, table.c.id, ids)).values(status=status, reason=reason)
    )


def steps_shared(session: Session, *, bundles: Collection[Doomed]) -> set[tuple[int, int]]:
    """The runs' steps of these bundles that another bundle of the same run also has (a fork
    saved the step again, or two of these share it, or another micro step of it): their
    manifest may be another bundle's. Counted by the database, which answers with those few
    steps only."""
    pairs = {(b.run_id, b.step) for b in bundles}
    rows = session.execute(
        select(Bundle.run_id, Bundle.step)
        .where(
            ids_in(session, Bundle.run_id, {run_id for run_id, _ in pairs}),
            ids_in(session, Bundle.step, {step for _, step in pairs}),
        )
        .group_by(Bundle.run_id, Bundle.step)
        .having(func.count() > 1)
    )
    return {(run_id, step) for run_id, step in rows if (run_id, step) in pairs}


def live_references(session: Session, *, shas: Collection[str] | None = None) -> set[str]:
    """Blobs referenced by a pending, complete or quarantined bundle (of these, when given)."""
    query = (
        select(LayerBlob.blob_sha256)
        .join(Layer, Layer.id == LayerBlob.layer_id)
        .join(Bundle, Bundle.id == Layer.bundle_id)
        .where(Bundle.status.in_(KEPT_STATUSES))
        .distinct()
    )
    if shas is not None:
        query = query.where(LayerBlob.blob_sha256.in_(sorted(shas)))
    return set(session.scalars(query))


def lock_blobs(
    session: Session, *, sizes: dict[str, int], first_seen: dict[str, datetime]
) -> dict[str, Blob]:
    """Catalog rows for these blobs (inserted if absent), locked; rows another transaction
    holds are skipped (a record or commit is using them)."""
    statement = insert(session, Blob).values(
        [
            {
                "sha256": sha,
                "size": sizes[sha],
                "created_at": first_seen[sha],
                "claimed_at": first_seen[sha],
            }
            for sha in sorted(sizes)
        ]
    )
    session.execute(statement.on_conflict_do_nothing(index_elements=["sha256"]))
    rows = session.scalars(
        select(Blob)
        .where(Blob.sha256.in_(sorted(sizes)))
        .order_by(Blob.sha256)
        .with_for_update(skip_locked=True)
    )
    return {row.sha256: row for row in rows}


def delete_blob_rows(session: Session, *, shas: Collection[str]) -> None:
    if shas:
        session.execute(delete(Blob).where(Blob.sha256.in_(sorted(shas))))


def orphan_blob_rows(session: Session, *, claimed_before: datetime) -> list[Blob]:
    """Catalog blobs no kept bundle references whose grace period is over."""
    live = (
        select(LayerBlob.blob_sha256)
        .join(Layer, Layer.id == LayerBlob.layer_id)
        .join(Bundle, Bundle.id == Layer.bundle_id)
        .where(Bundle.status.in_(KEPT_STATUSES))
    )
    return list(
        session.scalars(
            select(Blob)
            .where(Blob.claimed_at < claimed_before, Blob.sha256.not_in(live))
            .order_by(Blob.sha256)
            .with_for_update(skip_locked=True)  # rows a record or commit holds stay
        )
    )


def claimed_at(session: Session, *, shas: Collection[str]) -> dict[str, datetime]:
    rows = session.execute(
        select(Blob.sha256, Blob.claimed_at).where(Blob.sha256.in_(sorted(shas)))
    )
    return {sha: at for sha, at in rows}
