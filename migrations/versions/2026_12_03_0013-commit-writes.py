"""Cheaper commits on PostgreSQL: blob rows leave room for their commit's update, and the
manifest and layer records are compressed with LZ4 where the server has it.

A blob's row is inserted when a layer records it and updated once when its bundle commits
(``verified_at``). On full pages that update cannot stay on the row's page, so each one
also writes a new primary-key entry: with half of each page left free for it, it stays
(a heap-only tuple). A bundle's manifest (about 130 kB for 1,000 blobs) is written at
commit and read by every resume; LZ4 compresses and decompresses it several times faster
than PostgreSQL's default. SQLite has neither setting.

Revision ID: 2026_12_03_0013
Revises: 2026_12_02_0012
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_03_0013"
down_revision = "2026_12_02_0012"
branch_labels = None
depends_on = None

_COMPRESSED = (("bundle", "manifest"), ("layer", "record"))


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE blob SET (fillfactor = 50)")
    if _has_lz4(bind):
        for table, column in _COMPRESSED:
            op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} SET COMPRESSION lz4")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE blob RESET (fillfactor)")
    for table, column in _COMPRESSED:
        op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} SET COMPRESSION default")


def _has_lz4(bind: sa.Connection) -> bool:
    """Whether this server was built with LZ4 (PostgreSQL 14 and newer may be)."""
    choices = bind.execute(
        sa.text("SELECT enumvals FROM pg_settings WHERE name = 'default_toast_compression'")
    ).scalar()
    return choices is not None and "lz4" in choices
