from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckpt.service.models import Role
from ckpt.service.names import PRINTABLE, RunName


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role
    run: RunName | None = None
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=PRINTABLE)] = "token"

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


class TokenCreated(TokenOut):
    token: str  # shown once; the catalog keeps only its SHA-256
