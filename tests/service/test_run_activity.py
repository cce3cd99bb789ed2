"""Each run's ``run_activity`` row (state, last activity, attempt figures, bundles), kept by
every write to attempts, always equals what the catalog's attempts say: checked after each
step of a run's life over the API (registrations, heartbeats, saves, ends, an attempt
marked lost and alive again, a fenced attempt's late end), on both databases."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
from sqlalchemy import func, select

from service import lineage
from service.models import Attempt, Bundle, Run, RunActivity, utcnow
from service.runs.attempts import mark_lost
from service.runs.repository import attempt_nodes
from service.runs.service import PAGE_STEP
from tests.service.conftest import Server
from tests.service.helpers import register, save, statements


def figures(server: Server, run: str) -> dict[str, Any]:
    """The kept row, and the same figures computed from the attempts and bundles."""
    with server.context.transaction() as session:
        found = session.scalar(select(Run).where(Run.name == run))
        assert found is not None
        kept = session.get(RunActivity, found.id)
        assert kept is not None
        attempts = list(
            session.scalars(
                select(Attempt).where(Attempt.run_id == found.id).order_by(Attempt.epoch)
            )
        )
        nodes = {node.id: node for node in attempt_nodes(session, run_id=found.id)}
        bundles = session.scalar(select(func.count()).where(Bundle.run_id == found.id))
    newest = attempts[-1]
    started = {a.id: nodes[a.id].resumed_step or 0 for a in attempts}
    computed = sum(
        max(0, (a.last_step if a.last_step is not None else started[a.id]) - started[a.id])
        for a in attempts
    )
    truth = {
        "state": "training" if newest.ended_at is None else newest.end_reason,
        "active_at": newest.ended_at or newest.heartbeat_at or newest.started_at,
        "attempts": len(attempts),
        "preemptions": sum(a.end_reason == "preempted" for a in attempts),
        "steps_lost": sum(n or 0 for n in lineage.steps_lost_by_attempt(nodes.values()).values()),
        "steps_computed": computed,
        "bundles": bundles,
    }
    return {"kept": {name: getattr(kept, name) for name in truth}, "truth": truth}


def check(server: Server, run: str, **expected: Any) -> None:
    found = figures(server, run)
    assert found["kept"] == found["truth"]
    assert {name: found["kept"][name] for name in expected} == expected


def beat(client: httpx.Client, attempt: dict[str, Any], step: int) -> None:
    answer = client.post(f"/v1/attempts/{attempt['attempt_id']}/heartbeat", json={"step": step})
    assert answer.status_code == 200, answer.text


def end(client: httpx.Client, attempt: dict[str, Any], reason: str, step: int) -> None:
    body = {"reason": reason, "step": step}
    answer = client.post(f"/v1/attempts/{attempt['attempt_id']}/end", json=body)
    assert answer.status_code == 200, answer.text


def test_the_kept_figures_follow_every_write(server: Server, run_name: str) -> None:
    run = run_name
    with server.client() as client:
        first = register(client, run)
        check(server, run, state="training", attempts=1, steps_computed=0, bundles=0)
        beat(client, first, 5)
        check(server, run, steps_computed=5)
        save(client, server.store, run, first, step=10)
        beat(client, first, 14)
        check(server, run, steps_computed=14, bundles=1)
        end(client, first, "preempted", 16)
        check(server, run, state="preempted", preemptions=1, steps_lost=0)

        second = register(client, run)  # resumes from step 10: steps 10 to 16 are lost
        check(server, run, state="training", attempts=2, steps_lost=6, steps_computed=16)
        beat(client, second, 20)
        check(server, run, steps_computed=26)

        later = utcnow() + timedelta(days=1)
        assert mark_lost(server.context, now=later) == [second["attempt_id"]]
        check(server, run, state="lost", active_at=later)
        beat(client, second, 22)  # alive after all
        check(server, run, state="training", steps_computed=28)

        third = register(client, run)  # from step 10 again; the second has not ended
        check(server, run, attempts=3, steps_lost=6, steps_computed=28)
        end(client, second, "failed", 25)  # its own report, late: steps 10 to 25 are lost
        check(server, run, state="training", attempts=3, steps_lost=21, steps_computed=31)
        end(client, third, "finished", 10)
        check(server, run, state="finished", preemptions=1, steps_lost=21, bundles=1)


def test_a_page_of_runs_costs_what_one_run_does(server: Server) -> None:
    with server.client() as client:
        for index in range(12):
            attempt = register(client, f"listed-{index:02d}")
            save(client, server.store, f"listed-{index:02d}", attempt, step=10)

        def page(limit: int) -> None:
            answer = client.get("/v1/runs", params={"limit": limit})
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["runs"]) == limit
            listed = answer.json()["runs"][0]
            assert listed["head"]["step"] == listed["resumable"]["step"] == 10
            assert listed["num_bundles"] == {"complete": 1}

        assert statements(server, lambda: page(12)) == statements(server, lambda: page(1))


def test_a_long_page_is_read_a_step_at_a_time_and_says_the_same(server: Server) -> None:
    """A page of more than ``PAGE_STEP`` runs is read a step at a time, so that a bulk
    request pauses between statements for a priority request (``service.yielding``): the
    same runs in the same order, the same ``next``, at a cost that grows with the steps."""
    names = [f"paged-{index:03d}" for index in range(2 * PAGE_STEP + 30)]
    with server.client() as client:
        for name in names:
            client.post("/v1/runs", json={"name": name}).raise_for_status()
        saved = names[PAGE_STEP + 5]  # read in the second step
        save(client, server.store, saved, register(client, saved), step=10)

        def listed(**params: Any) -> tuple[list[str], str | None]:
            answer = client.get("/v1/runs", params=params)
            assert answer.status_code == 200, answer.text
            return [run["name"] for run in answer.json()["runs"]], answer.json()["next"]

        assert listed(limit=500) == (names, None)
        assert listed(limit=2 * PAGE_STEP) == (names[: 2 * PAGE_STEP], names[2 * PAGE_STEP - 1])
        middle = names[10 : PAGE_STEP + 11]
        assert listed(limit=PAGE_STEP + 1, after=names[9]) == (middle, middle[-1])
        hundreds = [name for name in names if name.startswith("paged-1")]
        assert len(hundreds) == PAGE_STEP  # one step exactly: the last
        assert listed(limit=500, prefix="paged-1") == (hundreds, None)
        shown = client.get("/v1/runs", params={"limit": 500}).json()["runs"][PAGE_STEP + 5]
        assert shown["name"] == saved and shown["resumable"]["step"] == 10
        assert shown["num_bundles"] == {"complete": 1}

        # A step costs a constant number of statements (fewer where no run has bundles).
        one_step = statements(server, lambda: listed(limit=PAGE_STEP, after=names[PAGE_STEP - 1]))
        assert one_step < statements(server, lambda: listed(limit=500)) <= 3 * one_step
