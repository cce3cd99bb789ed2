"""``/docs``: the interactive API page (Swagger UI), from the files the package ships under
``static/`` (``static/swagger-ui/README.md`` says from where), so that the page works offline
and loads nothing from another site.

The page runs no inline script: ``static/docs.js`` starts Swagger UI with the description's
URL read from the page, so the dashboard's Content-Security-Policy (``script-src 'self'``)
and its other security headers apply to ``/docs`` and its files too
(``service/ui/headers.py``).
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="stylesheet" href="{assets}/swagger-ui.css">
<link rel="icon" href="{assets}/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui" data-openapi-url="{openapi}"></div>
<script src="{assets}/swagger-ui-bundle.js"></script>
<script src="{static}/docs.js"></script>
</body>
</html>
"""


def serve_docs(app: FastAPI) -> None:
    """Mount ``/static`` and serve ``/docs`` on ``app``."""
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        page = PAGE.format(
            title=escape(f"{app.title} - API"),
            assets=escape(f"{root}/static/swagger-ui"),
            static=escape(f"{root}/static"),
            openapi=escape(f"{root}{app.openapi_url}"),
        )
        return HTMLResponse(page)
