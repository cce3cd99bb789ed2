from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import Token, utcnow


def find_token(session: Session, *, token_hash: str) -> Token | None:
    return session.scalar(
        select(Token).where(Token.token_hash == token_hash, Token.revoked_at.is_(None))
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
