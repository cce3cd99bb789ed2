"""The run page's picture and the bundle page in a real browser (Debian's Chromium): the
legend drawn by the code that draws the marks, attempts named as attempts, steps lost on
the lane that lost them, sizes and contrast a laptop screen reads at a glance, attempt
states as they stand, per-layer sizes, and pages that fit 1280 px.

The module's run ``picture``, written over the API (real saves into the server's store):

attempt 1 (epoch 1)  10 ── 20q ── 30                 preempted at 34 (resumed from: 30)
attempt 2 (epoch 2)              └─ 40 ── (45)       still running when attempt 3 registers
attempt 3 (epoch 3)                   └─ 50          preempted at 66; then a rollback to 30
attempt 4 (epoch 5)          30 ── 40' ── 50' ── 60'  finished, its end report says nothing
                                                      of its final save

Bundle 20 is quarantined by an admin, 10 pinned, 45 never commits (pending); 40, 45 and 50
are left on an abandoned branch by the rollback. Attempt 3 read a 200-character notice.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from ckpt.core.storage import DirectoryStore
from service.ui import palette
from tests.server_process import ServerProcess, ckpt_server
from tests.service.helpers import open_bundle, register, save
from tests.ui.conftest import OpenPage, screenshot, sign_in

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = [pytest.mark.slow, pytest.mark.browser]

RUN = "picture"
NOTICE = ("terminate-at-2026-12-03T18:00:00Z;" * 6)[:200]  # no space to break at
LANE_PITCH_MIN = 36  # px between lanes at 1280 px
MARK_MIN = 12  # px across a bundle's mark
REVIEW = Path("/tmp")  # where a copy of the screenshots goes for a person to look at


@dataclass(frozen=True)
class Catalog:
    server: ServerProcess
    token: str
    ids: dict[str, int]  # bundle label -> id
    attempts: list[dict[str, Any]]  # registrations, attempt 1 first


def _end(client: httpx.Client, attempt: dict[str, Any], **body: Any) -> None:
    client.post(f"/v1/attempts/{attempt['attempt_id']}/end", json=body).raise_for_status()


def _beat(client: httpx.Client, attempt: dict[str, Any], step: int) -> None:
    beat = client.post(f"/v1/attempts/{attempt['attempt_id']}/heartbeat", json={"step": step})
    beat.raise_for_status()


def make_catalog(server: ServerProcess, client: httpx.Client) -> Catalog:
    store = DirectoryStore(server.store)
    ids: dict[str, int] = {}

    def saved(label: str, attempt: dict[str, Any], step: int) -> None:
        ids[label] = save(client, store, RUN, attempt, step=step)["id"]
        figures = {
            "stall_seconds": 0.05 + step / 1000,
            "tax_seconds": 0.2 + step / 500,
            "persist_seconds": 0.5 + (step % 30) / 20,
            "payload_bytes": 6 << 20,
            "new_bytes": (step % 40 + 1) << 16,
        }
        client.put(f"/v1/bundles/{ids[label]}/saves/0", json=figures).raise_for_status()

    a1 = register(client, RUN, pod="spot-a-1", node="node-a")
    for step in (10, 20, 30):
        saved(str(step), a1, step)
    _end(client, a1, reason="preempted", final_save_committed=True, step=34)
    a2 = register(client, RUN, pod="spot-b-2", node="node-b")
    saved("40", a2, 40)
    opened = open_bundle(client, RUN, a2, step=45)  # never committed
    opened.raise_for_status()
    ids["45"] = opened.json()["id"]
    _beat(client, a2, 47)
    a3 = register(client, RUN, pod="spot-c-3", node="node-c")  # a2 never reports its end
    saved("50", a3, 50)
    notice = {"cloud": "aws", "kind": "instance-action", "detail": NOTICE, "step": 60}
    client.post(f"/v1/attempts/{a3['attempt_id']}/notice", json=notice).raise_for_status()
    _end(client, a3, reason="preempted", final_save_committed=False, step=66)
    quarantine = {"reason": "a drill: quarantined by hand"}
    client.post(f"/v1/bundles/{ids['20']}/quarantine", json=quarantine).raise_for_status()
    client.patch(f"/v1/bundles/{ids['10']}", json={"pinned": True}).raise_for_status()
    rollback = client.post(f"/v1/runs/{RUN}/rollback", json={"bundle_id": ids["30"]})
    rollback.raise_for_status()
    a4 = register(client, RUN, pod="spot-d-4", node="node-a")
    for step in (40, 50, 60):
        saved(f"{step}'", a4, step)
    _end(client, a4, reason="finished", step=60)  # as Checkpointer.end("finished") does
    token = client.post("/v1/tokens", json={"role": "read"}).json()["token"]
    return Catalog(server=server, token=token, ids=ids, attempts=[a1, a2, a3, a4])


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Catalog]:
    root = tmp_path_factory.mktemp("picture")
    env = {"CKPT_LOST_AFTER_SECONDS": "1000000"}  # attempt 2 stays replaced, not lost
    with ckpt_server(root, env=env) as server, server.client() as client:
        yield make_catalog(server, client)


def run_page(open_page: OpenPage, catalog: Catalog, *, height: int = 900) -> Page:
    page, seen = open_page(width=1280, height=height)
    sign_in(page, catalog.server.url, catalog.token, start=f"/ui/runs/{RUN}")
    seen.assert_clean()
    return page


def shapes(page: Page, selector: str) -> list[dict[str, Any]]:
    """What the browser paints for each element: its tag, fill, stroke, stroke width and
    size (in its own coordinates)."""
    found: list[dict[str, Any]] = page.locator(selector).evaluate_all(
        """nodes => nodes.map(n => {
            const s = getComputedStyle(n); const box = n.getBBox();
            return {tag: n.tagName, fill: s.fill, stroke: s.stroke, width: s.strokeWidth,
                    w: Math.round(box.width * 10) / 10, h: Math.round(box.height * 10) / 10};
        })"""
    )
    return found


def test_each_legend_entry_is_drawn_as_the_marks_it_explains(
    open_page: OpenPage, catalog: Catalog
) -> None:
    page = run_page(open_page, catalog)
    legend = "svg#legend g.legend-entry"
    drawn = set()
    for status in page.locator(legend).evaluate_all("gs => gs.map(g => g.dataset.status)"):
        if status is None:
            continue
        key = shapes(page, f'{legend}[data-status="{status}"] .mark')
        marks = shapes(page, f'svg#lineage a.bundle[data-status="{status}"] .mark')
        assert len(key) == 1, status
        assert all(mark == key[0] for mark in marks), (status, key, marks)
        drawn |= {status} if marks else set()
    assert drawn >= {"complete", "pending", "quarantined"}
    for ended in ("running", "replaced", "preempted", "lost", "failed", "finished"):
        key = shapes(page, f'{legend}[data-ended="{ended}"] .end')
        assert len(key) == 1, ended
        assert all(end == key[0] for end in shapes(page, f"svg#lineage .end.ended-{ended}"))
    for ended in ("replaced", "preempted", "finished"):
        assert shapes(page, f"svg#lineage .end.ended-{ended}"), ended
    # Abandoned: struck through, as its legend entry; pinned: ringed, as its entry.
    struck = shapes(page, f'{legend}[data-key="abandoned"] .struck')
    assert len(struck) == 1
    abandoned = 'svg#lineage a.bundle[data-branch="abandoned"]'
    assert page.locator(abandoned).count() == 3
    assert shapes(page, f"{abandoned} .struck") == struck * 3
    assert page.locator('svg#lineage a.bundle[data-branch="live"] .struck').count() == 0
    ring = shapes(page, f'{legend}[data-key="pinned"] .pin')
    assert ring and shapes(page, 'svg#lineage a.bundle[data-pinned="true"] .pin') == ring
    head = shapes(page, f'{legend}[data-key="head"] .head-mark')
    assert head and shapes(page, "svg#lineage g.head .head-mark") == head


def test_lanes_are_named_as_attempts_with_the_epoch_in_the_details(
    open_page: OpenPage, catalog: Catalog
) -> None:
    page = run_page(open_page, catalog)
    labels = page.locator("svg#lineage g.lane .lane-label").all_text_contents()
    assert labels == [
        "attempt 1 · preempted",
        "attempt 2 · replaced",
        "attempt 3 · preempted",
        "attempt 4 · finished",
    ]
    details = page.locator("svg#lineage g.lane .lane-detail").all_text_contents()
    assert details == [
        "spot-a-1 · node-a",
        "spot-b-2 · node-b",
        "spot-c-3 · node-c",
        "spot-d-4 · node-a",
    ]
    titles = page.locator("svg#lineage g.lane > title").all_text_contents()
    assert "attempt 4 (fencing epoch 5)" in titles[3]  # the rollback took epoch 4
    rows = page.locator("#attempts tr[data-attempt]")
    numbers = rows.evaluate_all("rows => rows.map(r => [r.dataset.attempt, r.dataset.epoch])")
    assert numbers == [["4", "5"], ["3", "3"], ["2", "2"], ["1", "1"]]  # newest first
    assert page.locator('#attempts tr[data-attempt="4"] [data-col="number"]').inner_text() == "4"


def _box(page: Page, selector: str) -> dict[str, float]:
    box = page.locator(selector).bounding_box()
    assert box is not None, selector
    return {"x": box["x"], "y": box["y"], "width": box["width"], "height": box["height"]}


def test_steps_lost_are_drawn_on_the_lane_of_the_attempt_that_lost_them(
    open_page: OpenPage, catalog: Catalog
) -> None:
    page = run_page(open_page, catalog)
    ids = catalog.ids
    # Attempt 3 started at 40 (from bundle 40) and stopped at 66; its last resumable
    # bundle was 50. The rollback sent attempt 4 back to 30: steps 30-40 were attempt 2's
    # and attempt 1's, not attempt 3's.
    lane = "svg#lineage g.lane >> nth={} >> {}"  # oldest first
    band = _box(page, lane.format(2, "rect.lost"))
    track = _box(page, lane.format(2, "line.track"))
    mark_50 = _box(page, f'svg#lineage a.bundle[data-key="bundle-{ids["50"]}"] .mark')
    assert band["x"] >= track["x"] - 1
    assert abs(band["x"] - (mark_50["x"] + mark_50["width"] / 2)) <= 2
    assert abs(band["x"] + band["width"] - (track["x"] + track["width"])) <= 3
    # Attempt 1 lost 31-34 past its bundle 30, where attempt 2 resumed.
    band_1 = _box(page, lane.format(0, "rect.lost"))
    mark_30 = _box(page, f'svg#lineage a.bundle[data-key="bundle-{ids["30"]}"] .mark')
    assert abs(band_1["x"] - (mark_30["x"] + mark_30["width"] / 2)) <= 2
    lost = page.locator("svg#lineage rect.lost").evaluate_all(
        "rects => rects.map(r => [r.closest('g.lane').dataset.epoch, r.dataset.steps])"
    )
    assert sorted(lost) == [["1", "4"], ["3", "16"]]


CONTRAST = """(nodes) => nodes.map(node => {
    // The colour a shape is painted in, over the white page: its stroke where its fill is
    // none or white, blended by its own and its ancestors' opacity.
    const style = getComputedStyle(node);
    const parse = c => (c.match(/[\\d.]+/g) || []).map(Number);
    const fill = parse(style.fill);
    const white = fill.length >= 3 && fill[0] === 255 && fill[1] === 255 && fill[2] === 255;
    const outline = node.tagName === "line" || style.fill === "none" || white;
    let rgb = outline ? parse(style.stroke) : fill;
    let alpha = 1;
    for (let n = node; n && n.nodeType === 1; n = n.parentNode) {
        alpha *= Number(getComputedStyle(n).opacity);
    }
    rgb = rgb.slice(0, 3).map(c => 255 * (1 - alpha) + c * alpha);
    return "#" + rgb.map(c => Math.round(c).toString(16).padStart(2, "0")).join("");
})"""


def test_the_picture_is_legible_at_a_glance(open_page: OpenPage, catalog: Catalog) -> None:
    page = run_page(open_page, catalog)
    svg = _box(page, "svg#lineage")
    assert svg["width"] >= 1100  # at 1280 px: the page's width, not 960
    for box in [m.bounding_box() for m in page.locator("svg#lineage a.bundle .mark").all()]:
        assert box and box["width"] >= MARK_MIN - 4 and box["height"] >= MARK_MIN - 4
    complete = _box(page, 'svg#lineage a.bundle[data-status="complete"] >> nth=0 >> .mark')
    assert complete["width"] >= MARK_MIN
    tracks = [_box(page, f'svg#lineage g.lane[data-attempt="{n}"] line.track') for n in (1, 2)]
    pitch = tracks[1]["y"] - tracks[0]["y"]
    assert pitch >= LANE_PITCH_MIN
    # The head's triangle sits on the head's lane, closer to it than half a lane.
    head = _box(page, "svg#lineage g.head .head-mark")
    key = page.locator("svg#lineage g.head").get_attribute("data-key")
    mark = _box(page, f'svg#lineage a.bundle[data-key="{key}"] .mark')
    middle = mark["y"] + mark["height"] / 2
    assert middle - pitch / 2 <= head["y"] and head["y"] + head["height"] <= middle
    graphics = "svg#lineage .mark, svg#lineage .end, svg#lineage .track, svg#lineage .resume-edge"
    for colour in page.locator(graphics).evaluate_all(CONTRAST):
        assert palette.contrast(colour, palette.BACKGROUND) >= 3, colour
    for colour in page.locator("svg#lineage rect.lost").evaluate_all(
        "rects => rects.map(r => getComputedStyle(r).stroke)"
    ):
        rgb = [int(c) for c in colour[colour.index("(") + 1 : -1].split(",")]
        assert palette.contrast("#{:02x}{:02x}{:02x}".format(*rgb), "#ffffff") >= 3
    texts = "svg#lineage text, svg#legend text, svg#saves text"
    for colour in page.locator(texts).evaluate_all(CONTRAST):
        assert palette.contrast(colour, palette.BACKGROUND) >= 4.5, colour
    # The save figures carry their values' range and the steps they span.
    panels = page.locator("svg#saves g.panel")
    assert panels.count() == 5  # stall, save tax, persist, throughput, new bytes
    for text in panels.all_text_contents():
        assert "max " in text and "min " in text, text
    steps = page.locator("svg#saves g.steps").all_text_contents()
    assert steps and "step 10" in steps[0] and "step 60" in steps[0]


def test_attempt_states_are_current_on_the_page_and_over_the_api(
    open_page: OpenPage, catalog: Catalog
) -> None:
    with catalog.server.client() as client:
        attempts = client.get(f"/v1/runs/{RUN}/lineage").json()["attempts"]
    by_pod = {a["pod"]: a for a in attempts}
    assert by_pod["spot-b-2"]["state"] == "replaced"  # a newer attempt registered
    assert by_pod["spot-b-2"]["end_reason"] is None  # it never said it ended
    assert by_pod["spot-d-4"]["state"] == "finished"
    assert by_pod["spot-d-4"]["final_save_committed"] is True  # its bundle 60' committed
    assert by_pod["spot-b-2"]["final_save_committed"] is None  # it never ended
    assert by_pod["spot-c-3"]["final_save_committed"] is False  # preempted: as its agent said
    page = run_page(open_page, catalog)
    row = '#attempts tr[data-attempt="{}"] [data-col="{}"]'
    assert page.locator(row.format(2, "reason")).inner_text() == "replaced"
    assert page.locator(row.format(4, "reason")).inner_text() == "finished"
    assert page.locator(row.format(4, "final_save")).inner_text() == "committed"
    assert page.locator(row.format(3, "final_save")).inner_text() == "not committed"
    lane = page.locator('svg#lineage g.lane[data-attempt="2"]')
    assert lane.get_attribute("data-ended") == "replaced"


def test_the_bundle_page_shows_each_layers_size_and_each_blobs_layer(
    open_page: OpenPage, catalog: Catalog, screenshots: Path
) -> None:
    head = catalog.ids["60'"]
    with catalog.server.client() as client:
        bundle = client.get(f"/v1/bundles/{head}").json()
    page, seen = open_page(width=1280, height=800)
    sign_in(page, catalog.server.url, catalog.token, start=f"/ui/runs/{RUN}/bundles/{head}")
    cells = page.locator('#completeness tr[data-rank="0"] td[data-layer]')
    shown = dict(
        cells.evaluate_all("cs => cs.map(c => [c.dataset.layer, Number(c.dataset.bytes)])")
    )
    assert shown == {r["layer"]: r["payload_bytes"] for r in bundle["recorded"]}
    for text in cells.all_inner_texts():
        assert text.startswith("✓ ") and text.endswith("B"), text
    holders: dict[str, list[str]] = {}  # a blob two layers share (a header) is listed once
    for rank in bundle["manifest"]["ranks"]:
        for layer, record in rank["layers"].items():
            for blob in record["blobs"]:
                held = holders.setdefault(blob["sha256"], [])
                held += (
                    []
                    if f"rank {rank['rank']} {layer}" in held
                    else [f"rank {rank['rank']} {layer}"]
                )
    rows = page.locator("#blobs tr[data-sha]").evaluate_all(
        "rows => rows.map(r => [r.dataset.sha, r.querySelector('[data-col=layer]').innerText])"
    )
    assert rows and {sha: sorted(layer.split(", ")) for sha, layer in rows} == {
        sha: sorted(layers) for sha, layers in holders.items()
    }
    assert "attempt 4" in page.locator('#bundle [data-col="attempt"]').inner_text()
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    page.screenshot(path=str(REVIEW / "bundle-page-1280x800.png"))  # the first screen
    screenshot(page, screenshots, "bundle-page")
    seen.assert_clean()


def test_the_run_page_fits_1280_px_with_a_long_notice(
    open_page: OpenPage, catalog: Catalog, screenshots: Path
) -> None:
    page = run_page(open_page, catalog, height=800)
    notice = page.locator('#attempts tr[data-epoch="3"] [data-col="notice"]').inner_text()
    assert NOTICE in notice.replace("\n", "")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    # What a person reviews: the first screen, as a newcomer sees it, and the whole page.
    first = screenshots / "run-page-1280x800.png"
    page.screenshot(path=str(first))
    shutil.copy(first, REVIEW / "run-page-1280x800.png")
    screenshot(page, screenshots, "run-page-full")
