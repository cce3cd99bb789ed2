"""Fencing over HTTP: once a newer attempt registers (or the run is rolled back), every
write of an older attempt is refused with ``fenced`` and changes nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from ckpt.core.contract import RESTORE_ORDER, Layer, LayerRecord
from ckpt.core.storage import keys
from tests.service.conftest import Server
from tests.service.helpers import (
    VERSIONS,
    commit,
    make_layer,
    open_bundle,
    record,
    register,
    save,
)


def get_json(client: httpx.Client, path: str) -> dict[str, Any]:
    response = client.get(path)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def assert_fenced(response: httpx.Response) -> None:
    assert response.status_code == 409, response.text
    body = response.json()
    assert body["error"] == "fenced", body
    assert "fenced" in body["message"]


@dataclass
class World:
    """Attempt A saved step 10 and recorded every layer of a pending step-20 bundle (so only
    its commit is left); then attempt B registered."""

    run: str
    a: dict[str, Any]
    b: dict[str, Any]
    saved: dict[str, Any]  # A's complete step-10 bundle
    pending_id: int  # A's pending step-20 bundle
    records: dict[Layer, LayerRecord]  # what A recorded in it (all but the last layer)

    def snapshot(self, client: httpx.Client, server: Server) -> dict[str, Any]:
        return {
            "bundle": get_json(client, f"/v1/bundles/{self.pending_id}"),
            "run": get_json(client, f"/v1/runs/{self.run}"),
            "lineage": get_json(client, f"/v1/runs/{self.run}/lineage"),
            "manifest_20": server.store.size(keys.manifest_key(self.run, 20)),
        }


def fence_a(client: httpx.Client, server: Server, run: str) -> World:
    a = register(client, run)
    saved = save(client, server.store, run, a, step=10)
    opened = open_bundle(client, run, a, step=20)
    assert opened.status_code == 201, opened.text
    pending_id = opened.json()["id"]
    records = {}
    for layer in RESTORE_ORDER:
        rec, _ = make_layer(server.store)
        records[layer] = rec
        if layer is RESTORE_ORDER[-1]:
            continue  # A is still writing: a whole bundle would be rolled forward by B
        response = record(client, pending_id, 0, layer, a["epoch"], rec)
        assert response.status_code == 200, response.text
    b = register(client, run)
    assert b["epoch"] == a["epoch"] + 1
    assert b["resume_from"]["bundle_id"] == saved["id"]
    return World(run=run, a=a, b=b, saved=saved, pending_id=pending_id, records=records)


def a_writes(world: World, server: Server) -> dict[str, Any]:
    """Every write attempt A might still try, as httpx request arguments."""
    rec, _ = make_layer(server.store)
    a = world.a
    open_body = {
        "attempt_id": a["attempt_id"],
        "epoch": a["epoch"],
        "world_size": 1,
        "versions": VERSIONS,
    }
    return {
        "open_new": ("POST", f"/v1/runs/{world.run}/bundles", {**open_body, "step": 30}),
        "reopen_pending": ("POST", f"/v1/runs/{world.run}/bundles", {**open_body, "step": 20}),
        "record": (
            "PUT",
            f"/v1/bundles/{world.pending_id}/layers/0/weights",
            {"epoch": a["epoch"], "record": rec.model_dump(mode="json")},
        ),
        "record_again": (  # the very record it made before
            "PUT",
            f"/v1/bundles/{world.pending_id}/layers/0/weights",
            {"epoch": a["epoch"], "record": world.records[Layer.WEIGHTS].model_dump(mode="json")},
        ),
        "commit": ("POST", f"/v1/bundles/{world.pending_id}/commit", {"epoch": a["epoch"]}),
        "commit_saved": ("POST", f"/v1/bundles/{world.saved['id']}/commit", {"epoch": a["epoch"]}),
        "heartbeat": ("POST", f"/v1/attempts/{a['attempt_id']}/heartbeat", {"step": 25}),
        "heartbeat_empty": ("POST", f"/v1/attempts/{a['attempt_id']}/heartbeat", {}),
    }


WRITES = [
    "open_new",
    "reopen_pending",
    "record",
    "record_again",
    "commit",
    "commit_saved",
    "heartbeat",
    "heartbeat_empty",
]


@pytest.mark.parametrize("write", WRITES)
def test_fenced_attempt_changes_nothing(server: Server, run_name: str, write: str) -> None:
    with server.client() as client:
        world = fence_a(client, server, run_name)
        method, path, body = a_writes(world, server)[write]
        before = world.snapshot(client, server)
        for _ in range(2):
            assert_fenced(client.request(method, path, json=body))
        assert world.snapshot(client, server) == before
        attempts = {a["id"]: a for a in before["lineage"]["attempts"]}
        assert attempts[world.a["attempt_id"]]["fenced"] is True
        assert attempts[world.b["attempt_id"]]["fenced"] is False
        assert before["run"]["head"]["id"] == world.saved["id"]


def test_fenced_attempt_cannot_move_the_head_while_the_new_one_can(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        world = fence_a(client, server, run_name)
        assert_fenced(commit(client, world.pending_id, world.a["epoch"]))

        b_saved = save(client, server.store, run_name, world.b, step=20)
        assert b_saved["attempt_id"] == world.b["attempt_id"]
        assert b_saved["parent_id"] == world.saved["id"]
        run = get_json(client, f"/v1/runs/{run_name}")
        assert run["head"]["id"] == b_saved["id"]
        assert run["epoch"] == world.b["epoch"]

        lineage = get_json(client, f"/v1/runs/{run_name}/lineage")
        pending_before = get_json(client, f"/v1/bundles/{world.pending_id}")
        for write, (method, path, body) in a_writes(world, server).items():
            response = client.request(method, path, json=body)
            assert_fenced(response)
            assert get_json(client, f"/v1/runs/{run_name}/lineage") == lineage, write
        assert get_json(client, f"/v1/bundles/{world.pending_id}") == pending_before
        assert pending_before["status"] == "pending"
        assert get_json(client, f"/v1/runs/{run_name}/resumable")["bundle_id"] == b_saved["id"]

        beat = client.post(f"/v1/attempts/{world.b['attempt_id']}/heartbeat", json={"step": 21})
        assert beat.status_code == 200, beat.text
        assert beat.json()["fenced"] is False
        assert beat.json()["last_step"] == 21


def forged(world: World) -> dict[str, tuple[dict[str, Any], int]]:
    """(attempt, claimed epoch) pairs that do not belong together, or are not current."""
    a, b = world.a, world.b
    return {
        "b_attempt_a_epoch": (b, a["epoch"]),
        "a_attempt_b_epoch": (a, b["epoch"]),
        "b_attempt_future_epoch": (b, b["epoch"] + 1),
        "a_attempt_future_epoch": (a, b["epoch"] + 1),
    }


FORGERIES = [
    "b_attempt_a_epoch",
    "a_attempt_b_epoch",
    "b_attempt_future_epoch",
    "a_attempt_future_epoch",
]


@pytest.mark.parametrize("forgery", FORGERIES)
def test_forged_epochs_are_fenced(server: Server, run_name: str, forgery: str) -> None:
    with server.client() as client:
        world = fence_a(client, server, run_name)
        opened_b = open_bundle(client, run_name, world.b, step=20)
        assert opened_b.status_code == 201, opened_b.text
        b_bundle = opened_b.json()["id"]
        attempt, epoch = forged(world)[forgery]
        own_bundle = b_bundle if attempt is world.b else world.pending_id
        before = world.snapshot(client, server)
        b_before = get_json(client, f"/v1/bundles/{b_bundle}")
        rec, _ = make_layer(server.store)

        claimed = {**attempt, "epoch": epoch}
        assert_fenced(open_bundle(client, run_name, claimed, step=40))
        assert_fenced(open_bundle(client, run_name, claimed, step=20))
        # A record or commit names its attempt through the bundle.
        assert_fenced(record(client, own_bundle, 0, Layer.WEIGHTS, epoch, rec))
        assert_fenced(commit(client, own_bundle, epoch))

        assert world.snapshot(client, server) == before
        assert get_json(client, f"/v1/bundles/{b_bundle}") == b_before

        # B, naming its own epoch, is not affected.
        for layer in RESTORE_ORDER:
            good, _ = make_layer(server.store)
            assert record(client, b_bundle, 0, layer, world.b["epoch"], good).status_code == 200
        done = commit(client, b_bundle, world.b["epoch"])
        assert done.status_code == 200, done.text
        assert done.json()["head_id"] == b_bundle


def test_rollback_fences_the_live_attempt(server: Server, run_name: str) -> None:
    with server.client() as client:
        a = register(client, run_name)
        first = save(client, server.store, run_name, a, step=10)
        second = save(client, server.store, run_name, a, step=20)
        opened = open_bundle(client, run_name, a, step=30)
        assert opened.status_code == 201, opened.text
        pending_id = opened.json()["id"]
        for layer in RESTORE_ORDER:
            rec, _ = make_layer(server.store)
            assert record(client, pending_id, 0, layer, a["epoch"], rec).status_code == 200
        assert get_json(client, f"/v1/runs/{run_name}")["head"]["id"] == second["id"]

        rolled = client.post(f"/v1/runs/{run_name}/rollback", json={"bundle_id": first["id"]})
        assert rolled.status_code == 200, rolled.text
        assert rolled.json()["epoch"] == a["epoch"] + 1
        assert rolled.json()["from_bundle_id"] == second["id"]
        assert rolled.json()["head"]["id"] == first["id"]

        lineage = get_json(client, f"/v1/runs/{run_name}/lineage")
        run = get_json(client, f"/v1/runs/{run_name}")
        pending = get_json(client, f"/v1/bundles/{pending_id}")
        assert run["head"]["id"] == first["id"]
        assert [r["to_bundle_id"] for r in lineage["rollbacks"]] == [first["id"]]
        assert lineage["attempts"][0]["fenced"] is True

        rec, _ = make_layer(server.store)
        assert_fenced(commit(client, pending_id, a["epoch"]))
        assert_fenced(open_bundle(client, run_name, a, step=40))
        assert_fenced(record(client, pending_id, 0, Layer.WEIGHTS, a["epoch"], rec))
        assert_fenced(client.post(f"/v1/attempts/{a['attempt_id']}/heartbeat", json={"step": 1}))
        assert_fenced(commit(client, pending_id, a["epoch"] + 1))  # the run's new epoch
        assert get_json(client, f"/v1/runs/{run_name}/lineage") == lineage
        assert get_json(client, f"/v1/runs/{run_name}") == run
        assert get_json(client, f"/v1/bundles/{pending_id}") == pending
        assert get_json(client, f"/v1/runs/{run_name}/resumable")["bundle_id"] == first["id"]
        assert server.store.size(keys.manifest_key(run_name, 30)) is None

        c = register(client, run_name)
        assert c["epoch"] == a["epoch"] + 2
        assert c["resume_from"]["bundle_id"] == first["id"]
        third = save(client, server.store, run_name, c, step=20)
        assert third["parent_id"] == first["id"]
        assert get_json(client, f"/v1/runs/{run_name}")["head"]["id"] == third["id"]


def test_end_is_accepted_from_a_fenced_attempt(server: Server, run_name: str) -> None:
    with server.client() as client:
        world = fence_a(client, server, run_name)
        a_id = world.a["attempt_id"]
        run_before = get_json(client, f"/v1/runs/{run_name}")
        ended = client.post(
            f"/v1/attempts/{a_id}/end",
            json={"reason": "preempted", "final_save_committed": False, "step": 20},
        )
        assert ended.status_code == 200, ended.text
        out = ended.json()
        assert out["id"] == a_id
        assert out["end_reason"] == "preempted"
        assert out["ended_at"] is not None
        assert out["fenced"] is True
        assert out["last_step"] == 20
        retry = client.post(
            f"/v1/attempts/{a_id}/end",
            json={"reason": "preempted", "final_save_committed": False, "step": 20},
        )
        assert retry.status_code == 200, retry.text
        assert retry.json() == out

        lineage = get_json(client, f"/v1/runs/{run_name}/lineage")
        attempts = {a["id"]: a for a in lineage["attempts"]}
        assert attempts[a_id]["end_reason"] == "preempted"
        assert attempts[world.b["attempt_id"]]["ended_at"] is None
        # Ending is history: it does not fence B, move the head or unfence A. It does make
        # A's steps lost known: it reported step 20, B resumed from step 10.
        assert attempts[a_id]["steps_lost"] == 10
        assert get_json(client, f"/v1/runs/{run_name}") == {**run_before, "steps_lost_total": 10}
        assert_fenced(commit(client, world.pending_id, world.a["epoch"]))
        b_saved = save(client, server.store, run_name, world.b, step=30)
        assert get_json(client, f"/v1/runs/{run_name}")["head"]["id"] == b_saved["id"]
