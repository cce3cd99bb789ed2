"""A resume's verdict on the run page, in a real browser: attempts seeded through the REST
API with each verdict (verified, diverged, unverifiable, and none) get the matching mark on
their lane, the sentence in its title, and the legend explains each mark."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.service.conftest import (  # noqa: F401 (fixtures make_server needs)
    MakeServer,
    catalogs,
    make_server,
    pg_databases,
)
from tests.ui.conftest import OpenPage, sign_in

pytestmark = pytest.mark.browser

DIFFERENCE = {
    "step": 1204,
    "micro_step": 0,
    "rank": 1,
    "part": "loss",
    "expected": "2.3809",
    "got": "2.3811",
}
VERDICTS: dict[str, dict[str, Any]] = {
    "verified": {"steps_compared": 37},
    "diverged": {
        "steps_compared": 3,
        "first_difference": DIFFERENCE,
        "detail": "loss differs: likely the data layer",
    },
    "unverifiable": {"steps_compared": 0},
}


def test_each_lane_shows_its_resumes_verdict(
    make_server: MakeServer,  # noqa: F811
    open_page: OpenPage,
) -> None:
    server = make_server("sqlite")
    run = f"run-{uuid.uuid4().hex[:8]}"
    epochs: dict[str, int] = {}
    with server.client() as api:
        for name in ("none", *VERDICTS):
            attempt = api.post(f"/v1/runs/{run}/attempts", json={}).raise_for_status().json()
            beat = {"step": 10 * attempt["epoch"]}
            api.post(
                f"/v1/attempts/{attempt['attempt_id']}/heartbeat", json=beat
            ).raise_for_status()
            epochs[name] = attempt["epoch"]
            if name in VERDICTS:
                body = {"verdict": name, "mode": "exact", "from_attempt_id": None}
                url = f"/v1/attempts/{attempt['attempt_id']}/verification"
                api.put(url, json=body | VERDICTS[name]).raise_for_status()

    page, seen = open_page()
    sign_in(page, server.url, server.admin_token, start=f"/ui/runs/{run}")
    lanes = page.locator("svg#lineage g.lane")
    assert lanes.count() == 4
    unmarked = page.locator(f'svg#lineage g.lane[data-epoch="{epochs["none"]}"]')
    assert unmarked.get_attribute("data-verdict") is None
    assert unmarked.locator(".verdict").count() == 0
    titles = {}
    for verdict in VERDICTS:
        lane = page.locator(f'svg#lineage g.lane[data-epoch="{epochs[verdict]}"]')
        assert lane.get_attribute("data-verdict") == verdict
        mark = lane.locator(f"g.lane-verdict .verdict-{verdict}")
        assert mark.count() == 1
        assert mark.is_visible()
        titles[verdict] = lane.locator("g.lane-verdict > title").text_content()
    assert titles["verified"] == "resume verified over 37 replayed steps"
    assert titles["diverged"] == (
        "resume diverged at step 1204 (rank 1): loss 2.3811, expected 2.3809. "
        "loss differs: likely the data layer"
    )
    assert (titles["unverifiable"] or "").startswith("resume unverifiable")
    # Diverged is loud: a filled red mark, the largest of the three.
    red = page.locator("svg#lineage .verdict-diverged").evaluate(
        "mark => getComputedStyle(mark).fill"
    )
    assert red == "rgb(207, 34, 46)"
    sizes = {
        verdict: page.locator(f"svg#lineage .verdict-{verdict}").bounding_box()
        for verdict in VERDICTS
    }
    area = {v: box["width"] * box["height"] for v, box in sizes.items() if box}
    assert area["diverged"] == max(area.values())
    for verdict in VERDICTS:
        entry = page.locator(f'svg#legend g.legend-entry[data-verdict="{verdict}"]')
        assert entry.locator(f".verdict-{verdict}").count() == 1
        assert (entry.text_content() or "").endswith(verdict)
    seen.assert_clean()
