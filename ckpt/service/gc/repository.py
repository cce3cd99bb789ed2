from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from ckpt.service.models import LIVE_STATUSES, Blob, Bundle, BundleStatus, Layer, LayerBlob, Run
from ckpt.service.sql import insert


def expire_pending(session: Session, *, older_than: datetime, dry_run: bool) -> list[int]:
    """Pending bundles opened before ``older_than``: marked failed (unless ``dry_run``)."""
    ids = list(
        session.scalars(
            select(Bundle.id).where(
                Bundle.status == BundleStatus.PENDING, Bundle.created_at < older_than
            )
        )
    )
    if ids and not dry_run:
        session.execute(
            update(Bundle)
            .where(Bundle.id.in_(ids), Bundle.status == BundleStatus.PENDING)
            .values(status=BundleStatus.FAILED, reason="still pending after the TTL")
        )
    return ids


def run_names(session: Session) -> list[str]:
    return list(session.scalars(select(Run.name).order_by(Run.name)))


def complete_bundles(session: Session, *, run_id: int) -> list[Bundle]:
    return list(
        session.scalars(
            select(Bundle).where(Bundle.run_id == run_id, Bundle.status == BundleStatus.COMPLETE)
        )
    )


def live_references(session: Session, *, shas: Collection[str] | None = None) -> set[str]:
    """Blobs referenced by a pending or complete bundle (of these, when given)."""
    query = (
        select(LayerBlob.blob_sha256)
        .join(Layer, Layer.id == LayerBlob.layer_id)
        .join(Bundle, Bundle.id == Layer.bundle_id)
        .where(Bundle.status.in_(LIVE_STATUSES))
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
    """Catalog blobs no live bundle references whose grace period is over."""
    live = (
        select(LayerBlob.blob_sha256)
        .join(Layer, Layer.id == LayerBlob.layer_id)
        .join(Bundle, Bundle.id == Layer.bundle_id)
        .where(Bundle.status.in_(LIVE_STATUSES))
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
