"""The headers every dashboard response carries, and the API page's (``/docs``) too: a strict
Content-Security-Policy (scripts, styles and images from this server only; no inline script
or style), no MIME sniffing, no referrer, no framing; and no caching of pages."""

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
PAGES = ("/", "/ui", "/docs", "/openapi.json")
# Files: cached as usual. The dashboard's, and Swagger UI's with the API page's script.
STATIC = ("/ui/static/", "/static/")


class SecurityHeaders:
    """Adds ``HEADERS`` to the responses of ``/``, ``/ui...``, ``/docs`` (and the description
    it reads, ``/openapi.json``) and ``/static/...``;
    ``Cache-Control: no-store`` to all but the static files. (A plain ASGI middleware: it
    costs a few microseconds.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        static = path.startswith(STATIC)
        if not static and path not in PAGES and not path.startswith("/ui/"):
            await self.app(scope, receive, send)
            return
        extra = HEADERS if static else [*HEADERS, (b"cache-control", b"no-store")]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, sending)
