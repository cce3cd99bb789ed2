"""A GC pass over a backlog larger than a batch deletes it in several short transactions,
shows its progress in ``/metrics`` as it goes, and serves requests between its batches
(issue 29: the first pass over 796,000 deletable bundles held the catalog for minutes)."""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from service.gc.service import GcReport, collect
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import register, save

BATCH = 3
SAVED = 10  # steps 1..10, of which keep_last=1 lets 9 go: three batches


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def metric(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} is not in /metrics"
    return float(found.group(1))


def progress(client: httpx.Client) -> tuple[float, float, float]:
    """Deleted so far, the backlog left, the batches done."""
    return (
        metric(client, "ckpt_gc_deleted_bundles_total"),
        metric(client, "ckpt_gc_backlog"),
        metric(client, "ckpt_gc_batches_total"),
    )


def wait_paused(paused: threading.Event, running: Future[GcReport]) -> None:
    """Until the pass stops after its first batch (or fails: its error, not a hang)."""
    while not paused.wait(0.1):
        if running.done():
            running.result()
            pytest.fail("the pass ended without pausing between batches")


def test_a_backlog_goes_in_batches_with_requests_served_between(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server: Server = make_server(backend, gc_batch_bundles=BATCH)
    with server.client() as client:
        attempt = register(client, run_name)
        ids = [save(client, server.store, run_name, attempt, step=s)["id"] for s in range(1, 11)]
        client.patch(f"/v1/runs/{run_name}", json={"keep_last": 1}).raise_for_status()
        paused, resume = threading.Event(), threading.Event()
        pauses = [0]

        def between_batches() -> None:
            pauses[0] += 1
            if pauses[0] == 1:
                paused.set()
                assert resume.wait(120), "never resumed"

        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(collect, server.context, between_batches=between_batches)
            try:
                wait_paused(paused, running)
                during = progress(client)
                resumable = client.get(f"/v1/runs/{run_name}/resumable")
                # A save of the same run commits between two batches: its row is not held.
                newest = save(client, server.store, run_name, attempt, step=11)
            finally:
                resume.set()
            report = running.result()
        after = progress(client)
    assert during == (BATCH, SAVED - 1 - BATCH, 1)
    assert resumable.status_code == 200, resumable.text
    assert resumable.json()["bundle_id"] == ids[-1]
    # Each batch weighs the run again: the save made step 10 one more to let go.
    assert sorted(report.deleted_bundles) == ids
    assert after == (SAVED, 0, 4)  # 3 + 3 + 3 + 1
    assert pauses[0] == 4
    with server.client() as client:
        lineage = client.get(f"/v1/runs/{run_name}/lineage").json()["bundles"]
        assert {b["id"]: b["status"] for b in lineage} == {
            **dict.fromkeys(ids, "deleted"),
            newest["id"]: "complete",
        }
