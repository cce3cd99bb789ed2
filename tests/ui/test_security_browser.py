"""The dashboard's defences, in a real browser: client text is shown, never run; no page
without a session; a revoked or expired token's session ends; a form posted from another
origin is refused; sign-in keeps the token out of URLs and pages and never redirects away.

The module's catalog (a real ``ckpt server``): the run ``xss-pod``, whose attempt's pod and
node are HTML, with a bundle quarantined for a reason that is HTML too (all through the
API, which takes any printable text there); and a run named ``<img src=x onerror=alert(1)>``
(a name the API refuses, written into the catalog directly: the dashboard must not rely on
the API's checks).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from http.cookies import SimpleCookie
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlparse

import httpx
import pytest
from sqlalchemy.orm import Session

from ckpt.core.storage import DirectoryStore
from service.db import make_engine
from service.models import Attempt, Run
from service.runs.activity import refresh_activity
from tests.server_process import ServerProcess, ckpt_server
from tests.service.helpers import register, save
from tests.ui.conftest import CSP, Attacker, OpenPage, Watch, poll, sign_in
from tests.ui.signin import csrf_field, signed_in_client

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.browser

HTML_RUN = "<img src=x onerror=alert(1)>"
POD = "<script>alert(1)</script>"
NODE = '"><img src=x onerror=alert(2)>'
REASON = "<img src=x onerror=alert(3)> <b>bold</b>"
HTML_POD = "<script>alert(4)</script>"


@dataclass(frozen=True)
class Target:
    server: ServerProcess
    bundle_id: int  # xss-pod's quarantined bundle

    def token(self, **body: Any) -> dict[str, Any]:
        """A new token (read by default): ``{"id", "token", ...}``."""
        with self.server.client() as client:
            made = client.post("/v1/tokens", json={"role": "read", **body})
            made.raise_for_status()
            created: dict[str, Any] = made.json()
            return created

    def pages(self) -> list[str]:
        run = "/ui/runs/xss-pod"
        bundle = f"{run}/bundles/{self.bundle_id}"
        return ["/ui/", run, f"{run}/live", bundle, f"{bundle}/manifest.json"]


def add_html_named_run(database: Path) -> None:
    """A run the API could never create, straight into the catalog."""
    engine = make_engine(f"sqlite:///{database}")
    now = datetime.now(UTC)
    with Session(engine) as session, session.begin():
        run = Run(name=HTML_RUN, created_at=now, epoch=1)
        session.add(run)
        session.flush()
        session.add(Attempt(run_id=run.id, epoch=1, pod=HTML_POD, node=NODE, started_at=now))
        refresh_activity(session, run_ids=[run.id])
    engine.dispose()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("security")
    with ckpt_server(root) as server, server.client() as client:
        attempt = register(client, "xss-pod", pod=POD, node=NODE)
        bundle = save(client, DirectoryStore(server.store), "xss-pod", attempt, step=3)
        quarantined = client.post(f"/v1/bundles/{bundle['id']}/quarantine", json={"reason": REASON})
        quarantined.raise_for_status()
        add_html_named_run(root / "catalog.db")
        yield Target(server=server, bundle_id=bundle["id"])


def assert_nothing_injected(page: Page, seen: Watch) -> None:
    """No dialog opened, no element made of client text, no script but ours."""
    assert seen.dialogs == []
    assert page.locator("img").count() == 0
    assert page.locator("b").count() == 0
    sources = page.locator("script").evaluate_all("nodes => nodes.map(n => n.src)")
    assert sources and all(urlparse(src).path.startswith("/ui/static/") for src in sources)
    handlers = "[onerror], [onload], [onclick], [onmouseover], [onfocus], [style]"
    assert page.locator(handlers).count() == 0


def test_client_text_is_shown_as_text_and_never_runs(open_page: OpenPage, target: Target) -> None:
    from playwright.sync_api import expect

    url = target.server.url
    page, seen = open_page()
    sign_in(page, url, target.token()["token"])
    row = page.locator("#runs tr[data-run]").filter(has_text="onerror")
    expect(row).to_have_count(1)
    assert row.get_attribute("data-run") == HTML_RUN
    assert row.locator('[data-col="name"]').inner_text().strip() == HTML_RUN
    assert_nothing_injected(page, seen)

    with page.expect_navigation():
        row.locator('[data-col="name"] a').click()
    assert urlparse(page.url).path == f"/ui/runs/{quote(HTML_RUN, safe='')}"
    expect(page.locator('#attempts tr[data-epoch="1"] [data-col="pod"]')).to_have_text(HTML_POD)
    assert_nothing_injected(page, seen)

    page.goto(f"{url}/ui/runs/xss-pod")
    attempt = '#attempts tr[data-epoch="1"]'
    expect(page.locator(f'{attempt} [data-col="pod"]')).to_have_text(POD)
    expect(page.locator(f'{attempt} [data-col="node"]')).to_have_text(NODE)
    assert_nothing_injected(page, seen)

    page.goto(f"{url}/ui/runs/xss-pod/bundles/{target.bundle_id}")
    expect(page.locator("main")).to_contain_text(REASON)
    assert_nothing_injected(page, seen)
    assert seen.console_errors == []
    assert seen.failed_requests == []


def test_no_page_is_readable_without_a_session(open_page: OpenPage, target: Target) -> None:
    url = target.server.url
    home = httpx.get(f"{url}/", timeout=60)
    assert home.status_code == 303 and home.headers["location"].endswith("/ui/")
    forged = {"ckpt_session": "forged-0123456789abcdef"}
    for cookies in ({}, forged):
        with httpx.Client(timeout=60, base_url=url, cookies=cookies) as client:
            for path in target.pages():
                answer = client.get(path)
                assert "xss-pod" not in answer.text
                if path.endswith("/live") and answer.status_code == 401:
                    continue  # the script's JSON, not a page: refused rather than redirected
                assert answer.status_code == 303, (path, answer.status_code)
                where = urlparse(answer.headers["location"])
                assert where.path == "/ui/signin", (path, where)

    page, seen = open_page()
    page.goto(f"{url}/ui/runs/xss-pod")
    assert urlparse(page.url).path == "/ui/signin"
    assert page.locator("svg#lineage, #attempts, #runs").count() == 0
    assert POD not in page.content() and "xss-pod" not in page.inner_text("body")
    seen.assert_clean()


def test_a_revoked_tokens_session_stops_working(open_page: OpenPage, target: Target) -> None:
    url = target.server.url
    token = target.token(name="to-revoke")
    page, _ = open_page()
    sign_in(page, url, token["token"], start="/ui/runs/xss-pod")
    with target.server.client() as client:
        client.delete(f"/v1/tokens/{token['id']}").raise_for_status()
    page.reload()
    assert urlparse(page.url).path == "/ui/signin"
    assert page.locator("form#signin input[name=token]").count() == 1
    assert page.locator("svg#lineage").count() == 0


def test_an_expired_tokens_session_stops_working(open_page: OpenPage, target: Target) -> None:
    url = target.server.url
    token = target.token(name="short-lived", expires_in_seconds=5)
    page, _ = open_page()
    sign_in(page, url, token["token"])

    def signed_out() -> bool:
        page.reload()
        return urlparse(page.url).path == "/ui/signin"

    poll(signed_out, what="the session of an expired token ended", timeout=30)


def test_a_form_posted_from_another_origin_is_refused(
    open_page: OpenPage, target: Target, attacker: Attacker
) -> None:
    url = target.server.url
    page, _ = open_page()
    sign_in(page, url, target.token()["token"])
    # The attacker even knows the form's CSRF value: the origin alone must refuse the post.
    csrf = page.locator("form.signout input[name=csrf]").get_attribute("value") or ""
    # 127.0.0.1 on another port: another origin of the same site, so the SameSite=Strict
    # cookie is sent; the Origin header has to be checked.
    signout = attacker.form(
        "/signout", action=f"{url}/ui/signout", fields={"csrf": csrf}, host="127.0.0.1"
    )
    with page.expect_response(lambda r: r.url == f"{url}/ui/signout") as posted:
        page.goto(signout)
    assert posted.value.status == 403
    page.goto(f"{url}/ui/")
    assert urlparse(page.url).path == "/ui/", "the cross-origin sign-out took effect"
    assert page.locator("#runs").count() == 1

    other, _ = open_page()
    other.goto(f"{url}/ui/signin")  # the browser holds a ckpt_csrf cookie now
    signin = attacker.form(
        "/signin",
        action=f"{url}/ui/signin",
        fields={"token": target.token()["token"], "csrf": "guessed", "next": "/ui/"},
        host="localhost",
    )
    with other.expect_response(lambda r: r.url == f"{url}/ui/signin") as posted:
        other.goto(signin)
    assert posted.value.status == 403
    assert "ckpt_session" not in {cookie["name"] for cookie in other.context.cookies()}


def test_sign_in_refuses_a_wrong_token_and_never_leaves_the_site(
    open_page: OpenPage, target: Target
) -> None:
    url = target.server.url
    page, _ = open_page()
    page.goto(f"{url}/ui/signin")
    page.locator("input[name=token]").fill("not-a-token-0123456789")
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        page.locator("input[name=token]").press("Enter")
    assert posted.value.status == 401
    assert page.locator("form#signin input[name=token]").count() == 1
    assert "ckpt_session" not in {cookie["name"] for cookie in page.context.cookies()}

    token = target.token()["token"]
    for elsewhere in (
        "//example.com/ui/",
        "https://example.com/ui/",
        "/v1/tokens",
        "/\\example.com",
    ):
        page, _ = open_page()
        page.goto(f"{url}/ui/signin?next={quote(elsewhere, safe='')}")
        page.locator("input[name=token]").fill(token)
        with page.expect_navigation():
            page.locator("input[name=token]").press("Enter")
        assert page.url.startswith(f"{url}/ui/"), (elsewhere, page.url)


def test_the_session_cookie_is_httponly_strict_scoped_and_ends_at_sign_out(
    open_page: OpenPage, target: Target
) -> None:
    url = target.server.url
    token = target.token()["token"]
    page, seen = open_page()
    sign_in(page, url, token)
    cookies = {cookie["name"]: cookie for cookie in page.context.cookies()}
    session = cookies["ckpt_session"]
    assert session["httpOnly"] is True
    assert session["sameSite"] == "Strict"
    assert session["path"] == "/ui"
    assert session["secure"] is False  # plain HTTP here; Secure when the request is HTTPS
    assert "ckpt_session" not in page.evaluate("document.cookie")
    assert token not in page.content()
    assert not any(token in requested for requested in seen.requested)

    with page.expect_navigation():
        page.locator("form.signout button[type=submit]").click()
    assert urlparse(page.url).path == "/ui/signin"
    with httpx.Client(
        timeout=60, base_url=url, cookies={"ckpt_session": session["value"]}
    ) as client:
        assert client.get("/ui/").status_code == 303  # ended in the catalog, not just forgotten


def test_a_session_made_over_http_reads_pages_and_posts_need_the_csrf_field(
    target: Target,
) -> None:
    """The same rules for a client without a browser: no Origin, the CSRF field alone."""
    with signed_in_client(target.server.url, target.token()["token"]) as client:
        page = client.get("/ui/")
        assert page.status_code == 200
        refused = client.post("/ui/signout", data={"csrf": "wrong"})
        assert refused.status_code == 403
        assert client.get("/ui/").status_code == 200
        done = client.post("/ui/signout", data={"csrf": csrf_field(page.text)})
        assert done.status_code == 303
        assert client.get("/ui/").status_code == 303


def test_every_dashboard_response_carries_the_security_headers(target: Target) -> None:
    with signed_in_client(target.server.url, target.token()["token"]) as client:
        for path in [*target.pages(), "/ui/signin", "/ui/static/ui.css", "/ui/static/ui.js"]:
            headers = client.get(path).headers
            assert headers.get("content-security-policy") == CSP, path
            assert headers.get("x-content-type-options") == "nosniff", path
            assert headers.get("referrer-policy") == "no-referrer", path
        for path in target.pages():
            assert client.get(path).headers.get("cache-control") == "no-store", path


def _set_cookies(response: httpx.Response) -> SimpleCookie:
    jar: SimpleCookie = SimpleCookie()
    for header in response.headers.get_list("set-cookie"):
        jar.load(header)
    return jar


def test_the_cookies_are_secure_when_the_request_is_https(target: Target) -> None:
    """Behind a TLS proxy (``X-Forwarded-Proto: https`` from 127.0.0.1, which uvicorn
    trusts) both cookies are marked Secure."""
    https = {"X-Forwarded-Proto": "https"}
    with httpx.Client(timeout=60, base_url=target.server.url, headers=https) as client:
        form = client.get("/ui/signin")
        csrf = _set_cookies(form)["ckpt_csrf"]
        assert csrf["secure"] and csrf["httponly"] and csrf["samesite"].lower() == "strict"
        done = client.post(
            "/ui/signin",
            data={"token": target.token()["token"], "csrf": csrf_field(form.text)},
            headers={"Cookie": f"ckpt_csrf={csrf.value}"},
        )
        assert done.status_code == 303, done.text
        session = _set_cookies(done)["ckpt_session"]
        assert session["secure"] and session["httponly"] and session["path"] == "/ui"
