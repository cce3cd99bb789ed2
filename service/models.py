"""The catalog's tables. Alembic migrations in ``migrations/`` create them; a test proves
that the migrations and these models agree.

    run ──< attempt ──< bundle ──< layer ──< layer_blob >── blob
             └──< attempt_rank (each rank's last heartbeat)
     │                    │ parent_id (lineage), run.head_bundle_id (the live branch's head)
     └──< rollback        ├ attempt.resumed_from_id (resume edges)
                          ├──< save (what each rank's save of it cost)
                          └──< bundle_event (the audit log: who changed its state, and why)
    token (hashed bearer tokens) ──< ui_session (the dashboard's sign-ins)
    maintenance_pass (each pass of garbage collection or the scrubber, by replica)
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every database (SQLite stores naive text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert value.tzinfo is not None, "timestamps must be timezone-aware"
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class BundleStatus(enum.StrEnum):
    PENDING = "pending"
    COMPLETE = "complete"
    FAILED = "failed"
    QUARANTINED = "quarantined"
    DELETED = "deleted"


class EndReason(enum.StrEnum):
    FINISHED = "finished"
    PREEMPTED = "preempted"
    FAILED = "failed"
    # The service's verdict, never reported: the heartbeats lapsed. The attempt may still
    # report its real end (a zombie, a partition), which replaces it.
    LOST = "lost"


class Role(enum.StrEnum):
    ADMIN = "admin"
    RUN = "run"  # reads and writes one run
    READ = "read"  # reads every run


# Bundles whose blobs garbage collection must keep.
LIVE_STATUSES = (BundleStatus.PENDING, BundleStatus.COMPLETE)


def _choices(column: str, values: type[enum.StrEnum]) -> str:
    return f"{column} IN ({', '.join(repr(str(v)) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime, int: Integer}


class Run(Base):
    __tablename__ = "run"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime]
    epoch: Mapped[int] = mapped_column(default=0)  # the current attempt's epoch
    head_bundle_id: Mapped[int | None] = mapped_column(
        ForeignKey("bundle.id", use_alter=True, ondelete="SET NULL")
    )
    keep_last: Mapped[int | None]
    keep_every: Mapped[int | None]
    # Runs of one group may share blobs they wrote (dedup); None: the run alone. Set by an admin.
    dedup_group: Mapped[str | None] = mapped_column(String(128))


# A run's state besides the end reasons of its newest attempt (RunActivity.state).
NEW = "new"  # no attempt has registered yet
TRAINING = "training"  # its newest attempt has not ended


class RunActivity(Base):
    """A run's state and last activity, as of its newest attempt (``new`` and its creation
    before any), and the figures of its attempts: what the runs page sorts, filters and
    shows, kept by every write to attempts (``runs.activity.refresh_activity``) so that a
    page of runs is a range of an index, not the newest attempt of every run, and a run of
    a thousand attempts costs no more to show than a run of one. A table of its own:
    heartbeats share-lock the run row, so writing it there would deadlock a heartbeat and an
    end of the same attempt."""

    __tablename__ = "run_activity"
    __table_args__ = (
        Index(None, "active_at", "run_id"),
        Index(None, "state", "active_at", "run_id"),
    )

    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    state: Mapped[str] = mapped_column(String(16))
    active_at: Mapped[datetime]
    attempts: Mapped[int] = mapped_column(default=0)
    preemptions: Mapped[int] = mapped_column(default=0)
    steps_lost: Mapped[int] = mapped_column(BigInteger, default=0)  # lineage.steps_lost, summed
    steps_computed: Mapped[int] = mapped_column(BigInteger, default=0)  # repeats included
    # What every attempt but the newest computed: a heartbeat adds the newest's own to it.
    earlier_steps_computed: Mapped[int] = mapped_column(BigInteger, default=0)
    bundles: Mapped[int] = mapped_column(default=0)  # rows in bundle, whatever their status
    writes: Mapped[int] = mapped_column(BigInteger, default=0)  # to its attempts: a version


class Attempt(Base):
    __tablename__ = "attempt"
    __table_args__ = (
        UniqueConstraint("run_id", "epoch"),
        # A pool's newest attempts, for its mean time between preemptions.
        Index("ix_attempt_pool_id", "pool", "id"),
        CheckConstraint(_choices("end_reason", EndReason), name="end_reason"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"))
    epoch: Mapped[int]
    pod: Mapped[str | None] = mapped_column(String(253))
    node: Mapped[str | None] = mapped_column(String(253))
    started_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime | None]
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    ended_at: Mapped[datetime | None]
    end_reason: Mapped[str | None] = mapped_column(String(16))
    final_save_committed: Mapped[bool | None] = mapped_column(Boolean)
    resumed_from_id: Mapped[int | None] = mapped_column(
        ForeignKey("bundle.id", use_alter=True, ondelete="SET NULL")
    )
    # The first notice of a coming preemption the attempt read from its cloud (its time,
    # and "aws instance-action: terminate at ...").
    notice_at: Mapped[datetime | None]
    notice: Mapped[str | None] = mapped_column(String(300))
    # The capacity pool it ran on (CKPT_POOL: "aws/us-east-1/p5.48xlarge"), whose history
    # of preemptions its run's save interval learns from; and, with CKPT_EVERY=auto, the
    # interval its agent chose and the waste per hour it expects there.
    pool: Mapped[str | None] = mapped_column(String(253))
    interval_seconds: Mapped[float | None] = mapped_column(Float)
    waste_seconds_per_hour: Mapped[float | None] = mapped_column(Float)
    # Where its time went, as its agent last reported (ckpt.core.goodput).
    restart_seconds: Mapped[float | None] = mapped_column(Float)
    stall_seconds: Mapped[float | None] = mapped_column(Float)
    train_seconds: Mapped[float | None] = mapped_column(Float)
    steps_trained: Mapped[int | None] = mapped_column(BigInteger)


class AttemptRank(Base):
    """One rank of an attempt of a job of many ranks, as its heartbeats show it: the
    attempt is lost as soon as any of its ranks goes silent."""

    __tablename__ = "attempt_rank"
    __table_args__ = (CheckConstraint("rank >= 0", name="rank"),)

    attempt_id: Mapped[int] = mapped_column(
        ForeignKey("attempt.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(primary_key=True)
    heartbeat_at: Mapped[datetime] = mapped_column(index=True)


class Bundle(Base):
    __tablename__ = "bundle"
    __table_args__ = (
        UniqueConstraint("attempt_id", "step"),
        CheckConstraint(_choices("status", BundleStatus), name="status"),
        CheckConstraint("step >= 0", name="step"),
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
    world_size: Mapped[int]
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)  # why it failed, was quarantined or deleted
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    committed_at: Mapped[datetime | None]
    versions: Mapped[dict[str, Any]] = mapped_column(JSON)  # of the writer (ckpt, python, torch)
    manifest: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # once complete


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


class Rollback(Base):
    __tablename__ = "rollback"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), index=True)
    from_bundle_id: Mapped[int | None] = mapped_column(ForeignKey("bundle.id", ondelete="SET NULL"))
    to_bundle_id: Mapped[int] = mapped_column(ForeignKey("bundle.id", ondelete="CASCADE"))
    epoch: Mapped[int]  # the run's epoch after the rollback (it fences every attempt)
    created_at: Mapped[datetime]


class Token(Base):
    __tablename__ = "token"
    __table_args__ = (CheckConstraint(_choices("role", Role), name="role"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(8))
    run_name: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]  # None: never


class UISession(Base):
    """A sign-in to the dashboard: the browser holds a random id, the catalog its SHA-256.

    It lasts while its token does: ``token_id`` names the catalog token presented (None for
    the configured admin token, then ``token_hash`` must still be one of them)."""

    __tablename__ = "ui_session"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[int | None] = mapped_column(
        ForeignKey("token.id", ondelete="CASCADE"), index=True
    )
    token_hash: Mapped[str] = mapped_column(String(64))
    csrf: Mapped[str] = mapped_column(String(64))  # the forms' field must equal it
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime] = mapped_column(index=True)


class BundleEvent(Base):
    """One change of a bundle's state: the audit log (who, what, when, why).

    Written in the transaction that makes the change, naming the bundle it changed and its
    run: no foreign keys, whose checks cost three quarters of writing an event (garbage
    collection writes hundreds of thousands at once) and whose cascade would erase the log
    of whatever someone deleted by hand (migration 2026_12_02_0011)."""

    __tablename__ = "bundle_event"
    __table_args__ = (Index(None, "bundle_id", "id"), Index(None, "run_id", "id"))

    id: Mapped[int] = mapped_column(primary_key=True)
    bundle_id: Mapped[int]
    run_id: Mapped[int]
    at: Mapped[datetime]
    actor: Mapped[str] = mapped_column(String(200))  # "token 3 (trainer)", "scrubber"...
    action: Mapped[str] = mapped_column(String(16))  # opened, committed, quarantined...
    status: Mapped[str] = mapped_column(String(16))  # the bundle's status after it
    reason: Mapped[str | None] = mapped_column(Text)


class MaintenancePass(Base):
    """One pass of a maintenance task (gc, scrub) by one replica: they never overlap."""

    __tablename__ = "maintenance_pass"
    __table_args__ = (Index(None, "task", "started_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    task: Mapped[str] = mapped_column(String(16))
    holder: Mapped[str] = mapped_column(String(200))  # the replica: host and pid
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    outcome: Mapped[str | None] = mapped_column(Text)  # a summary, or the error
