"""Signing in to the dashboard with an API token, and protecting its forms.

The browser gets a random session id in an HttpOnly, SameSite=Strict cookie; the catalog
keeps its SHA-256, the token it was opened with and a CSRF secret. Every request checks the
token again, so revoking (or the expiry of) the token ends its sessions at once. The token
itself is never stored in the browser, a URL or a page.

A form is accepted when its ``csrf`` field equals the session's secret (before sign-in, the
``ckpt_csrf`` cookie's) and the browser says it comes from our own origin (``same_site``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from fastapi import Request, Response
from sqlalchemy.orm import Session

from service.auth.principal import Principal
from service.auth.service import authenticate, hash_token
from service.context import Context
from service.models import Role, Token, UISession, utcnow
from service.ui import repository

SESSION_COOKIE = "ckpt_session"
CSRF_COOKIE = "ckpt_csrf"  # the sign-in form's secret, before there is a session
COOKIE_PATH = "/ui"
SESSION_LIFETIME = timedelta(hours=12)


@dataclass(frozen=True)
class Viewer:
    """Who is looking: the token's principal, and the secret the session's forms carry."""

    principal: Principal
    csrf: str


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def _hash(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def sign_in(context: Context, *, token: str, admin_tokens: Sequence[str]) -> tuple[str, Viewer]:
    """Open a session for ``token`` (any role); returns the cookie's value and the viewer.

    Raises ``UnauthorizedError`` for an unknown, revoked or expired token.
    """
    principal = authenticate(
        context, authorization=f"Bearer {token.strip()}", admin_tokens=admin_tokens
    )
    session_id, csrf, now = new_secret(), new_secret(), utcnow()
    with context.transaction() as session:
        repository.delete_expired(session, now=now)
        repository.add_session(
            session,
            id_hash=_hash(session_id),
            token_id=principal.token_id,
            token_hash=hash_token(token.strip()),
            csrf=csrf,
            created_at=now,
            expires_at=now + SESSION_LIFETIME,
        )
    return session_id, Viewer(principal=principal, csrf=csrf)


def current(session: Session, request: Request, *, admin_tokens: Sequence[str]) -> Viewer | None:
    """The viewer of ``request``'s session cookie; None without a live session, or when its
    token has been revoked or has expired since."""
    session_id = request.cookies.get(SESSION_COOKIE)
    if not session_id:
        return None
    found = repository.find_session(session, id_hash=_hash(session_id))
    if found is None:
        return None
    row, token = found
    if row.expires_at <= utcnow():
        return None
    principal = _principal(row, token, admin_tokens=admin_tokens)
    return Viewer(principal=principal, csrf=row.csrf) if principal else None


def _principal(
    row: UISession, token: Token | None, *, admin_tokens: Sequence[str]
) -> Principal | None:
    """Who the session's token is now: None if it no longer authenticates."""
    if row.token_id is None:  # the configured admin token: still one of them?
        hashes = [hash_token(admin) for admin in admin_tokens]
        if not any(hmac.compare_digest(row.token_hash, known) for known in hashes):
            return None
        return Principal(name="admin", role=Role.ADMIN)
    if token is None or token.revoked_at is not None:
        return None
    if token.expires_at is not None and token.expires_at <= utcnow():
        return None
    return Principal(name=token.name, role=Role(token.role), run=token.run_name, token_id=token.id)


def sign_out(context: Context, request: Request) -> None:
    session_id = request.cookies.get(SESSION_COOKIE)
    if session_id:
        with context.transaction() as session:
            repository.delete_session(session, id_hash=_hash(session_id))


def secure(request: Request) -> bool:
    """Whether the browser reached us over HTTPS (then cookies get ``Secure``)."""
    return request.url.scheme == "https"


def set_cookie(response: Response, request: Request, name: str, value: str) -> None:
    """A cookie only the dashboard's pages see: HttpOnly, SameSite=Strict, Path=/ui."""
    response.set_cookie(
        name,
        value,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=secure(request),
        max_age=int(SESSION_LIFETIME.total_seconds()),
    )


def clear_cookie(response: Response, request: Request, name: str) -> None:
    response.delete_cookie(
        name, path=COOKIE_PATH, httponly=True, samesite="strict", secure=secure(request)
    )


def form_allowed(request: Request, *, given: str | None, expected: str | None) -> str | None:
    """Why a form post must be refused (None: it may go on): a missing or wrong ``csrf``
    field, or an ``Origin`` other than the page's own."""
    if not given or not expected or not hmac.compare_digest(given, expected):
        return "the form's CSRF token is missing or wrong: reload the page and try again"
    if not same_site(request):
        return "a form posted from another site is refused"
    return None


def same_site(request: Request) -> bool:
    """Whether the browser says the request comes from one of our own pages.

    ``Origin`` when it names one must be ours; under ``Referrer-Policy: no-referrer``
    browsers send ``Origin: null`` even for our own forms, and ``Sec-Fetch-Site``, when sent,
    must say ``same-origin``. A client that sends neither (not a browser) is judged by the
    CSRF field alone.
    """
    origin = request.headers.get("origin")
    if origin not in (None, "null") and origin != own_origin(request):
        return False
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None:
        return fetch_site == "same-origin"
    return origin != "null"


def own_origin(request: Request) -> str:
    url = request.url
    default = {"http": 80, "https": 443}.get(url.scheme)
    port = "" if url.port in (None, default) else f":{url.port}"
    return f"{url.scheme}://{url.hostname}{port}"
