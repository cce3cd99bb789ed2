"""A run's bundles in id order, for a page of its lineage: ``bundle (run_id, id)``.

A page asks for a run's newest bundles below an id (``ORDER BY id DESC LIMIT n``). No
index gave a run's bundles in id order, so PostgreSQL walked the primary key back from the
newest bundle of the whole catalog, skipping other runs' rows: cheap for the run that saved
last, and for a run of 10,000 bundles that newer ones had followed, 990,000 rows skipped
and 1.47 s for one page of a 1,000,000-bundle catalog (``bench/scale.py`` prints the plans).

Revision ID: 2026_12_02_0012
Revises: 2026_12_02_0011
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "2026_12_02_0012"
down_revision = "2026_12_02_0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_bundle_run_id_id", "bundle", ["run_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_bundle_run_id_id", table_name="bundle")
