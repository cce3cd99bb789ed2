"""A bundle is named by its training position: (step, micro step).

A save in the middle of a gradient accumulation (micro step > 0) of a step saved already
is a new bundle, so one attempt may keep several bundles of a step: the uniqueness of a
bundle becomes (attempt, step, micro step). Every existing bundle was saved at micro step
0, the server default.

Revision ID: 2026_12_04_0014
Revises: 2026_12_03_0013
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_04_0014"
down_revision = "2026_12_03_0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("bundle") as batch:
        batch.add_column(
            sa.Column("micro_step", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch.create_check_constraint("micro_step", "micro_step >= 0")
        batch.drop_constraint("uq_bundle_attempt_id_step", type_="unique")
        batch.create_unique_constraint(
            "uq_bundle_attempt_id_step_micro_step", ["attempt_id", "step", "micro_step"]
        )


def downgrade() -> None:
    later = op.get_bind().execute(sa.text("SELECT count(*) FROM bundle WHERE micro_step > 0"))
    if later.scalar():
        raise RuntimeError(
            "bundles saved at a micro step > 0 exist: before 2026_12_04_0014 a run kept one "
            "bundle per attempt and step. Delete them (ckpt bundle) to downgrade"
        )
    with op.batch_alter_table("bundle") as batch:
        batch.drop_constraint("uq_bundle_attempt_id_step_micro_step", type_="unique")
        batch.create_unique_constraint("uq_bundle_attempt_id_step", ["attempt_id", "step"])
        batch.drop_constraint(batch.f("ck_bundle_micro_step"), type_="check")
        batch.drop_column("micro_step")
