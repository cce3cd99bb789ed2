"""Fingerprints: what each rank of an attempt computed at each step (the loss, digests of
its state), for the attempt that resumes before those steps to replay and compare; and
that attempt's verdict on its resume (attempt.verification).

Revision ID: 2026_12_05_0015
Revises: 2026_12_04_0014
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_05_0015"
down_revision = "2026_12_04_0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fingerprint",
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("micro_step", sa.BigInteger(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("parts", sa.JSON(), nullable=False),
        sa.CheckConstraint("rank >= 0", name=op.f("ck_fingerprint_rank")),
        sa.CheckConstraint("step >= 0 AND micro_step >= 0", name=op.f("ck_fingerprint_position")),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempt.id"],
            name=op.f("fk_fingerprint_attempt_id_attempt"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "attempt_id", "rank", "step", "micro_step", name=op.f("pk_fingerprint")
        ),
    )
    op.add_column("attempt", sa.Column("verification", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("attempt", "verification")
    op.drop_table("fingerprint")
