"""``GET /v1/runs/{run}/preemption-rate``: the mean time between preemptions of a run and
its capacity pool, from attempt history, on both databases. Attempts are backdated and
ended over the API, so the expected estimate is computed by hand from known exposures."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
from sqlalchemy import update

from service.models import Attempt, utcnow
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import register

HOUR = 3600.0


def attempt(
    server: Server, client: httpx.Client, run: str, *, hours: float, end: str | None, pool: str
) -> int:
    """An attempt of ``run`` on ``pool`` that lived ``hours`` and ended with ``end`` (None:
    still running)."""
    attempt_id: int = register(client, run, pool=pool)["attempt_id"]
    if end is not None:
        client.post(f"/v1/attempts/{attempt_id}/end", json={"reason": end}).raise_for_status()
    with server.context.transaction() as session:
        started = utcnow() - timedelta(hours=hours)
        ended = {"ended_at": utcnow()} if end is not None else {}
        session.execute(
            update(Attempt).where(Attempt.id == attempt_id).values(started_at=started, **ended)
        )
    return attempt_id


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_the_estimate_follows_the_history_of_the_run_and_its_pool(
    make_server: MakeServer, backend: str
) -> None:
    prior = 10 * HOUR
    server = make_server(backend, mtbf_prior_seconds=prior)
    with server.client() as client:
        # No history at all: the prior.
        attempt(server, client, "fresh", hours=0, end=None, pool="aws/p5")
        rate = client.get("/v1/runs/fresh/preemption-rate").json()
        assert rate["pool"]["preemptions"] == 0
        assert rate["mtbf_seconds"] == pytest.approx(prior, rel=1e-3)

        # Another run on the pool: preempted after 2 h and 3 h, lost after 1 h, failed
        # after 4 h (a crash is not the capacity's doing), finished after 5 h.
        for hours, end in [(2, "preempted"), (3, "preempted"), (1, None), (4, "failed")]:
            attempt(server, client, "other", hours=hours, end=end, pool="aws/p5")
        lost = attempt(server, client, "other", hours=1, end=None, pool="aws/p5")
        with server.context.transaction() as session:  # the lost verdict, as mark_lost gives it
            session.execute(
                update(Attempt)
                .where(Attempt.id == lost)
                .values(end_reason="lost", ended_at=utcnow())
            )
        attempt(server, client, "other", hours=5, end="finished", pool="aws/p5")
        # A different pool is not counted.
        attempt(server, client, "elsewhere", hours=100, end="preempted", pool="gcp/a3")

        rate = client.get("/v1/runs/fresh/preemption-rate").json()
        # The pool's attempts: 2 + 3 + 1 (the "other" attempt fenced while running: still
        # alive, as it never ended) + 4 + 1 + 5 + ~0 (this run's) hours, 3 preemptions.
        pool_exposure = (2 + 3 + 1 + 4 + 1 + 5) * HOUR
        assert rate["pool"]["name"] == "aws/p5"
        assert rate["pool"]["preemptions"] == 3
        assert rate["pool"]["exposure_seconds"] == pytest.approx(pool_exposure, abs=60)
        pool_mtbf = (pool_exposure + prior) / 4
        assert rate["pool"]["mtbf_seconds"] == pytest.approx(pool_mtbf, abs=60)
        # The run itself has no history yet: the pool's estimate is its prior.
        assert rate["run"]["preemptions"] == 0
        assert rate["mtbf_seconds"] == pytest.approx(pool_mtbf, abs=60)

        # The run's own preemptions weigh in: (its exposure + the pool's) / (events + 1).
        attempt(server, client, "fresh", hours=0.5, end="preempted", pool="aws/p5")
        rate = client.get("/v1/runs/fresh/preemption-rate").json()
        assert rate["run"]["preemptions"] == 1
        own = rate["run"]["exposure_seconds"]
        assert rate["mtbf_seconds"] == pytest.approx(
            (own + rate["pool"]["mtbf_seconds"]) / 2, rel=1e-6
        )
        # Another pool asked for by name.
        other = client.get("/v1/runs/fresh/preemption-rate", params={"pool": "gcp/a3"}).json()
        assert other["pool"]["preemptions"] == 1

        assert client.get("/v1/runs/nope/preemption-rate").status_code == 404
        assert (
            client.get("/v1/runs/fresh/preemption-rate", params={"pool": "x\n"}).status_code == 422
        )


def test_a_heartbeat_carries_the_interval_the_agent_chose(server: Server, run_name: str) -> None:
    with server.client() as client:
        attempt_id = register(client, run_name, pool="aws/p5")["attempt_id"]
        beat = {"step": 3, "interval_seconds": 620.5, "waste_seconds_per_hour": 41.0}
        shown = client.post(f"/v1/attempts/{attempt_id}/heartbeat", json=beat).json()
        assert (shown["pool"], shown["interval_seconds"], shown["waste_seconds_per_hour"]) == (
            "aws/p5",
            620.5,
            41.0,
        )
        bad = client.post(f"/v1/attempts/{attempt_id}/heartbeat", json={"interval_seconds": -1})
        assert bad.status_code == 422


def test_attempts_report_their_time_and_the_run_sums_it_into_goodput(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        first = register(client, run_name)["attempt_id"]
        time = {"restart_seconds": 20.0, "stall_seconds": 5.0, "train_seconds": 75.0}
        beat = {"step": 40, "time": {**time, "steps_trained": 40}}
        shown = client.post(f"/v1/attempts/{first}/heartbeat", json=beat).json()["time"]
        assert shown == {**time, "wall_seconds": 100.0, "redo_seconds": 0.0, "goodput": 0.75}
        # It ends preempted at step 40; its successor starts fresh (no bundle): 40 steps
        # lost, all 75 s of its training redone.
        end = {"reason": "preempted", "step": 40, "time": {**time, "steps_trained": 40}}
        client.post(f"/v1/attempts/{first}/end", json=end).raise_for_status()
        second = register(client, run_name)["attempt_id"]
        later = {"restart_seconds": 10.0, "stall_seconds": 0.0, "train_seconds": 90.0}
        end = {"reason": "finished", "step": 60, "time": {**later, "steps_trained": 60}}
        client.post(f"/v1/attempts/{second}/end", json=end).raise_for_status()

        goodput = client.get(f"/v1/runs/{run_name}/goodput").json()
        assert goodput["attempts"] == 2
        assert goodput["time"] == {
            "wall_seconds": 200.0,
            "restart_seconds": 30.0,
            "stall_seconds": 5.0,
            "train_seconds": 165.0,
            "redo_seconds": 75.0,
            "goodput": pytest.approx(90 / 200),
        }
        metrics = client.get("/metrics").text
        for part, seconds in [("restart", 30.0), ("stall", 5.0), ("train", 165.0), ("redo", 75.0)]:
            assert f'ckpt_attempt_seconds_total{{part="{part}"}} {seconds}' in metrics
        bad = {"step": 1, "time": {**time, "steps_trained": -1}}
        assert client.post(f"/v1/attempts/{second}/heartbeat", json=bad).status_code in (409, 422)
