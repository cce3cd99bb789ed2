"""Refusing what another site asks the dashboard to change.

A page on another site can make the browser post to ``/ui/...``; ``SameSite=Strict`` keeps
the session cookie off such a request, so a route that checks forms only when a session
comes with them would let it through (a cross-site sign-out cleared the cookie). This
middleware judges every state-changing request under ``/ui`` by where the browser says it
comes from (``session.same_site``), before any route runs, cookie or not: 403.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from service.ui.session import same_site

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
REFUSED = "a request from another site may not change anything here: use the dashboard's own pages"


class RefuseCrossSite:
    """403 (``refusal``'s page) for a POST, PUT, PATCH or DELETE under ``/ui`` that the
    browser says comes from another origin."""

    def __init__(self, app: ASGIApp, *, refusal: Callable[[str], Response]) -> None:
        self.app = app
        self.refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _guarded(scope) and not same_site(Request(scope)):
            await self.refusal(REFUSED)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _guarded(scope: Scope) -> bool:
    if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
        return False
    path: str = scope["path"]
    return path == "/ui" or path.startswith("/ui/")
