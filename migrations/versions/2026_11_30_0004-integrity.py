"""Integrity after commit: blob damage, the bundle audit log, maintenance passes, token
expiry and dedup groups.

Revision ID: 2026_11_30_0004
Revises: 2026_11_29_0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_30_0004"
down_revision = "2026_11_29_0003"
branch_labels = None
depends_on = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    # Columns only are added to existing tables: SQLite adds them in place (a constraint
    # change would copy the table, and dropping the old copy cascades to its children).
    op.add_column("blob", sa.Column("damaged_at", TIMESTAMP, nullable=True))
    op.add_column("blob", sa.Column("damage", sa.String(length=16), nullable=True))
    op.add_column("token", sa.Column("expires_at", TIMESTAMP, nullable=True))
    op.add_column("run", sa.Column("dedup_group", sa.String(length=128), nullable=True))
    op.create_table(
        "bundle_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("bundle_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("at", TIMESTAMP, nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["bundle_id"],
            ["bundle.id"],
            name=op.f("fk_bundle_event_bundle_id_bundle"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f("fk_bundle_event_run_id_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bundle_event")),
    )
    op.create_index(
        op.f("ix_bundle_event_bundle_id_id"), "bundle_event", ["bundle_id", "id"], unique=False
    )
    op.create_index(
        op.f("ix_bundle_event_run_id_id"), "bundle_event", ["run_id", "id"], unique=False
    )
    op.create_table(
        "maintenance_pass",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task", sa.String(length=16), nullable=False),
        sa.Column("holder", sa.String(length=200), nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=False),
        sa.Column("ended_at", TIMESTAMP, nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_maintenance_pass")),
    )
    op.create_index(
        op.f("ix_maintenance_pass_task_started_at"),
        "maintenance_pass",
        ["task", "started_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_maintenance_pass_task_started_at"), table_name="maintenance_pass")
    op.drop_table("maintenance_pass")
    op.drop_index(op.f("ix_bundle_event_run_id_id"), table_name="bundle_event")
    op.drop_index(op.f("ix_bundle_event_bundle_id_id"), table_name="bundle_event")
    op.drop_table("bundle_event")
    op.drop_column("run", "dedup_group")
    op.drop_column("token", "expires_at")
    op.drop_column("blob", "damage")
    op.drop_column("blob", "damaged_at")
