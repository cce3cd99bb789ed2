"""The dashboard's routes under ``/ui/``: sign-in and sign-out, the runs, run and bundle pages,
the live version of a run page, a bundle's manifest; and ``install``, which mounts them, the
static files and the security headers on the app.

Every page needs a session (else 303 to the sign-in form, with the page to come back to);
every form needs its CSRF field; every post (a form or not, with a session or without)
that the browser says comes from another origin is refused before any route runs (403).
Every text a page shows has its hidden characters (bidirectional overrides, zero-width
marks) written as escapes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from sqlalchemy.orm import Session

from service.context import Context
from service.deps import ContextDep, IdPath
from service.errors import ServiceError, UnauthorizedError
from service.logsafe import reveal
from service.models import utcnow
from service.settings import admin_tokens
from service.ui import pages, session
from service.ui.crosssite import RefuseCrossSite
from service.ui.formats import FILTERS
from service.ui.headers import SecurityHeaders
from service.ui.queries import PAGE_SIZE, STATES
from service.ui.session import CSRF_COOKIE, SESSION_COOKIE, Viewer

HERE = Path(__file__).parent


def _shown(value: object) -> object:
    """What an expression of a template puts on the page: a text (markup too) with its
    hidden characters written as escapes (``logsafe.reveal``), anything else as it is."""
    if isinstance(value, Markup):
        return Markup(reveal(value))  # escapes are plain text: safe markup stays safe
    return reveal(value) if isinstance(value, str) else value


templates = Environment(
    finalize=_shown,
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
templates.filters["quote"] = lambda text: quote(str(text), safe="")
templates.filters.update(FILTERS)

router = APIRouter(prefix="/ui", include_in_schema=False)
# Run names are looked up as given: a name the API would refuse may still be in the catalog.
RunName = Annotated[str, PathParam(min_length=1, max_length=128)]
MAX_PAGE = 10_000


def install(app: FastAPI) -> None:
    """Mount the dashboard on ``app``: its routes, its static files, ``/`` redirecting to it,
    the refusal of posts from other sites, and the security headers of every ``/ui`` (and
    ``/docs``) response."""
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")
    app.add_api_route("/", _home, methods=["GET"], include_in_schema=False)
    app.add_middleware(RefuseCrossSite, refusal=_refused)
    app.add_middleware(SecurityHeaders)  # outermost: a refusal carries the headers too


def _refused(message: str) -> Response:
    return render("error.html", status=403, viewer=None, message=message)


async def _home() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=303)


def _admin_tokens(request: Request) -> tuple[str, ...]:
    return admin_tokens(request.app.state.admin_token)


def render(name: str, *, status: int = 200, **values: Any) -> HTMLResponse:
    page = templates.get_template(name).render(now=utcnow(), **values)
    return HTMLResponse(page, status_code=status)


def _page(
    request: Request,
    context: Context,
    build: Callable[[Session, Viewer], Response],
    *,
    for_script: bool = False,
) -> Response:
    """``build``'s page for the signed-in viewer, in one transaction with the session's
    check; without a session, a redirect to the sign-in form (a 401 for a script); an error
    page when the service refuses."""
    with context.transaction() as db:
        viewer = session.current(db, request, admin_tokens=_admin_tokens(request))
        if viewer is None and for_script:
            return JSONResponse({"error": "unauthorized", "message": "sign in again"}, 401)
        if viewer is None:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"/ui/signin?next={quote(target, safe='')}", status_code=303)
        try:
            return build(db, viewer)
        except ServiceError as err:
            return render("error.html", status=err.status, viewer=viewer, message=err.message)


def _next(target: str | None) -> str:
    """Where to go after signing in: a dashboard path only, never another site."""
    if not target or not target.startswith("/ui/") or "\\" in target or "//" in target:
        return "/ui/"
    if any(ord(char) < 0x21 for char in target):
        return "/ui/"
    return target


@router.get("/signin")
def signin_form(
    request: Request, target: Annotated[str | None, Query(alias="next", max_length=2000)] = None
) -> Response:
    """The sign-in form; ``next`` is the page to go back to."""
    csrf = request.cookies.get(CSRF_COOKIE) or session.new_secret()
    response = render("signin.html", csrf=csrf, next=_next(target), message=None)
    session.set_cookie(response, request, CSRF_COOKIE, csrf)
    return response


async def _form(request: Request) -> dict[str, str]:
    """The url-encoded form's fields (the first value of each)."""
    body = (await request.body()).decode("utf-8", errors="replace")
    return {key: values[0] for key, values in parse_qs(body, max_num_fields=20).items()}


@router.post("/signin")
async def signin(request: Request, context: ContextDep) -> Response:
    form = await _form(request)
    expected = request.cookies.get(CSRF_COOKIE)
    refused = session.form_allowed(request, given=form.get("csrf"), expected=expected)
    if refused:
        return render("error.html", status=403, viewer=None, message=refused)
    target = _next(form.get("next"))
    try:
        session_id, _ = await run_in_threadpool(
            session.sign_in,
            context,
            token=form.get("token", ""),
            admin_tokens=_admin_tokens(request),
        )
    except UnauthorizedError as err:
        message = f"sign-in refused: {err.message}"
        return render("signin.html", status=401, csrf=expected, next=target, message=message)
    response = RedirectResponse(target, status_code=303)
    session.set_cookie(response, request, SESSION_COOKIE, session_id)
    return response


def _viewer(context: Context, request: Request) -> Viewer | None:
    with context.transaction() as db:
        return session.current(db, request, admin_tokens=_admin_tokens(request))


@router.post("/signout")
async def signout(request: Request, context: ContextDep) -> Response:
    """End the session in the catalog (its cookie opens nothing after, even replayed) and
    clear the cookie. Without a live session there is nothing to guard but the cookie; a
    post from another site never gets here (``RefuseCrossSite``)."""
    form = await _form(request)
    viewer = await run_in_threadpool(_viewer, context, request)
    expected = viewer.csrf if viewer else None
    refused = session.form_allowed(request, given=form.get("csrf"), expected=expected)
    if refused and viewer is not None:
        return render("error.html", status=403, viewer=viewer, message=refused)
    await run_in_threadpool(session.sign_out, context, request)
    response = RedirectResponse("/ui/signin", status_code=303)
    session.clear_cookie(response, request, SESSION_COOKIE)
    return response


@router.get("/")
def runs(
    request: Request,
    context: ContextDep,
    prefix: Annotated[str, Query(max_length=128)] = "",
    state: str = "",
    page: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 1,
) -> Response:
    def build(db: Session, viewer: Viewer) -> Response:
        shown_state = state if state in STATES else ""
        found = pages.runs_page(db, viewer.principal, prefix=prefix, state=shown_state, page=page)
        return render("runs.html", viewer=viewer, view=found, states=STATES, page_size=PAGE_SIZE)

    return _page(request, context, build)


@router.get("/runs/{run}")
def run_page(request: Request, context: ContextDep, run: RunName) -> Response:
    def build(db: Session, viewer: Viewer) -> Response:
        view = pages.run_page(db, viewer.principal, name=run)
        live = f"/ui/runs/{quote(run, safe='')}/live" if view.listing.state == "training" else ""
        return render("run.html", viewer=viewer, view=view, live=live)

    return _page(request, context, build)


@router.get("/runs/{run}/live")
def live(request: Request, context: ContextDep, run: RunName) -> Response:
    def build(db: Session, viewer: Viewer) -> Response:
        version = pages.live_version(db, viewer.principal, name=run)
        return JSONResponse({"version": version})

    return _page(request, context, build, for_script=True)


@router.get("/runs/{run}/bundles/{bundle}")
def bundle_page(request: Request, context: ContextDep, run: RunName, bundle: IdPath) -> Response:
    def build(db: Session, viewer: Viewer) -> Response:
        server_url = str(request.base_url).rstrip("/")
        view = pages.bundle_page(
            db, viewer.principal, name=run, bundle_id=bundle, server_url=server_url
        )
        running = view.state == "training"
        live = f"/ui/runs/{quote(run, safe='')}/live" if running else ""
        return render("bundle.html", viewer=viewer, view=view, live=live)

    return _page(request, context, build)


@router.get("/runs/{run}/bundles/{bundle}/manifest.json")
def bundle_manifest(
    request: Request, context: ContextDep, run: RunName, bundle: IdPath
) -> Response:
    def build(db: Session, viewer: Viewer) -> Response:
        found = pages.manifest(db, viewer.principal, name=run, bundle_id=bundle)
        return _ascii_json(found)

    return _page(request, context, build)


def _ascii_json(value: object) -> Response:
    """``value`` as JSON with every character beyond ASCII written as a ``\\u`` escape: a
    browser shows the document as text, and a tensor's name (the model's, not checked)
    may hold a bidirectional override."""
    body = json.dumps(value, ensure_ascii=True, separators=(",", ":"))
    return Response(body, media_type="application/json")
