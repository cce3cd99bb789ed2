"""The headers every dashboard response carries: a strict Content-Security-Policy (scripts,
styles and images from this server only; no inline script or style), no MIME sniffing, no
referrer, no framing; and no caching of pages."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = [
    (b"content-security-policy", POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]
STATIC = "/ui/static/"


class SecurityHeaders:
    """Adds ``HEADERS`` to the responses of ``/`` and ``/ui...``; ``Cache-Control: no-store``
    to all but the static files. (A plain ASGI middleware: it costs a few microseconds.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path not in {"/", "/ui"} and not path.startswith("/ui/"):
            await self.app(scope, receive, send)
            return
        extra = HEADERS if path.startswith(STATIC) else [*HEADERS, (b"cache-control", b"no-store")]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, sending)
