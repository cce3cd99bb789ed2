"""Bundles made by ``ckpt import``: where they came from and the layers they lack.

A bundle imported from another tool's checkpoint records its format, its source and the
layers the user accepted as missing (``--accept-missing``); such a bundle commits without
those layers and is shown as *imported, partial*. Every existing bundle was made by a save:
NULL.

Revision ID: 2026_12_05_0016
Revises: 2026_12_05_0015
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_05_0016"
down_revision = "2026_12_05_0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("bundle") as batch:
        batch.add_column(sa.Column("imported", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("bundle") as batch:
        batch.drop_column("imported")
