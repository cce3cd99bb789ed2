"""The dashboard's last security holes, in a real browser: another site cannot change anything
(sign-out included) whether or not the session cookie comes along; text holding hidden
characters (a bidirectional override makes "\\u202elive" read "evil") is shown and logged
with them written as escapes; and ``/docs`` carries the dashboard's security headers and
still renders the API under its Content-Security-Policy.

The module's catalog (a real ``ckpt server``): the run ``bidi``, whose attempt read a notice
and whose bundle was quarantined, both free text holding U+202E (kept: the API refuses hidden
characters in names, not in what a cloud or an operator says); and the run ``legacy``, whose
attempt's pod and node hold U+202E and U+2066, written into the catalog directly as a
catalog from before the API refused them would hold them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import httpx
import pytest
from sqlalchemy.orm import Session

from ckpt.core.contract import RESTORE_ORDER, Layer
from ckpt.core.storage import DirectoryStore
from service.db import make_engine
from service.models import Attempt, Run
from service.runs.activity import refresh_activity
from tests.server_process import ServerProcess, ckpt_server
from tests.service.helpers import commit, make_layer, open_bundle, record, register, save
from tests.ui.conftest import CSP, Attacker, OpenPage, sign_in

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.browser

RLO, LRI, PDI = "\u202e", "\u2066", "\u2069"
NOTICE = f"terminate at {RLO}00:21{PDI}"
REASON = f"checksum {RLO}evil{PDI} mismatch"
LEGACY_POD, LEGACY_NODE = f"{RLO}live", f"node-{LRI}7{PDI}"
TENSOR = f"layers.0.{RLO}thgiew"  # a model's name for a tensor: the API does not judge it
# The bidirectional controls, raw: what must never reach a page or the log.
BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
ESCAPED = r"\u202e"


@dataclass(frozen=True)
class Target:
    server: ServerProcess
    bundle_id: int  # bidi's quarantined bundle
    tensor_bundle_id: int  # bidi's bundle whose weights hold the tensor TENSOR

    def read_token(self) -> str:
        with self.server.client() as client:
            made = client.post("/v1/tokens", json={"role": "read"})
            made.raise_for_status()
            token: str = made.json()["token"]
            return token


def save_with_tensor_name(
    client: httpx.Client, store: DirectoryStore, attempt: dict[str, Any], *, step: int
) -> int:
    """A committed bundle of ``bidi`` whose weights' one tensor is named ``TENSOR``."""
    opened = open_bundle(client, "bidi", attempt, step=step)
    assert opened.status_code == 201, opened.text
    bundle_id: int = opened.json()["id"]
    for layer in RESTORE_ORDER:
        made, _ = make_layer(store)
        if layer is Layer.WEIGHTS:
            made = made.model_copy(update={"tensors": {TENSOR: made.tensors["t"]}})
        answer = record(client, bundle_id, 0, layer, attempt["epoch"], made)
        assert answer.status_code == 200, answer.text
    done = commit(client, bundle_id, attempt["epoch"])
    assert done.status_code == 200, done.text
    return bundle_id


def add_legacy_run(database: Path) -> None:
    """A run whose attempt's names hold hidden characters, straight into the catalog."""
    engine = make_engine(f"sqlite:///{database}")
    now = datetime.now(UTC)
    with Session(engine) as session, session.begin():
        run = Run(name="legacy", created_at=now, epoch=1)
        session.add(run)
        session.flush()
        session.add(
            Attempt(run_id=run.id, epoch=1, pod=LEGACY_POD, node=LEGACY_NODE, started_at=now)
        )
        refresh_activity(session, run_ids=[run.id])
    engine.dispose()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("crosssite")
    with ckpt_server(root) as server, server.client() as client:
        attempt = register(client, "bidi", pod="pod-1", node="node-1")
        noticed = client.post(
            f"/v1/attempts/{attempt['attempt_id']}/notice",
            json={"cloud": "aws", "kind": "instance-action", "detail": NOTICE},
        )
        assert noticed.status_code == 200, noticed.text
        store = DirectoryStore(server.store)
        bundle = save(client, store, "bidi", attempt, step=3)
        tensor_bundle_id = save_with_tensor_name(client, store, attempt, step=5)
        quarantined = client.post(f"/v1/bundles/{bundle['id']}/quarantine", json={"reason": REASON})
        assert quarantined.status_code == 200, quarantined.text
        add_legacy_run(root / "catalog.db")
        yield Target(server=server, bundle_id=bundle["id"], tensor_bundle_id=tensor_bundle_id)


def cookie_names(page: Page) -> set[str]:
    return {cookie["name"] for cookie in page.context.cookies()}


# --- 1. another site changes nothing ---------------------------------------------------------


def test_another_site_cannot_sign_the_user_out(
    open_page: OpenPage, target: Target, attacker: Attacker
) -> None:
    """From another site the browser sends no SameSite=Strict cookie: the post must be refused
    by where it comes from alone, and the session must go on."""
    url = target.server.url
    page, _ = open_page()
    sign_in(page, url, target.read_token())
    signout = attacker.form(
        "/bare-signout", action=f"{url}/ui/signout", fields={}, host="localhost"
    )
    with page.expect_response(lambda r: r.url == f"{url}/ui/signout") as posted:
        page.goto(signout)
    assert posted.value.status == 403
    assert "ckpt_session" in cookie_names(page), "the cross-site post cleared the cookie"
    page.goto(f"{url}/ui/")
    assert urlparse(page.url).path == "/ui/", "the cross-site sign-out took effect"
    assert page.locator("#runs").count() == 1


def test_sign_out_ends_the_session_in_the_catalog(open_page: OpenPage, target: Target) -> None:
    url = target.server.url
    page, _ = open_page()
    sign_in(page, url, target.read_token())
    session = next(c for c in page.context.cookies() if c["name"] == "ckpt_session")
    with page.expect_navigation():
        page.locator("form.signout button[type=submit]").click()
    assert urlparse(page.url).path == "/ui/signin"
    assert "ckpt_session" not in cookie_names(page)
    replayed = {"ckpt_session": session["value"]}
    with httpx.Client(timeout=60, base_url=url, cookies=replayed) as client:
        answer = client.get("/ui/")
    assert answer.status_code == 303 and answer.headers["location"].startswith("/ui/signin")


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://attacker.example"},
        {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Origin": "null"},
    ],
)
def test_every_post_from_another_site_is_refused_cookie_or_not(
    target: Target, headers: dict[str, str]
) -> None:
    """Every state-changing request under /ui, a route's or not, with or without a session."""
    with httpx.Client(timeout=60, base_url=target.server.url) as client:
        for path in ("/ui/signout", "/ui/signin", "/ui/", "/ui/runs/bidi", "/ui/anything"):
            for method in ("POST", "PUT", "PATCH", "DELETE"):
                answer = client.request(method, path, headers=headers, data={"csrf": "x"})
                assert answer.status_code == 403, (method, path, answer.status_code)
                assert "another site" in answer.text
                assert answer.headers.get("content-security-policy") == CSP
                assert "set-cookie" not in answer.headers, (method, path)


# --- 7. hidden characters are shown and logged as escapes -----------------------------------


def assert_shown_escaped(page: Page, *expected: str) -> None:
    html = page.content()
    assert not BIDI.search(html), [hex(ord(char)) for char in BIDI.findall(html)]
    shown = page.inner_text("main")
    for text in expected:
        assert text in shown, (text, shown)


def test_hidden_characters_are_shown_as_escapes(open_page: OpenPage, target: Target) -> None:
    from playwright.sync_api import expect

    url = target.server.url
    page, seen = open_page()
    sign_in(page, url, target.read_token())
    expect(page.locator("#runs")).to_contain_text("legacy")
    page.goto(f"{url}/ui/runs/legacy")
    expect(page.locator("main")).to_contain_text(r"\u202elive")
    assert_shown_escaped(page, r"\u202elive", r"node-\u20667\u2069")

    page.goto(f"{url}/ui/runs/bidi")
    expect(page.locator("main")).to_contain_text(ESCAPED)
    assert_shown_escaped(page, r"terminate at \u202e00:21\u2069")

    page.goto(f"{url}/ui/runs/bidi/bundles/{target.bundle_id}")
    expect(page.locator("main")).to_contain_text(ESCAPED)
    assert_shown_escaped(page, r"checksum \u202eevil\u2069 mismatch")
    assert seen.console_errors == []

    # A JSON document, shown as text (Chromium asks for /favicon.ico there: not ours).
    page.goto(f"{url}/ui/runs/bidi/bundles/{target.tensor_bundle_id}/manifest.json")
    expect(page.locator("body")).to_contain_text(r"layers.0.\u202ethgiew")
    assert not BIDI.search(page.content())


def test_hidden_characters_are_logged_as_escapes(target: Target) -> None:
    log = target.server.log.read_text(encoding="utf-8")
    assert r"terminate at \u202e00:21\u2069" in log
    assert not BIDI.search(log), [hex(ord(char)) for char in BIDI.findall(log)]


# --- 9. /docs under the dashboard's headers --------------------------------------------------


def test_the_api_page_carries_the_security_headers_and_runs_no_inline_script(
    target: Target,
) -> None:
    with httpx.Client(timeout=60, base_url=target.server.url) as client:
        page = client.get("/docs")
        assets = [client.get(path) for path in ("/static/docs.js", "/openapi.json")]
    assert page.status_code == 200
    for answer in (page, *assets):
        assert answer.headers.get("content-security-policy") == CSP
        assert answer.headers.get("x-content-type-options") == "nosniff"
        assert answer.headers.get("x-frame-options") == "DENY"
        assert answer.headers.get("referrer-policy") == "no-referrer"
    assert page.headers.get("cache-control") == "no-store"
    assert not re.search(r"<script(?![^>]*\bsrc=)", page.text), "an inline script"


def test_the_api_page_renders_the_api_under_its_policy(open_page: OpenPage, target: Target) -> None:
    from playwright.sync_api import expect

    page, seen = open_page()
    page.goto(f"{target.server.url}/docs")
    operation = page.locator(".opblock-summary-path", has_text="/v1/runs/{run}/attempts")
    expect(operation.first).to_be_visible()
    assert page.locator(".opblock").count() > 20
    operation.first.click()  # opened: its parameters and answers, drawn under the policy too
    expect(page.locator(".opblock.is-open .opblock-section-header").first).to_be_visible()
    expect(page.locator(".opblock.is-open .responses-table").first).to_be_visible()
    expect(page.locator(".information-container .title")).to_contain_text("ckpt control plane")
    sources = page.locator("script").evaluate_all("nodes => nodes.map(n => n.src)")
    assert sources and all(urlparse(src).path.startswith("/static/") for src in sources)
    seen.assert_clean()
