"""Attempt ranks: the last heartbeat of each rank of an attempt of many ranks.

Revision ID: 2026_11_30_0005
Revises: 2026_11_30_0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_30_0005"
down_revision = "2026_11_30_0004"
branch_labels = None
depends_on = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "attempt_rank",
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("heartbeat_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint("rank >= 0", name=op.f("ck_attempt_rank_rank")),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempt.id"],
            name=op.f("fk_attempt_rank_attempt_id_attempt"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("attempt_id", "rank", name=op.f("pk_attempt_rank")),
    )
    op.create_index(
        op.f("ix_attempt_rank_heartbeat_at"), "attempt_rank", ["heartbeat_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_attempt_rank_heartbeat_at"), table_name="attempt_rank")
    op.drop_table("attempt_rank")
