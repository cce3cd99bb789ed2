"""The save tax on the dashboard, in a real browser: the run page draws it beside the stall
(the slowest rank's, through the bundles whose tax is known) and says what it is; the bundle
page tables each rank's, "—" where the rank did not know it. On SQLite and PostgreSQL (the
run page's chart takes the max over ranks in SQL).

The module's run ``taxed``, written over the API (real saves into the server's store), each
bundle's figures by rank (stall, tax):

step 10  rank 0 (0.1, unknown)                         no tax: left out of the tax's line
step 20  rank 0 (0.2, 1.25)   rank 1 (0.3, unknown)    tax 1.25
step 30  rank 0 (0.1, 0.5)    rank 1 (0.2, 0.75)       tax 0.75
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ckpt.core.storage import DirectoryStore
from tests.server_process import ServerProcess, ckpt_server
from tests.service.conftest import create_pg_database, drop_pg_database
from tests.service.helpers import register, save
from tests.ui.conftest import OpenPage, screenshot, sign_in

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = [pytest.mark.slow, pytest.mark.browser]

RUN = "taxed"
FIGURES: dict[int, list[tuple[float, float | None]]] = {  # by step, by rank: stall, tax
    10: [(0.1, None)],
    20: [(0.2, 1.25), (0.3, None)],
    30: [(0.1, 0.5), (0.2, 0.75)],
}


@dataclass(frozen=True)
class Catalog:
    server: ServerProcess
    token: str
    ids: dict[int, int]  # bundle id by step


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def catalog(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Catalog]:
    root = tmp_path_factory.mktemp(f"tax-{request.param}")
    url = create_pg_database() if request.param == "postgres" else None
    try:
        with ckpt_server(root, database_url=url) as server, server.client() as client:
            attempt = register(client, RUN)
            ids = {}
            for step, ranks in FIGURES.items():
                store = DirectoryStore(server.store)
                ids[step] = save(client, store, RUN, attempt, step=step, world_size=len(ranks))[
                    "id"
                ]
                for rank, (stall, tax) in enumerate(ranks):
                    figures = {
                        "stall_seconds": stall,
                        "persist_seconds": 1.0,
                        "payload_bytes": 1 << 20,
                        "new_bytes": 1 << 10,
                        "tax_seconds": tax,
                    }
                    path = f"/v1/bundles/{ids[step]}/saves/{rank}"
                    client.put(path, json=figures).raise_for_status()
            token = client.post("/v1/tokens", json={"role": "read"}).json()["token"]
            yield Catalog(server=server, token=token, ids=ids)
    finally:
        if url is not None:
            drop_pg_database(url)


def opened(open_page: OpenPage, catalog: Catalog, start: str) -> tuple[Page, Any]:
    page, seen = open_page(width=1280, height=900)
    sign_in(page, catalog.server.url, catalog.token, start=start)
    return page, seen


def test_the_run_page_draws_the_save_tax_beside_the_stall(
    open_page: OpenPage, catalog: Catalog, screenshots: Path
) -> None:
    page, seen = opened(open_page, catalog, f"/ui/runs/{RUN}")
    panels = page.locator("svg#saves g.panel")
    names = panels.evaluate_all("gs => gs.map(g => g.dataset.series)")
    assert names[:2] == ["stall", "tax"]
    tax = page.locator('svg#saves g.panel[data-series="tax"]')
    assert tax.evaluate("g => ({...g.dataset})") == {
        "series": "tax",
        "min": "0.75",
        "max": "1.25",
        "points": "2",  # step 10's tax is unknown: not drawn as 0
    }
    assert tax.locator("text").first.text_content() == "save tax s"
    assert tax.locator("text.max").text_content() == "max 1.25"
    about = tax.locator("title").text_content() or ""
    assert "the training loop's extra time from save() until durable" in about
    line = tax.locator("polyline.series")
    assert len((line.get_attribute("points") or "").split()) == 2
    box = line.bounding_box()
    assert box and box["width"] > 100 and box["height"] > 10  # drawn, from foot to top
    stall = page.locator('svg#saves g.panel[data-series="stall"]')
    assert stall.evaluate("g => g.dataset.points") == "3"
    assert stall.evaluate("g => g.dataset.max") == "0.3"
    figure = page.locator("svg#saves").bounding_box()
    assert figure and figure["x"] + figure["width"] <= 1280  # not cut off at 1280 px
    note = page.locator("figure.saves + p.note").inner_text()
    assert "save tax: the training loop's extra time from save() until durable" in note
    screenshot(page, screenshots, "save-tax-run")
    seen.assert_clean()


def cells(page: Page, column: str) -> list[str]:
    found: list[str] = page.locator(
        f'#figures tr[data-rank] td[data-col="{column}"]'
    ).all_inner_texts()
    return found


def test_the_bundle_page_tables_each_ranks_save_tax(
    open_page: OpenPage, catalog: Catalog, screenshots: Path
) -> None:
    page, seen = opened(open_page, catalog, f"/ui/runs/{RUN}/bundles/{catalog.ids[30]}")
    headers = page.locator("#figures thead th").all_inner_texts()
    assert headers[1:3] == ["stall", "save tax"]
    title = page.locator("#figures thead th").nth(2).get_attribute("title") or ""
    assert "extra time from save() until durable" in title
    assert cells(page, "stall") == ["0.100 s", "0.200 s"]
    assert cells(page, "tax") == ["0.500 s", "0.750 s"]
    screenshot(page, screenshots, "save-tax-bundle")

    page.goto(f"{catalog.server.url}/ui/runs/{RUN}/bundles/{catalog.ids[20]}")
    assert cells(page, "tax") == ["1.250 s", "—"]  # rank 1 did not know its tax
    note = page.locator("#figures + p.note").inner_text()
    assert "Save tax: the training loop's extra time" in note
    seen.assert_clean()
