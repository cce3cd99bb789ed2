"""Attempts keep where their time went, as their agents report it with each heartbeat and
at the end: restart (process start to training), stall (waiting on saves), train, and the
steps trained (for the mean step time that prices the steps lost): goodput.

Revision ID: 2026_12_01_0010
Revises: 2026_12_01_0009
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_01_0010"
down_revision = "2026_12_01_0009"
branch_labels = None
depends_on = None

SECONDS = ("restart_seconds", "stall_seconds", "train_seconds")


def upgrade() -> None:
    # Plain ALTER TABLE on both databases (0009 says why not a batch copy).
    for column in SECONDS:
        op.add_column("attempt", sa.Column(column, sa.Float(), nullable=True))
    op.add_column("attempt", sa.Column("steps_trained", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for column in ("steps_trained", *reversed(SECONDS)):
        op.drop_column("attempt", column)
