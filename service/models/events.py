"""The table of the audit log: one row per change of a bundle's state."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base


class BundleEvent(Base):
    """One change of a bundle's state: the audit log (who, what, when, why).

    Written in the transaction that makes the change, naming the bundle it changed and its
    run: no foreign keys, whose checks cost three quarters of writing an event (garbage
    collection writes hundreds of thousands at once) and whose cascade would erase the log
    of whatever someone deleted by hand (migration 2026_12_02_0011)."""

    __tablename__ = "bundle_event"
    __table_args__ = (Index(None, "bundle_id", "id"), Index(None, "run_id", "id"))

    id: Mapped[int] = mapped_column(primary_key=True)
    bundle_id: Mapped[int]
    run_id: Mapped[int]
    at: Mapped[datetime]
    actor: Mapped[str] = mapped_column(String(200))  # "token 3 (trainer)", "scrubber"...
    action: Mapped[str] = mapped_column(String(16))  # opened, committed, quarantined...
    status: Mapped[str] = mapped_column(String(16))  # the bundle's status after it
    reason: Mapped[str | None] = mapped_column(Text)
