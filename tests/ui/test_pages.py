"""The dashboard over HTTP (no browser), on PostgreSQL and SQLite: sign-in and sessions,
CSRF, escaping, the security headers, what the pages show; and the lineage drawing, a pure
function, on its own."""

from __future__ import annotations

import re
import time
import uuid
from datetime import timedelta
from typing import Any

import httpx
import pytest

from ckpt.core.contract import Layer
from service import completeness
from service.models import Attempt, Bundle, Run, utcnow
from service.runs.activity import refresh_activity
from service.scrub.service import scrub
from service.ui import window
from service.ui.drawing import Hidden, Lane, Mark, Picture, draw_lineage
from service.ui.pages import _blob, missing_words
from tests.service.conftest import (  # noqa: F401 (fixtures server needs)
    MakeServer,
    Server,
    catalogs,
    make_server,
    pg_databases,
)
from tests.service.test_lineage_api import play
from tests.ui.conftest import CSP
from tests.ui.signin import csrf_field, signed_in_client

EVIL_RUN = "<img src=x onerror=alert(1)>"
EVIL_POD = "<script>alert(1)</script>"


@pytest.fixture(params=["postgres", "sqlite"])
def server(request: pytest.FixtureRequest, make_server: MakeServer) -> Server:  # noqa: F811
    """A fresh control plane on each database."""
    backend: str = request.param
    return make_server(backend)


@pytest.fixture
def run_name() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


def token(server: Server, role: str = "read", **body: Any) -> dict[str, Any]:
    with server.client() as client:
        response = client.post("/v1/tokens", json={"role": role, **body})
        assert response.status_code == 201, response.text
        created: dict[str, Any] = response.json()
        return created


def signin_form(client: httpx.Client) -> str:
    form = client.get("/ui/signin")
    assert form.status_code == 200, form.text
    return csrf_field(form.text)


def test_pages_need_a_session(server: Server) -> None:
    with httpx.Client(timeout=60, base_url=server.url) as client:
        assert client.get("/").headers["location"] == "/ui/"
        for path in (
            "/ui/",
            "/ui/runs/x",
            "/ui/runs/x/bundles/1",
            "/ui/runs/x/bundles/1/manifest.json",
        ):
            response = client.get(path)
            assert response.status_code == 303, path
            assert response.headers["location"].startswith("/ui/signin?next=%2Fui%2F")
        assert client.get("/ui/runs/x/live").status_code == 401


def test_sign_in_sets_a_strict_session_cookie(server: Server) -> None:
    secret = token(server)["token"]
    with httpx.Client(timeout=60, base_url=server.url) as client:
        csrf = signin_form(client)
        done = client.post("/ui/signin", data={"token": secret, "csrf": csrf, "next": "/ui/runs/a"})
        assert done.status_code == 303
        assert done.headers["location"] == "/ui/runs/a"
        cookie = done.headers["set-cookie"]
        assert cookie.startswith("ckpt_session=")
        flags = {part.strip().lower() for part in cookie.split(";")}
        assert {"httponly", "samesite=strict", "path=/ui"} <= flags
        assert "secure" not in flags  # plain HTTP
        page = client.get("/ui/")
        assert page.status_code == 200
        assert secret not in page.text and secret not in cookie


def test_no_redirect_to_another_site_after_sign_in(server: Server) -> None:
    with httpx.Client(timeout=60, base_url=server.url) as client:
        csrf = signin_form(client)
        for target in ("https://evil.example/", "//evil.example/ui/", "/ui/\\evil"):
            data = {"token": server.admin_token, "csrf": csrf, "next": target}
            assert client.post("/ui/signin", data=data).headers["location"] == "/ui/"


def test_sign_in_over_https_sets_a_secure_cookie(server: Server) -> None:
    # As behind a TLS proxy on loopback, which uvicorn trusts to say the scheme.
    https = {"X-Forwarded-Proto": "https"}
    with httpx.Client(timeout=60, base_url=server.url, headers=https) as client:
        form = client.get("/ui/signin")
        assert "secure" in form.headers["set-cookie"].lower()
        csrf = csrf_field(form.text)
        client.cookies.clear()  # httpx keeps Secure cookies from plain HTTP: send it by hand
        done = client.post(
            "/ui/signin",
            data={"token": server.admin_token, "csrf": csrf},
            headers={"Cookie": f"ckpt_csrf={csrf}"},
        )
        assert done.status_code == 303
        assert "secure" in done.headers["set-cookie"].lower()


def test_a_bad_token_gets_401_and_no_session(server: Server) -> None:
    with httpx.Client(timeout=60, base_url=server.url) as client:
        csrf = signin_form(client)
        refused = client.post("/ui/signin", data={"token": "ckpt_nope", "csrf": csrf})
        assert refused.status_code == 401
        assert "unknown or revoked token" in refused.text
        assert 'name="token"' in refused.text
        assert "ckpt_session" not in client.cookies
        assert client.get("/ui/").status_code == 303


def test_a_revoked_tokens_session_stops_working(server: Server) -> None:
    created = token(server)
    with signed_in_client(server.url, created["token"]) as browser:
        assert browser.get("/ui/").status_code == 200
        with server.client() as admin:
            assert admin.delete(f"/v1/tokens/{created['id']}").status_code == 200
        gone = browser.get("/ui/")
        assert gone.status_code == 303
        assert gone.headers["location"].startswith("/ui/signin")


def test_an_expired_tokens_session_stops_working(server: Server) -> None:
    created = token(server, expires_in_seconds=1)
    with signed_in_client(server.url, created["token"]) as browser:
        assert browser.get("/ui/").status_code == 200
        time.sleep(1.2)
        assert browser.get("/ui/").status_code == 303


def test_cross_site_forms_are_refused(server: Server) -> None:
    with signed_in_client(server.url, server.admin_token) as browser:
        csrf = csrf_field(browser.get("/ui/").text)
        foreign = {"Origin": "https://evil.example"}
        assert browser.post("/ui/signout", data={"csrf": csrf}, headers=foreign).status_code == 403
        assert browser.post("/ui/signout", data={}).status_code == 403
        assert browser.post("/ui/signout", data={"csrf": "forged"}).status_code == 403
        opaque = {"Origin": "null", "Sec-Fetch-Site": "cross-site"}
        assert browser.post("/ui/signout", data={"csrf": csrf}, headers=opaque).status_code == 403
        assert browser.get("/ui/").status_code == 200  # still signed in
        own = {"Origin": server.url}
        signed_out = browser.post("/ui/signout", data={"csrf": csrf}, headers=own)
        assert signed_out.status_code == 303
        assert browser.get("/ui/").status_code == 303
    with httpx.Client(timeout=60, base_url=server.url) as client:
        csrf = signin_form(client)
        data = {"token": server.admin_token, "csrf": csrf}
        refused = client.post("/ui/signin", data=data, headers={"Origin": "https://evil.example"})
        assert refused.status_code == 403
        assert client.post("/ui/signin", data={**data, "csrf": "x"}).status_code == 403


def plant_evil_run(server: Server) -> None:
    """A run and a pod named with markup, straight into the catalog (the API refuses them)."""
    now = utcnow()
    with server.context.transaction() as session:
        run = Run(name=EVIL_RUN, created_at=now, epoch=1)
        session.add(run)
        session.flush()
        attempt = Attempt(run_id=run.id, epoch=1, pod=EVIL_POD, node=EVIL_POD, started_at=now)
        session.add(attempt)
        session.flush()
        bundle = Bundle(
            run_id=run.id,
            attempt_id=attempt.id,
            step=5,
            world_size=1,
            status="quarantined",
            reason=EVIL_POD,
            created_at=now,
            versions={"ckpt": EVIL_POD},
        )
        session.add(bundle)
        session.flush()
        run.head_bundle_id = bundle.id
        refresh_activity(session, run_ids=[run.id])


def test_client_text_is_escaped_everywhere(server: Server) -> None:
    plant_evil_run(server)
    with signed_in_client(server.url, server.admin_token) as browser:
        runs = browser.get("/ui/")
        links = re.findall(r'href="(/ui/runs/[^"]+)"', runs.text)
        assert len(links) == 1
        run_page = browser.get(links[0])
        assert run_page.status_code == 200
        bundle_link = re.search(r'href="(/ui/runs/[^"]+/bundles/\d+)"', run_page.text)
        assert bundle_link
        bundle_page = browser.get(bundle_link.group(1).replace("&amp;", "&"))
        assert bundle_page.status_code == 200
        for page in (runs, run_page, bundle_page):
            assert EVIL_RUN not in page.text and "<img" not in page.text
            assert "<script>alert" not in page.text
            assert re.search(r"<script>|<script [^>]*>[^<]", page.text) is None  # no inline
            assert " style=" not in page.text
        assert "&lt;img src=x onerror=alert(1)&gt;" in runs.text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in run_page.text


def test_every_dashboard_response_carries_the_headers(server: Server) -> None:
    with signed_in_client(server.url, server.admin_token) as browser:
        for path in (
            "/ui/signin",
            "/ui/",
            "/ui/runs/none",
            "/ui/static/ui.js",
            "/ui/static/ui.css",
        ):
            response = browser.get(path)
            assert response.headers["content-security-policy"] == CSP, path
            assert response.headers["x-content-type-options"] == "nosniff"
            assert response.headers["referrer-policy"] == "no-referrer"
        assert browser.get("/ui/").headers["cache-control"] == "no-store"
        assert browser.get("/ui/runs/none").status_code == 404


def plant_runs(server: Server, count: int) -> None:
    """``count`` runs, each with one attempt: every third still training, the rest lost."""
    start = utcnow() - timedelta(hours=1)
    with server.context.transaction() as session:
        for i in range(count):
            at = start + timedelta(seconds=i)
            run = Run(name=f"page-{i:03d}", created_at=at, epoch=1)
            session.add(run)
            session.flush()
            ended = None if i % 3 == 0 else at
            reason = None if i % 3 == 0 else "lost"
            session.add(
                Attempt(run_id=run.id, epoch=1, started_at=at, ended_at=ended, end_reason=reason)
            )
            refresh_activity(session, run_ids=[run.id])


def rows(html: str) -> list[str]:
    return re.findall(r'<tr data-run="([^"]+)"', html)


def test_the_runs_page_filters_sorts_and_pages(server: Server) -> None:
    plant_runs(server, 60)
    with signed_in_client(server.url, server.admin_token) as browser:
        first = browser.get("/ui/").text
        assert rows(first) == [f"page-{i:03d}" for i in range(59, 9, -1)]  # newest first
        assert 'rel="next"' in first and 'rel="prev"' not in first
        second = browser.get("/ui/?page=2").text
        assert rows(second) == [f"page-{i:03d}" for i in range(9, -1, -1)]
        assert 'rel="prev"' in second and 'rel="next"' not in second
        training = rows(browser.get("/ui/?state=training").text)
        assert training == [f"page-{i:03d}" for i in range(57, -1, -3)]
        assert rows(browser.get("/ui/?prefix=page-05").text) == [
            f"page-{i:03d}" for i in range(59, 49, -1)
        ]
        assert rows(browser.get("/ui/?prefix=page-05&state=lost").text)[:2] == [
            "page-059",
            "page-058",
        ]


def cell(html: str, run: str, column: str) -> str:
    row = html.split(f'<tr data-run="{run}">', 1)[1].split("</tr>", 1)[0]
    found = re.search(rf'data-col="{column}"[^>]*>(.*?)</td>', row, re.S)
    assert found, (run, column)
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def test_the_pages_show_the_lineage_the_api_reports(server: Server, run_name: str) -> None:
    played = play(server, run_name)
    with server.client() as api:
        run = api.get(f"/v1/runs/{run_name}").json()
    with signed_in_client(server.url, server.admin_token) as browser:
        runs = browser.get("/ui/").text
        assert cell(runs, run_name, "steps_lost") == str(run["steps_lost_total"])
        assert cell(runs, run_name, "resumable_step") == str(played.resumable["step"])
        assert cell(runs, run_name, "attempts") == "5"
        assert cell(runs, run_name, "preemptions") == "3"
        page = browser.get(f"/ui/runs/{run_name}").text
    lanes = re.findall(
        r'<g class="lane" data-epoch="(\d+)" data-attempt="\d+" data-ended="(\w+)"', page
    )
    assert [epoch for epoch, _ in lanes] == ["1", "2", "3", "4", "6"]
    assert [ended for _, ended in lanes][:3] == ["preempted"] * 3
    ids = played.ids
    branch = dict(re.findall(r'data-key="bundle-(\d+)"[^>]*data-branch="(\w+)"', page))
    assert branch[str(ids["70"])] == "abandoned" and branch[str(ids["50'"])] == "live"
    assert branch[str(ids["30"])] == "live" and branch[str(ids["40"])] == "abandoned"
    status = dict(re.findall(r'data-key="bundle-(\d+)"[^>]*data-status="(\w+)"', page))
    assert status[str(ids["60"])] == "pending"
    head = ids["50'"]
    assert f'<g class="head" data-key="bundle-{head}">' in page
    edges = re.findall(r'class="resume-edge" data-from="bundle-(\d+)" data-to-epoch="(\d+)"', page)
    assert (str(ids["30"]), "6") in edges
    assert len(re.findall(r'<tr data-epoch="\d+"', page)) == 5
    assert page.count('class="series"') == 5  # stall, tax, persist, throughput, new bytes


def test_steps_lost_to_a_lost_attempt_show_as_at_least(server: Server, run_name: str) -> None:
    # Epoch 1 was marked lost at step 14 (its last heartbeat); epoch 2 started fresh.
    at = utcnow() - timedelta(hours=1)
    with server.context.transaction() as session:
        run = Run(name=run_name, created_at=at, epoch=2)
        session.add(run)
        session.flush()
        session.add(
            Attempt(
                run_id=run.id, epoch=1, started_at=at, ended_at=at, end_reason="lost", last_step=14
            )
        )
        session.add(Attempt(run_id=run.id, epoch=2, started_at=at, last_step=3))
        session.flush()
        refresh_activity(session, run_ids=[run.id])
    with server.client() as api:
        assert api.get(f"/v1/runs/{run_name}").json()["steps_lost_total_exact"] is False
    with signed_in_client(server.url, server.admin_token) as browser:
        assert cell(browser.get("/ui/").text, run_name, "steps_lost") == "≥ 14"
        page = browser.get(f"/ui/runs/{run_name}").text
    summary = re.search(r'<dd data-col="steps_lost">(.*?)</dd>', page)
    assert summary and summary.group(1) == "≥ 14"
    row = page.split('<tr data-epoch="1" ', 1)[1].split("</tr>", 1)[0]
    assert re.search(r'data-col="steps_lost" class="num">≥ 14</td>', row)
    assert "<title>at least 14 steps lost when attempt 1 ended (lost)" in page


def test_the_bundle_page(server: Server, run_name: str) -> None:
    played = play(server, run_name)
    head, pending = played.ids["50'"], played.ids["60"]
    with signed_in_client(server.url, server.admin_token) as browser:
        page = browser.get(f"/ui/runs/{run_name}/bundles/{head}").text
        assert len(re.findall(r'data-state="recorded"', page)) == 6
        # A commit checks sizes; the scrubber's read-back verifies the bytes.
        assert re.search(r'<tr data-sha="[0-9a-f]{64}" data-state="size-checked"', page)
        assert not re.search(r'data-state="verified"', page)
        scrub(server.context)
        scrubbed = browser.get(f"/ui/runs/{run_name}/bundles/{head}").text
        assert not re.search(r'data-state="size-checked"', scrubbed)
        assert re.search(r'<tr data-sha="[0-9a-f]{64}" data-state="verified"', scrubbed)
        assert f"CKPT_RUN={run_name}" in page and 'id="resume-command"' in page
        assert f"CKPT_FROM_RUN={run_name} CKPT_FROM_STEP=50 ckpt launch" in page
        manifest = browser.get(f"/ui/runs/{run_name}/bundles/{head}/manifest.json")
        with server.client() as api:
            assert manifest.json() == api.get(f"/v1/bundles/{head}").json()["manifest"]
        waiting = browser.get(f"/ui/runs/{run_name}/bundles/{pending}").text
        assert 'data-state="missing"' in waiting and 'id="missing"' in waiting
        other = browser.get(f"/ui/runs/{run_name}/bundles/{played.ids['30']}").text
        assert "/rollback" in other  # an older bundle: roll back to it first


def test_a_long_run_is_drawn_as_a_window(
    server: Server, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    play(server, run_name)
    monkeypatch.setattr(window, "MAX_LANES", 3)
    monkeypatch.setattr(window, "WINDOW_LANES", 2)
    with signed_in_client(server.url, server.admin_token) as browser:
        page = browser.get(f"/ui/runs/{run_name}").text
    assert re.findall(r'<g class="lane" data-epoch="(\d+)"', page) == ["4", "6"]
    assert '<g class="lane-summary" data-count="3">' in page
    assert 'id="window-note"' in page


# The drawing alone: a pure function of plain data.


def picture(**overrides: Any) -> Picture:
    lanes = [
        Lane(attempt_id=1, epoch=1, start_step=0, last_step=27, ended="preempted", steps_lost=7),
        Lane(
            attempt_id=2, epoch=2, start_step=20, last_step=45, ended="running", resumed_from_id=11
        ),
    ]
    marks = [
        Mark(id=10, step=10, status="complete", attempt_id=1),
        Mark(id=11, step=20, status="complete", attempt_id=1, pinned=True),
        Mark(id=12, step=30, status="quarantined", attempt_id=2, live=False),
        Mark(id=13, step=40, status="deleted", attempt_id=2),
    ]
    values: dict[str, Any] = {"run": "r", "lanes": lanes, "marks": marks, "head_id": 13}
    return Picture(**{**values, **overrides})


def test_one_lane_per_attempt_with_its_bundles() -> None:
    svg = draw_lineage(picture())
    assert re.findall(
        r'<g class="lane" data-epoch="(\d)" data-attempt="\d" data-ended="(\w+)">', svg
    ) == [
        ("1", "preempted"),
        ("2", "running"),
    ]
    lane_two = svg.split('data-epoch="2"', 1)[1]
    assert 'data-key="bundle-12"' in lane_two and 'data-key="bundle-10"' not in lane_two
    assert 'data-key="bundle-11" data-step="20" data-status="complete" data-pinned="true"' in svg
    assert 'data-key="bundle-13" data-step="40" data-status="collected"' in svg
    assert '<g class="head" data-key="bundle-13">' in svg


def test_fork_and_resume_edge_and_lost_steps() -> None:
    svg = draw_lineage(picture())
    assert re.search(r'data-key="bundle-12"[^>]*data-branch="abandoned"', svg)
    assert re.search(r'data-key="bundle-11"[^>]*data-branch="live"', svg)
    assert '<path class="resume-edge" data-from="bundle-11" data-to-epoch="2"' in svg
    assert '<rect class="lost" data-epoch="1" data-attempt="1" data-steps="7"' in svg
    assert 'class="lost" data-epoch="2"' not in svg  # still running: nothing lost yet


def test_a_window_sums_up_what_it_leaves_out() -> None:
    svg = draw_lineage(picture(hidden=Hidden(lanes=998, bundles=9000)))
    assert '<g class="lane-summary" data-count="998">' in svg
    assert "998 older attempts and 9000 bundles are not drawn" in svg
    assert "lane-summary" not in draw_lineage(picture())


def test_the_drawing_escapes_names() -> None:
    svg = draw_lineage(picture(run=EVIL_RUN))
    assert EVIL_RUN not in svg
    assert "/ui/runs/%3Cimg%20src%3Dx%20onerror%3Dalert%281%29%3E/bundles/10" in svg


def test_what_a_pending_bundle_misses_in_words() -> None:
    recorded = {(0, Layer.WEIGHTS)}
    missing = completeness.missing_layers(world_size=2, recorded=recorded)
    assert missing_words(missing) == (
        "rank 0: optimizer, scheduler, rng, data, counters; rank 1: all six layers"
    )


def test_the_run_page_shows_the_notice_an_attempt_read(server: Server, run_name: str) -> None:
    with server.client() as api:
        quiet = api.post(f"/v1/runs/{run_name}/attempts", json={}).json()["attempt_id"]
        noticed = api.post(f"/v1/runs/{run_name}/attempts", json={}).json()["attempt_id"]
        notice = {"cloud": "aws", "kind": "instance-action", "detail": "terminate <b>now</b>"}
        api.post(f"/v1/attempts/{noticed}/notice", json=notice).raise_for_status()
    assert quiet != noticed
    with signed_in_client(server.url, server.admin_token) as browser:
        page = browser.get(f"/ui/runs/{run_name}").text

    def notice_cell(epoch: int) -> str:
        row = page.split(f'<tr data-epoch="{epoch}" ', 1)[1].split("</tr>", 1)[0]
        found = re.search(r'data-col="notice">(.*?)</td>', row, re.S)
        assert found, row
        return found.group(1)

    assert notice_cell(1) == "—"
    shown = notice_cell(2)
    assert shown.startswith("aws instance-action: terminate &lt;b&gt;now&lt;/b&gt;, ")
    assert "<b>" not in shown


def test_the_run_page_shows_each_attempts_goodput_and_chosen_interval(
    server: Server, run_name: str
) -> None:
    with server.client() as api:
        first = api.post(f"/v1/runs/{run_name}/attempts", json={}).json()["attempt_id"]
        time = {"restart_seconds": 20.0, "stall_seconds": 5.0, "train_seconds": 75.0}
        beat = {"step": 40, "time": {**time, "steps_trained": 40}}
        beat |= {"interval_seconds": 750.0, "waste_seconds_per_hour": 90.0}
        api.post(f"/v1/attempts/{first}/heartbeat", json=beat).raise_for_status()
        # Preempted with no bundle: its 40 steps are lost, so nothing it trained counted.
        end = {"reason": "preempted", "step": 40, "time": {**time, "steps_trained": 40}}
        api.post(f"/v1/attempts/{first}/end", json=end).raise_for_status()
        api.post(f"/v1/runs/{run_name}/attempts", json={}).raise_for_status()
    with signed_in_client(server.url, server.admin_token) as browser:
        page = browser.get(f"/ui/runs/{run_name}").text

    def cell(epoch: int, column: str) -> str:
        row = page.split(f'<tr data-epoch="{epoch}" ', 1)[1].split("</tr>", 1)[0]
        found = re.search(rf'data-col="{column}"[^>]*>(.*?)</td>', row, re.S)
        assert found, row
        return found.group(1)

    assert (cell(1, "goodput"), cell(1, "interval")) == ("0.0%", "12.5 min")
    assert 'title="expected loss 1.5 min per hour"' in page
    assert (cell(2, "goodput"), cell(2, "interval")) == ("—", "—")


def test_a_blob_many_layers_share_names_the_first_and_counts_the_rest() -> None:
    held = [f"rank {rank} weights" for rank in range(8)]
    blob = _blob("a" * 64, 10, None, layers=held)
    assert blob.layers == tuple(held[:6]) and blob.more_layers == 2
    assert blob.state == "unknown"
