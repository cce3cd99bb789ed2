"""An attempt's state and final save as the API reports them, on PostgreSQL and SQLite:
"replaced" as soon as a newer attempt registers (not "running" until the lost-attempt
sweep), and a finished attempt's final save read from its newest bundle when its end report says
nothing of it (``Checkpointer.end("finished")`` does not)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from tests.service.conftest import Server
from tests.service.helpers import open_bundle, register, save


def attempts(server: Server, run: str) -> dict[str, dict[str, Any]]:
    with server.client() as client:
        found = client.get(f"/v1/runs/{run}/lineage").json()["attempts"]
    return {attempt["pod"]: attempt for attempt in found}


def test_an_attempt_is_replaced_as_soon_as_a_newer_one_registers(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        register(client, run_name, pod="first")
        assert attempts(server, run_name)["first"]["state"] == "running"
        register(client, run_name, pod="second")
    found = attempts(server, run_name)
    assert found["first"]["state"] == "replaced"
    assert found["first"]["end_reason"] is None  # the sweep has not marked it lost
    assert found["second"]["state"] == "running"


def test_a_finished_attempts_final_save_is_its_newest_bundles_commit(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        done = register(client, run_name, pod="done")
        save(client, server.store, run_name, done, step=10)
        ended = client.post(
            f"/v1/attempts/{done['attempt_id']}/end", json={"reason": "finished", "step": 10}
        )
        assert ended.status_code == 200, ended.text
        assert ended.json()["final_save_committed"] is True
        assert ended.json()["state"] == "finished"
        # Preempted, its flag is its agent's: no save after the signal committed (the
        # grace period ran out before a step boundary), though its bundle 20 had.
        cut = register(client, run_name, pod="cut")
        save(client, server.store, run_name, cut, step=20)
        ended = client.post(
            f"/v1/attempts/{cut['attempt_id']}/end", json={"reason": "preempted", "step": 31}
        )
        assert ended.json()["final_save_committed"] is False
        last = register(client, run_name, pod="last")
        save(client, server.store, run_name, last, step=40)
        assert open_bundle(client, run_name, last, step=50).status_code == 201  # not committed
        ended = client.post(
            f"/v1/attempts/{last['attempt_id']}/end", json={"reason": "finished", "step": 50}
        )
        assert ended.json()["final_save_committed"] is False  # its newest bundle did not
    found = attempts(server, run_name)
    assert found["done"]["final_save_committed"] is True
    assert found["cut"]["final_save_committed"] is False
    assert found["last"]["final_save_committed"] is False


def test_a_heartbeats_every_change_is_in_the_catalog(server: Server, run_name: str) -> None:
    """On PostgreSQL a heartbeat writes the attempt, its rank and the run's activity in one
    statement of its own, not through the session's flush: each change is read back."""
    time = {"restart_seconds": 3.0, "stall_seconds": 1.5, "train_seconds": 40.0, "steps_trained": 7}
    with server.client() as client:
        attempt = register(client, run_name, pod="beating")
        beat = {"step": 7, "rank": 1, "time": time, "interval_seconds": 120.0}
        beat["waste_seconds_per_hour"] = 30.0
        answer = client.post(f"/v1/attempts/{attempt['attempt_id']}/heartbeat", json=beat)
        assert answer.status_code == 200, answer.text
        beaten = attempts(server, run_name)["beating"]
    assert beaten["last_step"] == 7
    assert beaten["heartbeat_at"] == answer.json()["heartbeat_at"] is not None
    assert beaten["interval_seconds"] == 120.0
    assert beaten["time"]["wall_seconds"] == 44.5  # restart + stall + train
    assert beaten["time"]["train_seconds"] == 40.0
    with server.context.read() as session:
        ranks = session.execute(text("SELECT rank FROM attempt_rank")).scalars().all()
        activity = session.execute(text("SELECT state, steps_computed FROM run_activity")).one()
    assert ranks == [1]
    assert tuple(activity) == ("training", 7)
