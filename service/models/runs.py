"""The tables of runs: the run, its derived ``run_activity``, its attempts, their ranks and
the fingerprints of their steps, and its rollbacks; and the end reasons of an attempt."""

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
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, choices


class EndReason(enum.StrEnum):
    FINISHED = "finished"
    PREEMPTED = "preempted"
    FAILED = "failed"
    # The service's verdict, never reported: the heartbeats lapsed. The attempt may still
    # report its real end (a zombie, a partition), which replaces it.
    LOST = "lost"


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
        CheckConstraint(choices("end_reason", EndReason), name="end_reason"),
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
    # Whether its resume replayed the steps its predecessor computed bit for bit, as its
    # rank 0 reported (runs.schemas.Verification); None: not reported.
    verification: Mapped[dict[str, Any] | None] = mapped_column(JSON)


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


class Fingerprint(Base):
    """What one rank of an attempt computed at one training position (step, micro step):
    the loss it reported and digests of its state, opaque here. An attempt that resumes
    before that position replays it and compares; a ring keeps each (attempt, rank)'s
    newest ``CKPT_FINGERPRINT_RING``."""

    __tablename__ = "fingerprint"
    __table_args__ = (
        CheckConstraint("rank >= 0", name="rank"),
        CheckConstraint("step >= 0 AND micro_step >= 0", name="position"),
    )

    attempt_id: Mapped[int] = mapped_column(
        ForeignKey("attempt.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    micro_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    loss: Mapped[float | None] = mapped_column(Float)
    parts: Mapped[dict[str, str]] = mapped_column(JSON)


class Rollback(Base):
    __tablename__ = "rollback"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), index=True)
    from_bundle_id: Mapped[int | None] = mapped_column(ForeignKey("bundle.id", ondelete="SET NULL"))
    to_bundle_id: Mapped[int] = mapped_column(ForeignKey("bundle.id", ondelete="CASCADE"))
    epoch: Mapped[int]  # the run's epoch after the rollback (it fences every attempt)
    created_at: Mapped[datetime]
