"""Attempts keep the first notice of a coming preemption they read from their cloud's
metadata service (AWS spot instance-action or rebalance recommendation, GCP preemption or
maintenance event, Azure Preempt event) and when it came; the capacity pool they ran on,
indexed with the id so that a pool's newest attempts are a range (its mean time between
preemptions); and the save interval their agent chose with ``CKPT_EVERY=auto``, with the
waste per hour it expects there.

Revision ID: 2026_12_01_0009
Revises: 2026_11_30_0008
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_01_0009"
down_revision = "2026_11_30_0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE on both databases (SQLite adds and drops columns in place since
    # 3.35): a batch copy of the attempt table would null bundle.attempt_id and delete the
    # attempt ranks (migration 0003 says why).
    op.add_column("attempt", sa.Column("notice_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("attempt", sa.Column("notice", sa.String(300), nullable=True))
    op.add_column("attempt", sa.Column("pool", sa.String(253), nullable=True))
    op.add_column("attempt", sa.Column("interval_seconds", sa.Float(), nullable=True))
    op.add_column("attempt", sa.Column("waste_seconds_per_hour", sa.Float(), nullable=True))
    op.create_index("ix_attempt_pool_id", "attempt", ["pool", "id"])


def downgrade() -> None:
    op.drop_index("ix_attempt_pool_id", table_name="attempt")
    for column in ("waste_seconds_per_hour", "interval_seconds", "pool", "notice", "notice_at"):
        op.drop_column("attempt", column)
