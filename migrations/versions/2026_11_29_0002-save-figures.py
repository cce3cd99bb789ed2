"""Save figures: what each rank's save of a bundle cost (stall, persist time, bytes).

Revision ID: 2026_11_29_0002
Revises: 2026_11_29_0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_29_0002"
down_revision = "2026_11_29_0001"
branch_labels = None
depends_on = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "save",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("bundle_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("stall_seconds", sa.Float(), nullable=False),
        sa.Column("persist_seconds", sa.Float(), nullable=False),
        sa.Column("payload_bytes", sa.BigInteger(), nullable=False),
        sa.Column("new_bytes", sa.BigInteger(), nullable=False),
        sa.Column("reported_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint("rank >= 0", name=op.f("ck_save_rank")),
        sa.ForeignKeyConstraint(
            ["bundle_id"], ["bundle.id"], name=op.f("fk_save_bundle_id_bundle"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_save")),
        sa.UniqueConstraint("bundle_id", "rank", name=op.f("uq_save_bundle_id_rank")),
    )


def downgrade() -> None:
    op.drop_table("save")
