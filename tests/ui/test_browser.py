"""The dashboard in a real browser, on a catalog made by real agent saves.

The module's catalog: a real ``ckpt server`` and the demo trainer, run four times on the
run ``lineage`` (saving every 4 steps): attempt 1 is preempted (SIGTERM at 6.1: it saves
step 6 and reports its end), attempt 2 resumes from 6 and is SIGKILLed at 11.2 after a
long step (its heartbeats said step 11; the server marks it lost, and its successor's
resume from 8 makes 3 steps lost), attempt 3 resumes from 8 and finishes at 16. Then an
admin quarantines attempt 3's bundle of step 12 and rolls the run back to step 8: attempt 4
(epoch 5: the rollback took epoch 4) resumes from 8 and finishes at 20, so attempt 3's
bundles are an abandoned branch. 51 empty runs (``bulk-NN``, older) fill a second page of
the runs page.

Every page is checked against the DOM the dashboard promises (data-* attributes), and
against the API's lineage of the same run; screenshots are left in the test's tmp folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from sqlalchemy import create_engine

from agent.attempt.signals import EXIT_PREEMPTED
from ckpt.core.storage import DirectoryStore
from service.db import upgrade
from tests.conftest import run_trainer
from tests.server_process import ServerProcess, ckpt_server
from tests.service.helpers import register, save
from tests.ui.conftest import CSP, OpenPage, poll, screenshot, sign_in
from tests.ui.seed import Shape, seed

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = [pytest.mark.slow, pytest.mark.browser]

RUN = "lineage"
TRAIN = ("--run", RUN, "--total-steps", "24", "--every", "4", "--workers", "0")
BULK = 51
# By epoch: the rollback took epoch 4, so attempt 4 has epoch 5.
ENDED = {1: "preempted", 2: "lost", 3: "finished", 5: "finished"}
PODS = {1: "pod-1", 2: "pod-2", 3: "pod-3", 5: "pod-4"}


@dataclass(frozen=True)
class Catalog:
    server: ServerProcess
    token: str  # a read token: enough to sign in
    lineage: dict[str, Any]  # GET /v1/runs/lineage/lineage once the scenario is done
    run: dict[str, Any]  # GET /v1/runs/lineage
    quarantined: int  # the bundle an admin quarantined

    def bundle(self, *, epoch: int, step: int) -> dict[str, Any]:
        attempt = next(a for a in self.lineage["attempts"] if a["epoch"] == epoch)
        return next(
            b
            for b in self.lineage["bundles"]
            if b["attempt_id"] == attempt["id"] and b["step"] == step
        )


def train(server: ServerProcess, root: Path, pod: str, *args: str, expect_rc: int = 0) -> None:
    """One attempt of the demo trainer on ``lineage``, as pod ``pod``."""
    env = {
        **server.env(),
        "CKPT_POD": pod,
        "CKPT_NODE": "node-a",
        "CKPT_HEARTBEAT_SECONDS": "0.3",
        "CKPT_QUIET": "1",
    }
    run_trainer(server.store, root / f"{pod}.pt", *TRAIN, *args, expect_rc=expect_rc, env=env)


def last_attempt(client: httpx.Client) -> dict[str, Any]:
    attempts: list[dict[str, Any]] = client.get(f"/v1/runs/{RUN}/lineage").json()["attempts"]
    return attempts[-1]


def make_catalog(server: ServerProcess, root: Path, client: httpx.Client) -> Catalog:
    for index in range(BULK):
        client.post("/v1/runs", json={"name": f"bulk-{index:02d}"}).raise_for_status()
    train(server, root, "pod-1", "--steps", "20", "--signal-at", "6.1", expect_rc=EXIT_PREEMPTED)
    train(
        server,
        root,
        "pod-2",
        "--steps",
        "20",
        "--pause-at",
        "11.1:2",
        "--kill-at",
        "11.2",
        expect_rc=-9,
    )
    poll(lambda: last_attempt(client)["end_reason"] == "lost", what="attempt 2 marked lost")
    train(server, root, "pod-3", "--steps", "16")
    partial = Catalog(server, "", client.get(f"/v1/runs/{RUN}/lineage").json(), {}, 0)
    quarantined = partial.bundle(epoch=3, step=12)["id"]
    client.post(
        f"/v1/bundles/{quarantined}/quarantine", json={"reason": "a drill: quarantined by hand"}
    ).raise_for_status()
    back_to = partial.bundle(epoch=2, step=8)["id"]
    client.post(f"/v1/runs/{RUN}/rollback", json={"bundle_id": back_to}).raise_for_status()
    train(server, root, "pod-4", "--steps", "20")
    token = client.post("/v1/tokens", json={"role": "read", "name": "dashboard"}).json()["token"]
    return Catalog(
        server=server,
        token=token,
        lineage=client.get(f"/v1/runs/{RUN}/lineage").json(),
        run=client.get(f"/v1/runs/{RUN}").json(),
        quarantined=quarantined,
    )


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Catalog]:
    root = tmp_path_factory.mktemp("dashboard")
    # Lost after 4 s without a heartbeat, so that the SIGKILLed attempt is marked lost soon.
    env = {"CKPT_LOST_AFTER_SECONDS": "4"}
    with ckpt_server(root, env=env) as server, server.client() as client:
        yield make_catalog(server, root, client)


def signed_in(open_page: OpenPage, catalog: Catalog, start: str) -> tuple[Page, Any]:
    page, seen = open_page()
    sign_in(page, catalog.server.url, catalog.token, start=start)
    return page, seen


def cell(page: Page, row: str, column: str) -> str:
    return page.locator(f'{row} [data-col="{column}"]').inner_text().strip()


def test_sign_in_and_walk_from_the_runs_to_a_run_to_a_bundle(
    open_page: OpenPage, catalog: Catalog, screenshots: Path
) -> None:
    from playwright.sync_api import expect

    url = catalog.server.url
    page, seen = open_page()
    documents: list[Any] = []
    page.on(
        "response",
        lambda response: (
            documents.append(response) if response.request.resource_type == "document" else None
        ),
    )
    sign_in(page, url, catalog.token)
    row = page.locator(f'#runs tr[data-run="{RUN}"]')
    expect(row).to_be_visible()
    screenshot(page, screenshots, "runs")
    with page.expect_navigation():
        row.locator('[data-col="name"] a').click()
    expect(page).to_have_url(f"{url}/ui/runs/{RUN}")
    expect(page.locator("svg#lineage g.lane")).to_have_count(len(ENDED))
    screenshot(page, screenshots, "run")
    head = catalog.lineage["head_id"]
    with page.expect_navigation():
        page.locator(f'svg#lineage a.bundle[data-key="bundle-{head}"]').click()
    expect(page.locator('#bundle [data-col="step"]')).to_have_text("20")
    screenshot(page, screenshots, "bundle")
    seen.assert_clean()
    assert not any(catalog.token in requested for requested in seen.requested)
    assert catalog.token not in page.content()
    assert documents, "no page was loaded"
    for response in documents:
        headers = response.headers
        assert headers.get("content-security-policy") == CSP, response.url
        assert headers.get("x-content-type-options") == "nosniff", response.url
        assert headers.get("referrer-policy") == "no-referrer", response.url


def total_lost(run: dict[str, Any]) -> str:
    """A run's steps lost as the pages write them: "≥ 3" where a lost attempt makes the
    figure a lower bound (the catalog's SIGKILLed attempt does)."""
    return ("" if run["steps_lost_total_exact"] else "≥ ") + str(run["steps_lost_total"])


def test_the_runs_page_shows_each_runs_figures_filters_and_pages(
    open_page: OpenPage, catalog: Catalog
) -> None:
    from playwright.sync_api import expect

    page, seen = signed_in(open_page, catalog, "/ui/")
    rows = page.locator("#runs tr[data-run]")
    expect(rows).to_have_count(50)
    assert rows.first.get_attribute("data-run") == RUN  # the most recently active
    row = f'#runs tr[data-run="{RUN}"]'
    assert cell(page, row, "state") == "finished"
    assert cell(page, row, "attempts") == "4"
    assert cell(page, row, "preemptions") == "1"
    assert cell(page, row, "head_step") == "20"
    assert cell(page, row, "resumable_step") == "20"
    assert cell(page, row, "steps_lost") == total_lost(catalog.run)
    for column in ("resumable_age", "steps_kept", "bytes_stored", "dedup_saving"):
        assert cell(page, row, column), column
    assert page.locator(f'{row} [data-col="name"] a').get_attribute("href") == f"/ui/runs/{RUN}"

    with page.expect_navigation():
        page.locator("a[rel=next]").click()
    expect(rows).to_have_count(BULK + 1 - 50)
    with page.expect_navigation():
        page.locator("a[rel=prev]").click()
    expect(rows).to_have_count(50)

    page.locator("#filter [name=prefix]").fill("bulk-0")
    with page.expect_navigation():
        page.locator("#filter [name=prefix]").press("Enter")
    expect(rows).to_have_count(10)
    assert all(name.startswith("bulk-0") for name in _names(page))
    page.goto(f"{catalog.server.url}/ui/?state=finished")
    assert _names(page) == [RUN]
    page.goto(f"{catalog.server.url}/ui/?state=training")
    assert _names(page) == []
    seen.assert_clean()


def _names(page: Page) -> list[str]:
    names: list[str] = page.locator("#runs tr[data-run]").evaluate_all(
        "rows => rows.map(row => row.dataset.run)"
    )
    return names


def test_the_run_page_draws_every_attempt_the_fork_the_quarantine_and_the_loss(
    open_page: OpenPage, catalog: Catalog, screenshots: Path
) -> None:
    page, seen = signed_in(open_page, catalog, f"/ui/runs/{RUN}")
    lineage = catalog.lineage
    lanes = _attributes(page, "svg#lineage g.lane", "epoch", "ended")
    assert {int(lane["epoch"]): lane["ended"] for lane in lanes} == ENDED
    marks = {
        m["key"]: m
        for m in _attributes(
            page, "svg#lineage a.bundle", "key", "step", "status", "branch", "pinned"
        )
    }
    expected = {
        f"bundle-{b['id']}": {
            "key": f"bundle-{b['id']}",
            "step": str(b["step"]),
            "status": b["status"],
            "branch": "live" if b["live"] else "abandoned",
            "pinned": "false",
        }
        for b in lineage["bundles"]
    }
    assert marks == expected
    abandoned = {key for key, mark in marks.items() if mark["branch"] == "abandoned"}
    assert abandoned == {f"bundle-{catalog.bundle(epoch=3, step=step)['id']}" for step in (12, 16)}
    assert marks[f"bundle-{catalog.quarantined}"]["status"] == "quarantined"
    assert [m for m in marks.values() if m["status"] == "quarantined"] == [
        marks[f"bundle-{catalog.quarantined}"]
    ]
    edges = _attributes(page, "svg#lineage path.resume-edge", "from", "toEpoch")
    epochs = {a["id"]: a["epoch"] for a in lineage["attempts"]}
    assert sorted((e["from"], int(e["toEpoch"])) for e in edges) == sorted(
        (f"bundle-{e['bundle']}", epochs[e["attempt"]]) for e in lineage["resume_edges"]
    )
    losses = _attributes(page, "svg#lineage rect.lost", "epoch", "steps")
    lost = {a["epoch"]: a["steps_lost"] for a in lineage["attempts"] if a["steps_lost"]}
    assert {int(r["epoch"]): int(r["steps"]) for r in losses} == lost
    assert lost[2] == 3  # SIGKILLed at 11.2 after a heartbeat at 11; resumed from 8
    head = page.locator("svg#lineage g.head")
    assert head.get_attribute("data-key") == f"bundle-{lineage['head_id']}"
    titles = page.locator("svg#lineage a.bundle > title").evaluate_all(
        "titles => titles.map(t => t.textContent.trim())"
    )
    assert len(titles) == len(expected) and all(titles)
    assert page.locator("svg#lineage a.bundle:not([tabindex='0'])").count() == 0
    assert page.locator("body").get_attribute("data-live") is None  # nothing runs
    screenshot(page, screenshots, "run-lineage")
    _docs_screenshot(page)
    seen.assert_clean()


def _attributes(page: Page, selector: str, *names: str) -> list[dict[str, str]]:
    found: list[dict[str, str]] = page.locator(selector).evaluate_all(
        "(nodes, names) => nodes.map(n => Object.fromEntries(names.map(k => [k, n.dataset[k]])))",
        list(names),
    )
    return found


def _docs_screenshot(page: Page) -> None:
    """With CKPT_DOCS_SCREENSHOT=PATH, the run page's screenshot for the README goes there."""
    target = os.environ.get("CKPT_DOCS_SCREENSHOT")
    if target:
        page.screenshot(path=target)
        print(f"screenshot for the docs: {target}")


def test_the_run_page_tables_the_attempts_the_save_figures_and_the_summary(
    open_page: OpenPage, catalog: Catalog
) -> None:
    page, seen = signed_in(open_page, catalog, f"/ui/runs/{RUN}")
    rows = page.locator("#attempts tr[data-epoch]")
    assert rows.count() == len(ENDED)
    for attempt in catalog.lineage["attempts"]:
        row = f'#attempts tr[data-epoch="{attempt["epoch"]}"]'
        assert cell(page, row, "pod") == PODS[attempt["epoch"]]
        assert cell(page, row, "node") == "node-a"
        assert ENDED[attempt["epoch"]] in cell(page, row, "reason")
        for column in ("started", "ended"):
            assert cell(page, row, column), (row, column)
        if attempt["steps_lost"]:
            exact = "" if attempt["steps_lost_exact"] else "≥ "  # lost: a lower bound
            assert cell(page, row, "steps_lost") == f"{exact}{attempt['steps_lost']}"
    series = _attributes(page, "svg#saves polyline.series", "series")
    assert [s["series"] for s in series] == ["stall", "tax", "persist", "throughput", "new_bytes"]
    for polyline in page.locator("svg#saves polyline.series").all():
        assert (polyline.get_attribute("points") or "").strip()
    summary = "#summary"
    assert cell(page, summary, "state") == "finished"
    assert cell(page, summary, "head_step") == "20"
    assert cell(page, summary, "resumable_step") == "20"
    assert cell(page, summary, "steps_lost") == total_lost(catalog.run)
    assert cell(page, summary, "goodput")
    assert cell(page, summary, "steps_kept")
    seen.assert_clean()


def test_the_bundle_page_shows_completeness_blobs_figures_manifest_and_resume_command(
    open_page: OpenPage, catalog: Catalog, screenshots: Path
) -> None:
    page, seen = signed_in(open_page, catalog, f"/ui/runs/{RUN}")
    head = catalog.lineage["head_id"]
    href = page.locator(f'svg#lineage a.bundle[data-key="bundle-{head}"]').get_attribute("href")
    assert href and href.startswith(f"/ui/runs/{RUN}/bundles/")
    page.goto(catalog.server.url + href)
    summary = "#bundle"
    assert cell(page, summary, "status") == "complete"
    assert cell(page, summary, "step") == "20"
    assert "5" in cell(page, summary, "attempt")  # attempt 4 has epoch 5
    assert "torch" in cell(page, summary, "versions")
    layers = page.locator('#completeness tr[data-rank="0"] td[data-layer]')
    assert sorted(layers.evaluate_all("cells => cells.map(c => c.dataset.layer)")) == sorted(
        ["weights", "optimizer", "scheduler", "rng", "data", "counters"]
    )
    assert set(layers.evaluate_all("cells => cells.map(c => c.dataset.state)")) == {"recorded"}
    assert page.locator("#completeness tr[data-rank]").count() == 1
    blobs = page.locator("#blobs tr[data-sha]")
    assert blobs.count() > 0
    for sha in blobs.evaluate_all("rows => rows.map(r => r.dataset.sha)"):
        assert len(sha) == 64 and int(sha, 16) >= 0
    assert page.locator("#blobs tr[data-sha]:not([data-state])").count() == 0
    assert page.locator("#figures tr[data-rank]").count() == 1
    command = page.locator("#resume-command").inner_text()
    assert command.strip() and "ckpt" in command
    manifest_href = page.locator("a#manifest").get_attribute("href")
    assert manifest_href
    manifest = page.request.get(catalog.server.url + manifest_href)
    assert manifest.status == 200
    assert manifest.json()["step"] == 20
    screenshot(page, screenshots, "bundle-head")

    page.goto(f"{catalog.server.url}/ui/runs/{RUN}")
    page.locator(f'svg#lineage a.bundle[data-key="bundle-{catalog.quarantined}"]').focus()
    with page.expect_navigation():
        page.keyboard.press("Enter")  # a mark opens from the keyboard too
    assert cell(page, summary, "status").startswith("quarantined")
    assert "a drill: quarantined by hand" in page.locator("main").inner_text()
    seen.assert_clean()


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[tuple[ServerProcess, httpx.Client, dict[str, Any]]]:
    """A run whose attempt (registered over the API) still runs, with three bundles."""
    with ckpt_server(tmp_path) as server, server.client() as client:
        attempt = register(client, "live", pod="pod-live")
        for step in (10, 20, 30):
            save(client, DirectoryStore(server.store), "live", attempt, step=step)
        beat = client.post(f"/v1/attempts/{attempt['attempt_id']}/heartbeat", json={"step": 35})
        beat.raise_for_status()
        yield server, client, attempt


def test_a_running_run_refreshes_on_its_own_keeping_scroll_and_focus(
    open_page: OpenPage, live_run: tuple[ServerProcess, httpx.Client, dict[str, Any]]
) -> None:
    server, client, attempt = live_run
    token = client.post("/v1/tokens", json={"role": "read"}).json()["token"]
    page, seen = open_page(width=900, height=300)  # short: the page scrolls
    sign_in(page, server.url, token, start="/ui/runs/live")
    assert page.locator("body").get_attribute("data-live")
    assert page.locator('svg#lineage g.lane[data-epoch="1"]').get_attribute("data-ended") == (
        "running"
    )
    mark = page.locator("svg#lineage a.bundle").nth(1)
    key = mark.get_attribute("data-key")
    mark.focus()
    page.evaluate("window.scrollTo(0, 120)")
    page.evaluate("window.ckptTestMark = true")
    scrolled = page.evaluate("window.scrollY")
    assert scrolled > 0

    ended = client.post(
        f"/v1/attempts/{attempt['attempt_id']}/end",
        json={"reason": "preempted", "final_save_committed": True, "step": 36},
    )
    ended.raise_for_status()
    page.wait_for_selector('svg#lineage g.lane[data-epoch="1"][data-ended="preempted"]')
    assert page.evaluate("window.ckptTestMark") is True  # swapped in place, not reloaded
    assert page.evaluate("window.scrollY") == scrolled
    assert page.evaluate("document.activeElement && document.activeElement.dataset.key") == key
    seen.assert_clean()


LONG = Shape(runs=0, big_attempts=1_000, big_bundles=10_000)


@pytest.fixture
def long_run(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server whose catalog holds one run of 1,000 attempts and 10,000 bundles (written
    in bulk: tests/ui/seed.py), still training."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    upgrade(url)
    engine = create_engine(url)  # foreign keys not enforced while rows go in
    seed(engine, LONG)
    engine.dispose()
    env = {"CKPT_LOST_AFTER_SECONDS": "1000000"}
    with ckpt_server(tmp_path, database_url=url, env=env) as server:
        yield server


def test_a_run_of_a_thousand_attempts_draws_a_window_and_a_summary(
    open_page: OpenPage, long_run: ServerProcess, screenshots: Path
) -> None:
    page, seen = open_page()
    sign_in(page, long_run.url, long_run.token, start=f"/ui/runs/{LONG.big_run}")
    lanes = page.locator("svg#lineage g.lane").count()
    marks = page.locator("svg#lineage a.bundle").count()
    assert 0 < lanes <= 300
    assert 0 < marks <= 3_000
    summary = page.locator("svg#lineage g.lane-summary")
    assert summary.count() == 1
    assert lanes + int(summary.get_attribute("data-count") or 0) == LONG.big_attempts
    epochs = page.locator("svg#lineage g.lane").evaluate_all(
        "lanes => lanes.map(lane => Number(lane.dataset.epoch))"
    )
    assert max(epochs) == LONG.big_attempts  # the newest lanes are the ones drawn
    loaded = page.evaluate("performance.getEntriesByType('navigation')[0].duration")
    print(f"the run page of {LONG.big_attempts} attempts loaded in {loaded:.0f} ms")
    assert loaded < 5_000
    screenshot(page, screenshots, "run-long")
    seen.assert_clean()
