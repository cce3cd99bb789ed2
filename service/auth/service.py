"""Bearer tokens: an admin token from configuration, and hashed tokens in the catalog.

admin  reads and writes everything, creates and revokes tokens
run    reads and writes one run (what a training job gets)
read   reads every run

A catalog token may expire (``expires_at``); the configured admin token may be several, all
valid at once, so that it can be rotated without downtime.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from service.auth import repository
from service.auth.principal import Principal
from service.auth.repository import TokenRow
from service.auth.schemas import TokenCreate, TokenCreated, TokenOut
from service.context import Context
from service.errors import ForbiddenError, NotFoundError, UnauthorizedError
from service.models import Role, Token, utcnow
from service.settings import new_token


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def authenticate(
    context: Context, *, authorization: str | None, admin_tokens: Sequence[str]
) -> Principal:
    """The principal behind an ``Authorization: Bearer ...`` header: one of the configured
    ``admin_tokens``, or an unexpired token of the catalog (``context.tokens`` keeps those
    seen lately: ``service.auth.cache``)."""
    return Bearer(context, authorization, admin_tokens).principal()


@dataclass
class Bearer:
    """A request's bearer token, checked when asked: ``cached`` without reading the catalog
    (an admin token, a token the cache keeps), ``read`` by reading it. Work that checks the
    token in a statement of its own (a heartbeat's, ``runs.beats``) takes ``token_hash`` and
    ``remember``s the token's row, as ``read`` does."""

    context: Context
    authorization: str | None
    admin_tokens: Sequence[str]

    @functools.cached_property
    def token(self) -> str:
        scheme, _, token = (self.authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise UnauthorizedError(
                "send a bearer token: 'Authorization: Bearer <token>' (create one with "
                "'ckpt token create')"
            )
        return token.strip()

    @functools.cached_property
    def token_hash(self) -> str:
        return hash_token(self.token)

    def principal(self) -> Principal:
        """The principal behind the token: kept, or read."""
        return self.cached() or self.read()

    def cached(self) -> Principal | None:
        """The principal if it takes no read of the catalog; None if it does."""
        if _is_admin(self.token, self.admin_tokens):
            return Principal(name="admin", role=Role.ADMIN)
        return self.context.tokens.get(self.token_hash)

    def read(self) -> Principal:
        """The principal of a catalog token, read from the catalog."""
        read_at = time.monotonic()
        with self.context.read() as session:
            found = repository.find_token(session, token_hash=self.token_hash)
        if found is None:
            raise UnauthorizedError("unknown or revoked token")
        if found.expires_at is not None and found.expires_at <= utcnow():
            raise UnauthorizedError(
                f"token {found.id} ({found.name}) expired at {found.expires_at:%Y-%m-%d %H:%M:%S} "
                "UTC: ask an admin for a new one ('ckpt token create --expires-in ...')"
            )
        return self.remember(found, read_at=read_at)

    def remember(self, found: TokenRow, *, read_at: float) -> Principal:
        """The principal of the token's row, found unrevoked and unexpired by a read that
        began at ``read_at`` (``time.monotonic()``), kept in the cache."""
        principal = Principal(
            name=found.name, role=Role(found.role), run=found.run_name, token_id=found.id
        )
        self.context.tokens.put(
            self.token_hash, principal, expires_at=found.expires_at, read_at=read_at
        )
        return principal


def _is_admin(token: str, admin_tokens: Sequence[str]) -> bool:
    """Whether ``token`` is one of the admin tokens, comparing with each in constant time."""
    matches = [hmac.compare_digest(token.encode(), admin.encode()) for admin in admin_tokens]
    return any(matches)


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
            expires_at=_expiry(request.expires_in_seconds),
        )
        return TokenCreated(**_out(token).model_dump(), token=secret)


def _expiry(seconds: int | None) -> datetime | None:
    return None if seconds is None else utcnow() + timedelta(seconds=seconds)


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
        revoked = _out(token)
    context.tokens.forget(token_id)  # committed: a request now reads the revocation
    return revoked


def _out(token: Token) -> TokenOut:
    return TokenOut(
        id=token.id,
        name=token.name,
        role=Role(token.role),
        run=token.run_name,
        created_at=token.created_at,
        revoked_at=token.revoked_at,
        expires_at=token.expires_at,
    )
