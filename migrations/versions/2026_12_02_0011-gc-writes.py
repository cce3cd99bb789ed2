"""Cheaper writes for garbage collection's deletions: the audit log keeps no foreign keys,
and only pending bundles are indexed by when they were opened.

Measured on a million-bundle catalog (docs/performance.md#garbage-collection): the two
foreign-key checks of each audit event cost three quarters of writing it (21 and 17 ms of
each 1,000 events' insert), and every status change of a bundle wrote an entry into the
``(status, created_at)`` index, which only the expiry of pending bundles reads. An event
is written in the transaction that makes the change it records, naming the row it changed;
nothing deletes bundles or runs, and an audit log that a hand-made deletion erased (the
keys' ``ON DELETE CASCADE``) would be no audit log.

Revision ID: 2026_12_02_0011
Revises: 2026_12_01_0010
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_02_0011"
down_revision = "2026_12_01_0010"
branch_labels = None
depends_on = None

PENDING = sa.text("status = 'pending'")


def upgrade() -> None:
    # On SQLite the foreign keys go with a copy of the table (nothing references
    # bundle_event, so dropping the old copy cascades nowhere).
    with op.batch_alter_table("bundle_event") as batch:
        batch.drop_constraint("fk_bundle_event_bundle_id_bundle", type_="foreignkey")
        batch.drop_constraint("fk_bundle_event_run_id_run", type_="foreignkey")
    op.drop_index("ix_bundle_status_created_at", table_name="bundle")
    op.create_index(
        "ix_bundle_pending_created_at",
        "bundle",
        ["created_at"],
        postgresql_where=PENDING,
        sqlite_where=PENDING,
    )


def downgrade() -> None:
    op.drop_index("ix_bundle_pending_created_at", table_name="bundle")
    op.create_index("ix_bundle_status_created_at", "bundle", ["status", "created_at"])
    with op.batch_alter_table("bundle_event") as batch:
        batch.create_foreign_key(
            "fk_bundle_event_bundle_id_bundle", "bundle", ["bundle_id"], ["id"], ondelete="CASCADE"
        )
        batch.create_foreign_key(
            "fk_bundle_event_run_id_run", "run", ["run_id"], ["id"], ondelete="CASCADE"
        )
