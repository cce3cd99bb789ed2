"""Dashboard sign-ins: one row per session, by the SHA-256 of the browser's random id; and
an index holding each save's figures, so that the dashboard sums them from the index alone.

Revision ID: 2026_11_30_0006
Revises: 2026_11_30_0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_30_0006"
down_revision = "2026_11_30_0005"
branch_labels = None
depends_on = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "ui_session",
        sa.Column("id_hash", sa.String(length=64), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=True),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("csrf", sa.String(length=64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["token.id"],
            name=op.f("fk_ui_session_token_id_token"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id_hash", name=op.f("pk_ui_session")),
    )
    op.create_index(op.f("ix_ui_session_token_id"), "ui_session", ["token_id"], unique=False)
    op.create_index(op.f("ix_ui_session_expires_at"), "ui_session", ["expires_at"], unique=False)
    op.create_index(
        "ix_save_figures",
        "save",
        ["bundle_id", "stall_seconds", "persist_seconds", "payload_bytes", "new_bytes"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_save_figures", table_name="save")
    op.drop_index(op.f("ix_ui_session_expires_at"), table_name="ui_session")
    op.drop_index(op.f("ix_ui_session_token_id"), table_name="ui_session")
    op.drop_table("ui_session")
