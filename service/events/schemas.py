from __future__ import annotations

import enum
from datetime import datetime

from pydantic import BaseModel, Field


class Action(enum.StrEnum):
    """What changed a bundle's state."""

    OPENED = "opened"
    COMMITTED = "committed"
    FAILED = "failed"
    QUARANTINED = "quarantined"
    UNQUARANTINED = "unquarantined"
    PINNED = "pinned"
    UNPINNED = "unpinned"
    DELETED = "deleted"


class System(enum.StrEnum):
    """Actors that are the control plane itself, not a token."""

    SCRUBBER = "scrubber"
    GC = "gc"
    REBUILD = "rebuild"


class EventOut(BaseModel):
    id: int
    bundle_id: int
    run: str
    at: datetime
    actor: str = Field(description='"admin", "token 3 (trainer)", "scrubber", "gc" or "rebuild"')
    action: Action
    status: str = Field(description="the bundle's status after the change")
    reason: str | None


class EventPage(BaseModel):
    events: list[EventOut]
    next: int | None = Field(description="pass as ?after= for the next page; null at the end")
