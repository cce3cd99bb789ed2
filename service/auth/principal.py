"""Who is calling, as every service function is told."""

from __future__ import annotations

from dataclasses import dataclass

from service.models import Role


@dataclass(frozen=True)
class Principal:
    """Who is calling: a role, for run tokens the one run it may touch, and for catalog
    tokens their id (None for the configured admin token)."""

    name: str
    role: Role
    run: str | None = None
    token_id: int | None = None

    @property
    def actor(self) -> str:
        """Who did it, as the audit log names it: ``admin`` or ``token 3 (trainer)``."""
        return "admin" if self.token_id is None else f"token {self.token_id} ({self.name})"

    def may_read(self, run: str) -> bool:
        return self.role in (Role.ADMIN, Role.READ) or self.run == run

    def may_write(self, run: str) -> bool:
        return self.role is Role.ADMIN or (self.role is Role.RUN and self.run == run)
