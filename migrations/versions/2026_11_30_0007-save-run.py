"""Each save names its bundle's run, and an index holds each run's bytes, so that the
dashboard sums the bytes of a page of runs from that index alone (no join through bundle).

Revision ID: 2026_11_30_0007
Revises: 2026_11_30_0006
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_30_0007"
down_revision = "2026_11_30_0006"
branch_labels = None
depends_on = None

INDEX = "ix_save_run_id_payload_bytes_new_bytes"


def upgrade() -> None:
    # Nullable first, filled from each save's bundle, then required. (SQLite copies the
    # table to make it NOT NULL and add the foreign key: nothing references save, so the
    # copy loses nothing.)
    with op.batch_alter_table("save") as batch:
        batch.add_column(sa.Column("run_id", sa.Integer(), nullable=True))
    op.execute(
        "UPDATE save SET run_id = (SELECT bundle.run_id FROM bundle WHERE bundle.id = save.bundle_id)"
    )
    with op.batch_alter_table("save") as batch:
        batch.alter_column("run_id", existing_type=sa.Integer(), nullable=False)
        batch.create_foreign_key(
            batch.f("fk_save_run_id_run"), "run", ["run_id"], ["id"], ondelete="CASCADE"
        )
    op.create_index(INDEX, "save", ["run_id", "payload_bytes", "new_bytes"], unique=False)


def downgrade() -> None:
    op.drop_index(INDEX, table_name="save")
    with op.batch_alter_table("save") as batch:
        batch.drop_constraint(batch.f("fk_save_run_id_run"), type_="foreignkey")
        batch.drop_column("run_id")
