"""Bearer tokens: an admin token from configuration, and hashed tokens in the catalog.

admin  reads and writes everything, creates and revokes tokens
run    reads and writes one run (what a training job gets)
read   reads every run
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from ckpt.service.auth import repository
from ckpt.service.auth.schemas import TokenCreate, TokenCreated, TokenOut
from ckpt.service.context import Context
from ckpt.service.errors import ForbiddenError, NotFoundError, UnauthorizedError
from ckpt.service.models import Role, Token, utcnow
from ckpt.service.settings import new_token


@dataclass(frozen=True)
class Principal:
    """Who is calling: a role, and for run tokens the one run it may touch."""

    name: str
    role: Role
    run: str | None = None

    def may_read(self, run: str) -> bool:
        return self.role in (Role.ADMIN, Role.READ) or self.run == run

    def may_write(self, run: str) -> bool:
        return self.role is Role.ADMIN or (self.role is Role.RUN and self.run == run)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def authenticate(
    context: Context, *, authorization: str | None, admin_token: str | None
) -> Principal:
    """The principal behind an ``Authorization: Bearer ...`` header."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise UnauthorizedError(
            "send a bearer token: 'Authorization: Bearer <token>' (create one with "
            "'ckpt token create')"
        )
    token = token.strip()
    if admin_token is not None and hmac.compare_digest(token.encode(), admin_token.encode()):
        return Principal(name="admin", role=Role.ADMIN)
    with context.transaction() as session:
        found = repository.find_token(session, token_hash=hash_token(token))
        if found is None:
            raise UnauthorizedError("unknown or revoked token")
        return Principal(name=found.name, role=Role(found.role), run=found.run_name)


def require_read(principal: Principal, run: str) -> None:
    if not principal.may_read(run):
        raise ForbiddenError(f"token {principal.name!r} may not read run {run!r}")


def require_write(principal: Principal, run: str) -> None:
    if not principal.may_write(run):
        what = "is read-only" if principal.role is Role.READ else f"may not write run {run!r}"
        raise ForbiddenError(f"token {principal.name!r} {what}")


def require_writer(principal: Principal) -> None:
    """Any token that may write some run."""
    if principal.role is Role.READ:
        raise ForbiddenError(f"token {principal.name!r} is read-only")


def require_admin(principal: Principal) -> None:
    if principal.role is not Role.ADMIN:
        raise ForbiddenError(f"token {principal.name!r} is not an admin token")


def create_token(context: Context, request: TokenCreate) -> TokenCreated:
    secret = new_token()
    with context.transaction() as session:
        token = repository.add_token(
            session,
            name=request.name,
            token_hash=hash_token(secret),
            role=request.role,
            run_name=request.run,
        )
        return TokenCreated(**_out(token).model_dump(), token=secret)


def list_tokens(context: Context) -> list[TokenOut]:
    with context.transaction() as session:
        return [_out(token) for token in repository.list_tokens(session)]


def revoke_token(context: Context, *, token_id: int) -> TokenOut:
    with context.transaction() as session:
        token = repository.get_token(session, token_id=token_id)
        if token is None:
            raise NotFoundError(f"no token with id {token_id}")
        if token.revoked_at is None:
            token.revoked_at = utcnow()
        return _out(token)


def _out(token: Token) -> TokenOut:
    return TokenOut(
        id=token.id,
        name=token.name,
        role=Role(token.role),
        run=token.run_name,
        created_at=token.created_at,
        revoked_at=token.revoked_at,
    )
