"""The catalog: runs, attempts, bundles, layers, blobs, rollbacks and tokens.

Revision ID: 2026_11_29_0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_29_0001"
down_revision = None
branch_labels = None
depends_on = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "blob",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("claimed_at", TIMESTAMP, nullable=False),
        sa.Column("verified_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint("size >= 0", name=op.f("ck_blob_size")),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_blob")),
    )
    # run.head_bundle_id and attempt.resumed_from_id point at bundle, which points back at
    # both: those two foreign keys are added once bundle exists.
    op.create_table(
        "run",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("head_bundle_id", sa.Integer(), nullable=True),
        sa.Column("keep_last", sa.Integer(), nullable=True),
        sa.Column("keep_every", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run")),
        sa.UniqueConstraint("name", name=op.f("uq_run_name")),
    )
    op.create_table(
        "token",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=8), nullable=False),
        sa.Column("run_name", sa.String(length=128), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint("role IN ('admin', 'run', 'read')", name=op.f("ck_token_role")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_token")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_token_token_hash")),
    )
    op.create_table(
        "attempt",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("pod", sa.String(length=253), nullable=True),
        sa.Column("node", sa.String(length=253), nullable=True),
        sa.Column("started_at", TIMESTAMP, nullable=False),
        sa.Column("heartbeat_at", TIMESTAMP, nullable=True),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("ended_at", TIMESTAMP, nullable=True),
        sa.Column("end_reason", sa.String(length=16), nullable=True),
        sa.Column("final_save_committed", sa.Boolean(), nullable=True),
        sa.Column("resumed_from_id", sa.Integer(), nullable=True),
        sa.CheckConstraint(
            "end_reason IN ('finished', 'preempted', 'failed')",
            name=op.f("ck_attempt_end_reason"),
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f("fk_attempt_run_id_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempt")),
        sa.UniqueConstraint("run_id", "epoch", name=op.f("uq_attempt_run_id_epoch")),
    )
    op.create_table(
        "bundle",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=True),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("committed_at", TIMESTAMP, nullable=True),
        sa.Column("versions", sa.JSON(), nullable=False),
        sa.Column("manifest", sa.JSON(), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'complete', 'failed', 'quarantined', 'deleted')",
            name=op.f("ck_bundle_status"),
        ),
        sa.CheckConstraint("step >= 0", name=op.f("ck_bundle_step")),
        sa.CheckConstraint("world_size >= 1", name=op.f("ck_bundle_world_size")),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempt.id"],
            name=op.f("fk_bundle_attempt_id_attempt"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["bundle.id"],
            name=op.f("fk_bundle_parent_id_bundle"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f("fk_bundle_run_id_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bundle")),
        sa.UniqueConstraint("attempt_id", "step", name=op.f("uq_bundle_attempt_id_step")),
    )
    op.create_index(
        op.f("ix_bundle_run_id_status_step"), "bundle", ["run_id", "status", "step"], unique=False
    )
    with op.batch_alter_table("run") as batch:
        batch.create_foreign_key(
            batch.f("fk_run_head_bundle_id_bundle"),
            "bundle",
            ["head_bundle_id"],
            ["id"],
            ondelete="SET NULL",
        )
    with op.batch_alter_table("attempt") as batch:
        batch.create_foreign_key(
            batch.f("fk_attempt_resumed_from_id_bundle"),
            "bundle",
            ["resumed_from_id"],
            ["id"],
            ondelete="SET NULL",
        )
    op.create_table(
        "layer",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("bundle_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("layer", sa.String(length=16), nullable=False),
        sa.Column("payload_bytes", sa.BigInteger(), nullable=False),
        sa.Column("record", sa.JSON(), nullable=False),
        sa.Column("recorded_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint("rank >= 0", name=op.f("ck_layer_rank")),
        sa.ForeignKeyConstraint(
            ["bundle_id"], ["bundle.id"], name=op.f("fk_layer_bundle_id_bundle"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_layer")),
        sa.UniqueConstraint(
            "bundle_id", "rank", "layer", name=op.f("uq_layer_bundle_id_rank_layer")
        ),
    )
    op.create_table(
        "rollback",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("from_bundle_id", sa.Integer(), nullable=True),
        sa.Column("to_bundle_id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["from_bundle_id"],
            ["bundle.id"],
            name=op.f("fk_rollback_from_bundle_id_bundle"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f("fk_rollback_run_id_run"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["to_bundle_id"],
            ["bundle.id"],
            name=op.f("fk_rollback_to_bundle_id_bundle"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollback")),
    )
    op.create_index(op.f("ix_rollback_run_id"), "rollback", ["run_id"], unique=False)
    op.create_table(
        "layer_blob",
        sa.Column("layer_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("blob_sha256", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["layer_id"],
            ["layer.id"],
            name=op.f("fk_layer_blob_layer_id_layer"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("layer_id", "seq", name=op.f("pk_layer_blob")),
    )
    op.create_index(op.f("ix_layer_blob_blob_sha256"), "layer_blob", ["blob_sha256"], unique=False)


def downgrade() -> None:
    op.drop_table("layer_blob")
    op.drop_table("rollback")
    op.drop_table("layer")
    with op.batch_alter_table("attempt") as batch:
        batch.drop_constraint(batch.f("fk_attempt_resumed_from_id_bundle"), type_="foreignkey")
    with op.batch_alter_table("run") as batch:
        batch.drop_constraint(batch.f("fk_run_head_bundle_id_bundle"), type_="foreignkey")
    op.drop_table("bundle")
    op.drop_table("attempt")
    op.drop_table("token")
    op.drop_table("run")
    op.drop_table("blob")
