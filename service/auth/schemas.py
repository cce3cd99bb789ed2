from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.models import Role
from service.names import Label, RunName

MAX_EXPIRY_SECONDS = 10 * 366 * 86400  # ten years


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role
    run: RunName | None = None
    name: Label = "token"
    expires_in_seconds: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_EXPIRY_SECONDS,
            strict=True,
            description="the token is refused (401) this many seconds from now; null: never",
        ),
    ] = None

    @model_validator(mode="after")
    def _run_matches_role(self) -> TokenCreate:
        if (self.role is Role.RUN) != (self.run is not None):
            raise ValueError("a 'run' token needs run=<name>; 'admin' and 'read' tokens take none")
        return self


class TokenOut(BaseModel):
    id: int
    name: str
    role: Role
    run: str | None
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None = Field(
        default=None, description="refused from then on; null: never"
    )


class TokenCreated(TokenOut):
    token: str  # shown once; the catalog keeps only its SHA-256
