"""Lost attempts: an attempt whose heartbeats lapsed ends with the reason 'lost'.

Revision ID: 2026_11_29_0003
Revises: 2026_11_29_0002
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from alembic import op

revision = "2026_11_29_0003"
down_revision = "2026_11_29_0002"
branch_labels = None
depends_on = None

REASONS = ("finished", "preempted", "failed")


def upgrade() -> None:
    _allow_end_reasons((*REASONS, "lost"))


def downgrade() -> None:
    # The old schema has no 'lost': an attempt that went silent counts as failed there.
    op.execute("UPDATE attempt SET end_reason = 'failed' WHERE end_reason = 'lost'")
    _allow_end_reasons(REASONS)


def _allow_end_reasons(reasons: tuple[str, ...]) -> None:
    with _bundle_attempts_kept(), op.batch_alter_table("attempt") as batch:
        batch.drop_constraint(batch.f("ck_attempt_end_reason"), type_="check")
        batch.create_check_constraint(
            batch.f("ck_attempt_end_reason"),
            f"end_reason IN ({', '.join(repr(reason) for reason in reasons)})",
        )


@contextmanager
def _bundle_attempts_kept() -> Iterator[None]:
    """Put back ``bundle.attempt_id`` after SQLite copies the attempt table.

    SQLite changes a constraint by copying the table and dropping the old one. The
    migration runs inside a transaction, where foreign keys cannot be switched off, so the
    drop deletes every attempt row first and ``ON DELETE SET NULL`` empties
    ``bundle.attempt_id``. Postgres alters the constraint in place.
    """
    if op.get_bind().dialect.name != "sqlite":
        yield
        return
    op.execute(
        "CREATE TEMPORARY TABLE _bundle_attempt AS "
        "SELECT id, attempt_id FROM bundle WHERE attempt_id IS NOT NULL"
    )
    yield
    op.execute(
        "UPDATE bundle SET attempt_id = "
        "(SELECT attempt_id FROM _bundle_attempt WHERE _bundle_attempt.id = bundle.id) "
        "WHERE id IN (SELECT id FROM _bundle_attempt)"
    )
    op.execute("DROP TABLE _bundle_attempt")
