"""The tables of bundles and what they hold: the bundle, its layers (one per rank and
layer), what each rank's save of it cost, and the blobs its layers reference; and a bundle's
statuses."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, choices


class BundleStatus(enum.StrEnum):
    PENDING = "pending"
    COMPLETE = "complete"
    FAILED = "failed"
    QUARANTINED = "quarantined"
    DELETED = "deleted"


# Bundles whose blobs garbage collection must keep.
LIVE_STATUSES = (BundleStatus.PENDING, BundleStatus.COMPLETE)


class Bundle(Base):
    __tablename__ = "bundle"
    __table_args__ = (
        UniqueConstraint("attempt_id", "step", "micro_step"),  # a bundle is a position
        CheckConstraint(choices("status", BundleStatus), name="status"),
        CheckConstraint("step >= 0", name="step"),
        CheckConstraint("micro_step >= 0", name="micro_step"),
        CheckConstraint("world_size >= 1", name="world_size"),
        Index(None, "run_id", "status", "step"),
        Index(None, "run_id", "id"),  # a page of a run's lineage: its bundles in id order
        # Garbage collection's expiry of pending bundles, which alone read it: a bundle's
        # entry goes once it leaves pending, so no later change of its status writes here.
        Index(
            "ix_bundle_pending_created_at",
            "created_at",
            postgresql_where=text("status = 'pending'"),
            sqlite_where=text("status = 'pending'"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"))
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempt.id", ondelete="SET NULL"))
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("bundle.id", ondelete="SET NULL"))
    step: Mapped[int] = mapped_column(BigInteger)
    # Which micro-batch of the step's gradient accumulation it was saved at (0: the start).
    micro_step: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    world_size: Mapped[int]
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)  # why it failed, was quarantined or deleted
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    committed_at: Mapped[datetime | None]
    versions: Mapped[dict[str, Any]] = mapped_column(JSON)  # of the writer (ckpt, python, torch)
    manifest: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # once complete
    # Made by ``ckpt import`` (format, source, the layers accepted as missing); None for a save.
    imported: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Layer(Base):
    __tablename__ = "layer"
    __table_args__ = (
        UniqueConstraint("bundle_id", "rank", "layer"),
        CheckConstraint("rank >= 0", name="rank"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    bundle_id: Mapped[int] = mapped_column(ForeignKey("bundle.id", ondelete="CASCADE"))
    rank: Mapped[int]
    layer: Mapped[str] = mapped_column(String(16))
    payload_bytes: Mapped[int] = mapped_column(BigInteger)
    record: Mapped[dict[str, Any]] = mapped_column(JSON)  # the LayerRecord, as sent
    recorded_at: Mapped[datetime]


class Save(Base):
    """What one rank's save of a bundle cost, as the rank reported it (the last report wins)."""

    __tablename__ = "save"
    __table_args__ = (
        UniqueConstraint("bundle_id", "rank"),
        CheckConstraint("rank >= 0", name="rank"),
        # The dashboard sums the figures of many bundles: read from the index alone.
        Index(
            "ix_save_figures",
            "bundle_id",
            "stall_seconds",
            "persist_seconds",
            "payload_bytes",
            "new_bytes",
        ),
        # And the bytes of whole runs, and the figures of a run's newest bundles (the run
        # page's chart: a range of bundle ids), from this one alone (no join through bundle).
        Index(
            "ix_save_run_figures",
            "run_id",
            "bundle_id",
            "stall_seconds",
            "persist_seconds",
            "payload_bytes",
            "new_bytes",
            "tax_seconds",
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    bundle_id: Mapped[int] = mapped_column(ForeignKey("bundle.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"))  # the bundle's
    rank: Mapped[int]
    stall_seconds: Mapped[float] = mapped_column(Float)  # training waited this long
    persist_seconds: Mapped[float] = mapped_column(Float)  # end of staging to the commit
    payload_bytes: Mapped[int] = mapped_column(BigInteger)
    new_bytes: Mapped[int] = mapped_column(BigInteger)  # uploaded; the rest was in the store
    # The save tax: the loop's extra wall-clock time from save() until durable (the stall
    # included). None: the rank did not know it (too few steps before the save).
    tax_seconds: Mapped[float | None] = mapped_column(Float)
    reported_at: Mapped[datetime]


class LayerBlob(Base):
    """Which blobs a layer references, in payload order (what GC marks from)."""

    __tablename__ = "layer_blob"

    layer_id: Mapped[int] = mapped_column(
        ForeignKey("layer.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(primary_key=True)
    blob_sha256: Mapped[str] = mapped_column(String(64), index=True)


class Blob(Base):
    # On PostgreSQL its pages are half full (fillfactor 50, migration 2026_12_03_0013): a
    # row is updated once, by its bundle's commit, and the new version then fits its page.
    __tablename__ = "blob"
    __table_args__ = (CheckConstraint("size >= 0", name="size"),)

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime]
    claimed_at: Mapped[datetime]  # last recorded or reported present: GC's grace starts here
    # The service found it whole: present with its size, at a commit (and, where the store
    # keeps a checksum, with that), or read back intact. What "seen whole since" means.
    verified_at: Mapped[datetime | None]
    # Its bytes were last seen to hash to its name: read back (the scrubber, a lifted
    # quarantine) or by the store's checksum of the upload. None: size-checked only so far.
    hashed_at: Mapped[datetime | None]
    # Found missing or damaged (by the scrubber, a restore, a commit) and not written intact
    # since: never counted as held, and every complete bundle that uses it is quarantined.
    damaged_at: Mapped[datetime | None]
    damage: Mapped[str | None] = mapped_column(String(16))  # a completeness.BlobProblem
