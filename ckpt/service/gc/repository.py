from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

from sqlalchemy import delete, func, or_, select
from sqlalchemy.orm import Session

from ckpt.service.models import LIVE_STATUSES, Blob, Bundle, BundleStatus, Layer, LayerBlob, Run
from ckpt.service.retention import Kept
from ckpt.service.sql import insert


def stale_pending(session: Session, *, older_than: datetime, lock: bool) -> list[Bundle]:
    """Pending bundles opened before ``older_than``, by id (``lock``: locked for update;
    those another transaction holds are left for the next pass)."""
    query = (
        select(Bundle)
        .where(Bundle.status == BundleStatus.PENDING, Bundle.created_at < older_than)
        .order_by(Bundle.id)
    )
    if lock:
        query = query.with_for_update(skip_locked=True)
    return list(session.scalars(query))


def run_names(session: Session, *, server_keeps: int | None) -> list[str]:
    """The runs retention visits: those with a retention policy of their own and, with a
    server-wide policy that always keeps the newest ``server_keeps`` bundles, those with
    more complete (or more quarantined) bundles than that; any other run keeps everything.
    """
    own = or_(Run.keep_last.is_not(None), Run.keep_every.is_not(None))
    if server_keeps is not None:
        crowded = (
            select(Bundle.run_id)
            .where(Bundle.status.in_((BundleStatus.COMPLETE, BundleStatus.QUARANTINED)))
            .group_by(Bundle.run_id, Bundle.status)
            .having(func.count() > server_keeps)
        )
        own = or_(own, Run.id.in_(crowded))
    return list(session.scalars(select(Run.name).where(own).order_by(Run.name)))


# Bundles whose blobs garbage collection keeps: the live ones, and quarantined ones (an
# admin may lift the quarantine; retention deletes them like complete ones).
KEPT_STATUSES = (*LIVE_STATUSES, BundleStatus.QUARANTINED)


def kept_in(session: Session, *, run_id: int, status: str) -> list[Kept]:
    """The run's bundles in ``status``, as retention sees them (the columns it needs only)."""
    rows = session.execute(
        select(
            Bundle.id,
            Bundle.step,
            func.coalesce(Bundle.committed_at, Bundle.created_at),
            Bundle.pinned,
        ).where(Bundle.run_id == run_id, Bundle.status == status)
    )
    return [Kept(*row) for row in rows]


def bundles_by_id(session: Session, *, ids: Collection[int]) -> list[Bundle]:
    return list(session.scalars(select(Bundle).where(Bundle.id.in_(sorted(ids)))))


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
