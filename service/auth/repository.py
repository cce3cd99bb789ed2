from __future__ import annotations

import functools
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import Select, bindparam, select
from sqlalchemy.orm import Session

from service.models import Token, utcnow


class TokenRow(NamedTuple):
    """A token as every request reads it (a row, not an entity)."""

    id: int
    name: str
    role: str
    run_name: str | None
    expires_at: datetime | None


def find_token(session: Session, *, token_hash: str) -> TokenRow | None:
    """The unrevoked token with this hash."""
    row = session.connection().execute(_find_token(), {"token_hash": token_hash}).first()
    return None if row is None else TokenRow(*row)


@functools.cache
def _find_token() -> Select[int, str, str, str | None, datetime | None]:
    """Every request's statement, built once: building it costs more than running it."""
    return select(Token.id, Token.name, Token.role, Token.run_name, Token.expires_at).where(
        Token.token_hash == bindparam("token_hash"), Token.revoked_at.is_(None)
    )


def add_token(
    session: Session,
    *,
    name: str,
    token_hash: str,
    role: str,
    run_name: str | None,
    expires_at: datetime | None,
) -> Token:
    token = Token(
        name=name,
        token_hash=token_hash,
        role=role,
        run_name=run_name,
        created_at=utcnow(),
        expires_at=expires_at,
    )
    session.add(token)
    session.flush()
    return token


def list_tokens(session: Session) -> list[Token]:
    return list(session.scalars(select(Token).order_by(Token.id)))


def get_token(session: Session, *, token_id: int) -> Token | None:
    return session.get(Token, token_id)
