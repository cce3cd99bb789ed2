"""The dashboard's sign-in sessions: all their SQL."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.models import Token, UISession


def add_session(
    session: Session,
    *,
    id_hash: str,
    token_id: int | None,
    token_hash: str,
    csrf: str,
    created_at: datetime,
    expires_at: datetime,
) -> None:
    session.add(
        UISession(
            id_hash=id_hash,
            token_id=token_id,
            token_hash=token_hash,
            csrf=csrf,
            created_at=created_at,
            expires_at=expires_at,
        )
    )


def find_session(session: Session, *, id_hash: str) -> tuple[UISession, Token | None] | None:
    """The session and the catalog token it was opened with (None: the admin token)."""
    row = session.execute(
        select(UISession, Token)
        .outerjoin(Token, Token.id == UISession.token_id)
        .where(UISession.id_hash == id_hash)
    ).first()
    return (row[0], row[1]) if row else None


def delete_session(session: Session, *, id_hash: str) -> None:
    session.execute(delete(UISession).where(UISession.id_hash == id_hash))


def delete_expired(session: Session, *, now: datetime) -> None:
    session.execute(delete(UISession).where(UISession.expires_at <= now))
