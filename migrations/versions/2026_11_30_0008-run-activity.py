"""Each run's state, last activity and attempt figures in a table of their own, kept by
every write to attempts and indexed, so that the runs page reads a page of runs off an
index instead of finding the newest attempt of every run to sort them, and the figures of
a run of many attempts cost one row. The index on each run's save figures takes the bundle
id after the run, so that the run page's chart of its newest bundles is a range of it.
Blobs get ``hashed_at``: a commit confirms a blob's size (and the store's checksum where it
keeps one) without reading its bytes; the scrubber's read-back hashes them later.

Revision ID: 2026_11_30_0008
Revises: 2026_11_30_0007
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_30_0008"
down_revision = "2026_11_30_0007"
branch_labels = None
depends_on = None

TIMESTAMP = sa.DateTime(timezone=True)

# Each run's newest attempt and the figures of all its attempts, as
# runs.repository.refresh_activity keeps them.
BACKFILL = """
WITH per_attempt AS (
    SELECT attempt.run_id, attempt.end_reason, attempt.last_step,
           coalesce(resumed.step, 0) AS start,
           lead(coalesce(resumed.step, 0)) OVER runs AS next_start,
           lead(attempt.epoch) OVER runs AS next_epoch
    FROM attempt LEFT JOIN bundle AS resumed ON resumed.id = attempt.resumed_from_id
    WINDOW runs AS (PARTITION BY attempt.run_id ORDER BY attempt.epoch)
), computed AS (
    SELECT per_attempt.*,
           CASE WHEN coalesce(last_step, start) > start
                THEN coalesce(last_step, start) - start ELSE 0 END AS steps
    FROM per_attempt
), figures AS (
    SELECT run_id, count(*) AS attempts,
           sum(CASE WHEN end_reason = 'preempted' THEN 1 ELSE 0 END) AS preemptions,
           sum(CASE WHEN end_reason IS NOT NULL AND end_reason <> 'finished'
                         AND last_step IS NOT NULL AND next_epoch IS NOT NULL
                         AND last_step > next_start
                    THEN last_step - next_start ELSE 0 END) AS steps_lost,
           sum(steps) AS steps_computed,
           sum(CASE WHEN next_epoch IS NOT NULL THEN steps ELSE 0 END) AS earlier
    FROM computed GROUP BY run_id
)
INSERT INTO run_activity (run_id, state, active_at, attempts, preemptions, steps_lost,
                          steps_computed, earlier_steps_computed, bundles, writes)
SELECT run.id,
       CASE WHEN newest.id IS NULL THEN 'new'
            WHEN newest.ended_at IS NULL THEN 'training'
            ELSE newest.end_reason END,
       coalesce(newest.ended_at, newest.heartbeat_at, newest.started_at, run.created_at),
       coalesce(figures.attempts, 0), coalesce(figures.preemptions, 0),
       coalesce(figures.steps_lost, 0), coalesce(figures.steps_computed, 0),
       coalesce(figures.earlier, 0),
       (SELECT count(*) FROM bundle WHERE bundle.run_id = run.id),
       0
FROM run
LEFT JOIN attempt AS newest ON newest.id = (
    SELECT attempt.id FROM attempt WHERE attempt.run_id = run.id
    ORDER BY attempt.epoch DESC LIMIT 1
)
LEFT JOIN figures ON figures.run_id = run.id
"""


def upgrade() -> None:
    op.create_table(
        "run_activity",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("active_at", TIMESTAMP, nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("preemptions", sa.Integer(), nullable=False),
        sa.Column("steps_lost", sa.BigInteger(), nullable=False),
        sa.Column("steps_computed", sa.BigInteger(), nullable=False),
        sa.Column("earlier_steps_computed", sa.BigInteger(), nullable=False),
        sa.Column("bundles", sa.Integer(), nullable=False),
        sa.Column("writes", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f("fk_run_activity_run_id_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_run_activity")),
    )
    op.create_index(
        op.f("ix_run_activity_active_at_run_id"), "run_activity", ["active_at", "run_id"]
    )
    op.create_index(
        op.f("ix_run_activity_state_active_at_run_id"),
        "run_activity",
        ["state", "active_at", "run_id"],
    )
    op.execute(BACKFILL)
    op.create_index(
        "ix_save_run_figures",
        "save",
        ["run_id", "bundle_id", "stall_seconds", "persist_seconds", "payload_bytes", "new_bytes"],
    )
    op.drop_index("ix_save_run_id_payload_bytes_new_bytes", table_name="save")
    # A commit checks sizes now, not bytes: what was verified so far was read back whole.
    with op.batch_alter_table("blob") as batch:
        batch.add_column(sa.Column("hashed_at", TIMESTAMP, nullable=True))
    op.execute("UPDATE blob SET hashed_at = verified_at")
    # Garbage collection fails the bundles pending for too long: a range of this index,
    # where the index on (run_id, status, step) was scanned whole.
    op.create_index(op.f("ix_bundle_status_created_at"), "bundle", ["status", "created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_bundle_status_created_at"), table_name="bundle")
    with op.batch_alter_table("blob") as batch:
        batch.drop_column("hashed_at")
    op.create_index(
        "ix_save_run_id_payload_bytes_new_bytes", "save", ["run_id", "payload_bytes", "new_bytes"]
    )
    op.drop_index("ix_save_run_figures", table_name="save")
    op.drop_table("run_activity")
