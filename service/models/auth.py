"""The tables of access: bearer tokens (hashed) and their roles, and the dashboard's
sign-ins."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import CheckConstraint, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, choices


class Role(enum.StrEnum):
    ADMIN = "admin"
    RUN = "run"  # reads and writes one run
    READ = "read"  # reads every run


class Token(Base):
    __tablename__ = "token"
    __table_args__ = (CheckConstraint(choices("role", Role), name="role"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(8))
    run_name: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]  # None: never


class UISession(Base):
    """A sign-in to the dashboard: the browser holds a random id, the catalog its SHA-256.

    It lasts while its token does: ``token_id`` names the catalog token presented (None for
    the configured admin token, then ``token_hash`` must still be one of them)."""

    __tablename__ = "ui_session"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[int | None] = mapped_column(
        ForeignKey("token.id", ondelete="CASCADE"), index=True
    )
    token_hash: Mapped[str] = mapped_column(String(64))
    csrf: Mapped[str] = mapped_column(String(64))  # the forms' field must equal it
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime] = mapped_column(index=True)
