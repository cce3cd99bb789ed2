"""Fixtures for the dashboard in a real browser: Debian's Chromium driven by Playwright.

Without ``/usr/bin/chromium`` or the ``playwright`` package the browser tests are skipped,
unless CKPT_REQUIRE_BROWSER is set (CI sets it: there, a missing browser fails the run).
Each module shares one browser; each test gets a fresh context (no cookies) through
``open_page``, whose ``Watch`` records console errors, failed requests and dialogs.
"""

from __future__ import annotations

import html
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, Page

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
# How long an expectation waits for the page (a live refresh polls every 5 s).
WAIT_MS = 20_000
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CKPT_REQUIRE_BROWSER"):
        pytest.fail(f"CKPT_REQUIRE_BROWSER is set but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    """Debian's Chromium, headless, for the whole module."""
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[test]')")
    if not Path(CHROMIUM).is_file():
        _unavailable(f"no {CHROMIUM} (apt-get install chromium)")
    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@dataclass
class Watch:
    """What went wrong in a page: console errors (a CSP violation is one), uncaught
    exceptions, requests that failed or were answered with an error, dialogs opened."""

    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    requested: list[str] = field(default_factory=list)

    def assert_clean(self) -> None:
        assert self.console_errors == []
        assert self.failed_requests == []
        assert self.dialogs == []


def watch(page: Page) -> Watch:
    seen = Watch()
    page.on(
        "console",
        lambda message: (
            seen.console_errors.append(message.text) if message.type == "error" else None
        ),
    )
    page.on("pageerror", lambda error: seen.console_errors.append(f"uncaught: {error}"))
    page.on("requestfailed", lambda request: seen.failed_requests.append(f"{request.url} failed"))
    page.on("request", lambda request: seen.requested.append(request.url))
    page.on(
        "response",
        lambda response: (
            seen.failed_requests.append(f"{response.status} {response.url}")
            if response.status >= 400
            else None
        ),
    )

    def dialog(opened: object) -> None:
        seen.dialogs.append(getattr(opened, "message", "?"))
        opened.dismiss()  # type: ignore[attr-defined]

    page.on("dialog", dialog)
    return seen


OpenPage = Callable[..., tuple["Page", Watch]]


@pytest.fixture
def open_page(chromium: Browser) -> Iterator[OpenPage]:
    """``open_page(width=1280, height=900)``: a page in a fresh context, and its Watch."""
    contexts: list[BrowserContext] = []

    def make(*, width: int = 1280, height: int = 900) -> tuple[Page, Watch]:
        context = chromium.new_context(viewport={"width": width, "height": height})
        context.set_default_timeout(WAIT_MS)
        contexts.append(context)
        page = context.new_page()
        return page, watch(page)

    yield make
    for context in contexts:
        context.close()


def sign_in(page: Page, base_url: str, token: str, *, start: str = "/ui/") -> None:
    """Open ``start`` without a session, land on the sign-in form, submit ``token``, and
    wait to be back on ``start``."""
    from playwright.sync_api import expect

    page.goto(base_url + start)
    expect(page).to_have_url(re.compile(re.escape(f"{base_url}/ui/signin")))
    page.locator("input[name=token]").fill(token)
    with page.expect_navigation():
        page.locator("input[name=token]").press("Enter")
    expect(page).to_have_url(base_url + start)


def poll(done: Callable[[], bool], *, what: str, timeout: float = 60) -> None:
    """Wait until ``done()`` (a state read over the API), checking every 0.1 s."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        threading.Event().wait(0.1)


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the browser tests leave their screenshots (test artifacts)."""
    return tmp_path_factory.mktemp("screenshots")


def screenshot(page: Page, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


@dataclass
class Attacker:
    """Pages served from another origin (a plain http.server on another port)."""

    port: int
    pages: dict[str, str] = field(default_factory=dict)

    def form(self, path: str, *, action: str, fields: dict[str, str], host: str) -> str:
        """A page at ``path`` that posts ``fields`` to ``action`` as soon as it loads."""
        inputs = "".join(
            f'<input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}">'
            for k, v in fields.items()
        )
        self.pages[path] = (
            f'<!doctype html><form method="post" action="{html.escape(action)}">{inputs}</form>'
            "<script>document.forms[0].submit()</script>"
        )
        return f"http://{host}:{self.port}{path}"


@pytest.fixture(scope="module")
def attacker() -> Iterator[Attacker]:
    pages: dict[str, str] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, "not found").encode()
            self.send_response(200 if self.path in pages else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Attacker(port=server.server_address[1], pages=pages)
    server.shutdown()
    server.server_close()
