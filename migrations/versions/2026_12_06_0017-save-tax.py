"""The save tax among a rank's save figures.

A rank reports, beside its stall, the save tax: the extra wall-clock time the training loop
paid for the save, from ``save()`` until durable. It may be unknown (too few steps before the
save), and every save reported so far came without it: NULL. The run page's chart reads the
figures from ``ix_save_run_figures`` alone, so the index gets the column too.

Revision ID: 2026_12_06_0017
Revises: 2026_12_05_0016
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_06_0017"
down_revision = "2026_12_05_0016"
branch_labels = None
depends_on = None

FIGURES = ["run_id", "bundle_id", "stall_seconds", "persist_seconds", "payload_bytes", "new_bytes"]


def upgrade() -> None:
    with op.batch_alter_table("save") as batch:
        batch.add_column(sa.Column("tax_seconds", sa.Float(), nullable=True))
    op.drop_index("ix_save_run_figures", table_name="save")
    op.create_index("ix_save_run_figures", "save", [*FIGURES, "tax_seconds"])


def downgrade() -> None:
    op.drop_index("ix_save_run_figures", table_name="save")
    op.create_index("ix_save_run_figures", "save", FIGURES)
    with op.batch_alter_table("save") as batch:
        batch.drop_column("tax_seconds")
