"""One goodput: the figure ``ckpt demo`` prints as "goodput (time)" is the one
``GET /v1/runs/{run}/goodput`` answers and the run page shows under the same name; the
dashboard's step-based figure is "steps kept", a name of its own."""

from __future__ import annotations

import re
import uuid

import pytest

from agent.demo.report import format_goodput
from tests.service.conftest import (  # noqa: F401 (fixtures server needs)
    MakeServer,
    Server,
    catalogs,
    make_server,
    pg_databases,
)
from tests.ui.signin import signed_in_client


@pytest.fixture(params=["postgres", "sqlite"])
def server(request: pytest.FixtureRequest, make_server: MakeServer) -> Server:  # noqa: F811
    backend: str = request.param
    return make_server(backend)


def summary(page: str, column: str) -> str:
    found = re.search(rf'<dd data-col="{column}">(.*?)</dd>', page, re.S)
    assert found, page[:3000]
    return found.group(1).strip()


def test_the_demo_the_api_and_the_run_page_show_one_goodput(server: Server) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    with server.client() as api:
        # Preempted without a bundle after a long restart: its 40 steps are lost.
        first = api.post(f"/v1/runs/{run}/attempts", json={}).json()["attempt_id"]
        time = {"restart_seconds": 20.0, "stall_seconds": 5.0, "train_seconds": 75.0}
        end = {"reason": "preempted", "step": 40, "time": {**time, "steps_trained": 40}}
        api.post(f"/v1/attempts/{first}/end", json=end).raise_for_status()
        # The next trains the 40 steps again and finishes.
        second = api.post(f"/v1/runs/{run}/attempts", json={}).json()["attempt_id"]
        time = {"restart_seconds": 10.0, "stall_seconds": 5.0, "train_seconds": 85.0}
        end = {"reason": "finished", "step": 40, "time": {**time, "steps_trained": 40}}
        api.post(f"/v1/attempts/{second}/end", json=end).raise_for_status()
        answer = api.get(f"/v1/runs/{run}/goodput").raise_for_status().json()
    with signed_in_client(server.url, server.admin_token) as browser:
        page = browser.get(f"/ui/runs/{run}").text
        listing = browser.get("/ui/", params={"prefix": run}).text

    # (75 - 75 redone + 85) s kept of 200 s: 42.5% of the time; 40 of 80 steps computed kept.
    assert answer["time"]["goodput"] == pytest.approx(0.425)
    assert summary(page, "goodput") == "42.5%"
    assert "<dt>goodput (time)</dt>" in page
    assert summary(page, "steps_kept") == "50.0%"
    assert "<dt>steps kept</dt>" in page
    assert re.search(r'data-col="steps_kept"[^>]*>50\.0%<', listing), listing[:3000]
    assert ">goodput<" not in listing + page  # no figure is called plain "goodput"
    printed = format_goodput(answer)  # the demo's line
    assert printed.startswith(f"{summary(page, 'goodput')} of 200.0 s trained and kept")
