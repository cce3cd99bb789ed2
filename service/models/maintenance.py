"""The table of maintenance passes (garbage collection, the scrubber), by replica."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base


class MaintenancePass(Base):
    """One pass of a maintenance task (gc, scrub) by one replica: they never overlap."""

    __tablename__ = "maintenance_pass"
    __table_args__ = (Index(None, "task", "started_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    task: Mapped[str] = mapped_column(String(16))
    holder: Mapped[str] = mapped_column(String(200))  # the replica: host and pid
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    outcome: Mapped[str | None] = mapped_column(Text)  # a summary, or the error
