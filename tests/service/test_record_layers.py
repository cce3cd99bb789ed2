"""``POST /v1/bundles/{id}/layers/{rank}``: every layer of one rank in one request, with the
per-layer route's fencing, validation and idempotency, and all or nothing."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ckpt.core.contract import RESTORE_ORDER, LayerRecord
from service.bundles import layers
from tests.service.conftest import Server
from tests.service.helpers import commit, make_layer, open_bundle, record, register, statements
from tests.service.test_isolation import token


def record_all(
    client: httpx.Client, bundle_id: int, rank: int, epoch: int, layers: dict[str, Any]
) -> httpx.Response:
    return client.post(
        f"/v1/bundles/{bundle_id}/layers/{rank}", json={"epoch": epoch, "layers": layers}
    )


def records(server: Server) -> dict[str, LayerRecord]:
    return {layer.value: make_layer(server.store)[0] for layer in RESTORE_ORDER}


def body(layers: dict[str, LayerRecord]) -> dict[str, Any]:
    return {layer: rec.model_dump(mode="json") for layer, rec in layers.items()}


def recorded(client: httpx.Client, bundle_id: int) -> list[tuple[int, str]]:
    shown = client.get(f"/v1/bundles/{bundle_id}").json()["recorded"]
    return sorted((r["rank"], r["layer"]) for r in shown)


def test_one_request_records_every_layer_and_the_bundle_commits(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        bundle_id = open_bundle(client, run_name, attempt, step=5).json()["id"]
        layers = records(server)
        answer = record_all(client, bundle_id, 0, attempt["epoch"], body(layers))
        assert answer.status_code == 200, answer.text
        assert [r["layer"] for r in answer.json()["recorded"]] == list(layers)
        again = record_all(client, bundle_id, 0, attempt["epoch"], body(layers))  # a retry
        assert again.status_code == 200, again.text
        assert again.json() == answer.json()
        done = commit(client, bundle_id, attempt["epoch"])
        assert done.status_code == 200, done.text
        # A layer the older route recorded is the same layer: the same content is a no-op.
        weights = layers["weights"]
        assert record(client, bundle_id, 0, "weights", attempt["epoch"], weights).status_code == 200


def test_other_content_is_refused_and_nothing_of_the_request_is_recorded(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        bundle_id = open_bundle(client, run_name, attempt, step=5).json()["id"]
        first = records(server)
        rng = record(client, bundle_id, 0, "rng", attempt["epoch"], first["rng"])
        assert rng.status_code == 200, rng.text
        other = {**records(server)}  # every layer new, rng with other content
        refused = record_all(client, bundle_id, 0, attempt["epoch"], body(other))
        assert refused.status_code == 409, refused.text
        assert "rng" in refused.json()["message"]
        assert recorded(client, bundle_id) == [(0, "rng")]


def test_a_fenced_epoch_a_bad_rank_or_body_and_another_runs_token_are_refused(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        bundle_id = open_bundle(client, run_name, attempt, step=5).json()["id"]
        layers = body(records(server))
        fenced = record_all(client, bundle_id, 0, attempt["epoch"] + 1, layers)
        assert (fenced.status_code, fenced.json()["error"]) == (409, "fenced")
        out_of_range = record_all(client, bundle_id, 1, attempt["epoch"], layers)
        assert out_of_range.status_code == 422
        assert "world size" in out_of_range.json()["message"]
        for bad in ({}, {"gradients": layers["weights"]}, {"weights": {"blobs": "x"}}):
            refused = record_all(client, bundle_id, 0, attempt["epoch"], bad)
            assert refused.status_code == 422, refused.text
        secret = token(client, f"{run_name}-other")
        foreign = httpx.post(
            f"{server.url}/v1/bundles/{bundle_id}/layers/0",
            json={"epoch": attempt["epoch"], "layers": layers},
            headers={"Authorization": f"Bearer {secret}"},
            timeout=60,
        )
        assert foreign.status_code == 403, foreign.text
        missing = record_all(client, bundle_id + 1000, 0, attempt["epoch"], layers)
        assert missing.status_code == 404
        assert recorded(client, bundle_id) == []


def test_a_record_carries_the_figures_of_earlier_saves(server: Server, run_name: str) -> None:
    figures = {"stall_seconds": 0.5, "persist_seconds": 2.0, "payload_bytes": 64, "new_bytes": 8}
    with server.client() as client:
        attempt = register(client, run_name)
        first = open_bundle(client, run_name, attempt, step=5).json()["id"]
        assert record_all(client, first, 0, attempt["epoch"], body(records(server))).is_success
        assert commit(client, first, attempt["epoch"]).status_code == 200
        second = open_bundle(client, run_name, attempt, step=6).json()["id"]
        layers = body(records(server))
        too_many = [{"bundle": first, "figures": figures}] * 17
        refused = client.post(
            f"/v1/bundles/{second}/layers/0",
            json={"epoch": attempt["epoch"], "layers": layers, "saves": too_many},
        )
        assert refused.status_code == 422, refused.text
        assert recorded(client, second) == []
        saves = [
            {"bundle": first, "figures": figures},
            {"bundle": first + 1000, "figures": figures},
        ]
        answer = client.post(
            f"/v1/bundles/{second}/layers/0",
            json={"epoch": attempt["epoch"], "layers": layers, "saves": saves},
        )
        assert answer.status_code == 200, answer.text  # the missing bundle's figures left out
        shown = client.get(f"/v1/bundles/{first}").json()["saves"]
        assert [{k: s[k] for k in figures} for s in shown] == [figures]
        assert shown[0]["rank"] == 0
        assert len(recorded(client, second)) == len(layers)


def test_a_ranks_record_runs_as_many_statements_for_six_layers_as_for_one(
    server: Server, run_name: str
) -> None:
    """One lookup and one insert of the rank's layers, one insert of their blob references
    (a statement per layer, three for each new one, was 44% of the GIL a fleet's server
    held: docs/performance.md)."""
    with server.client() as client:
        attempt = register(client, run_name)
        opened = open_bundle(client, run_name, attempt, step=1, world_size=2)
        assert opened.status_code == 201, opened.text
        bundle_id, epoch = opened.json()["id"], attempt["epoch"]
        every = body(records(server))
        one = {"weights": every["weights"]}
        counted = {
            rank: statements(
                server,
                lambda rank=rank, layers=layers: record_all(  # type: ignore[misc]
                    client, bundle_id, rank, epoch, layers
                ).raise_for_status(),
            )
            for rank, layers in ((0, one), (1, every))
        }
        assert counted[0] == counted[1]
        again = statements(
            server, lambda: record_all(client, bundle_id, 1, epoch, every).raise_for_status()
        )
        assert again < counted[1]  # recorded already: looked up, nothing inserted


def test_layers_another_record_inserted_meanwhile_are_compared_not_inserted_again(
    server: Server, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lookup misses a layer that a concurrent record inserts before this one's insert:
    # the insert skips it (ON CONFLICT), it is read again and compared.
    lookup = layers.get_layers
    missed: list[str] = []

    def missing_once(session: Any, **where: Any) -> dict[str, Any]:
        if not missed:
            missed.append("the first lookup")
            return {}
        return lookup(session, **where)

    with server.client() as client:
        attempt = register(client, run_name)
        opened = open_bundle(client, run_name, attempt, step=1, world_size=1)
        bundle_id, epoch = opened.json()["id"], attempt["epoch"]
        every = body(records(server))
        weights = {"weights": every["weights"]}
        record_all(client, bundle_id, 0, epoch, weights).raise_for_status()
        other = body({"weights": make_layer(server.store)[0]})
        with monkeypatch.context() as patched:
            patched.setattr(layers, "get_layers", missing_once)
            refused = record_all(client, bundle_id, 0, epoch, {**every, **other})
        assert refused.status_code == 409, refused.text
        assert "already recorded with other content" in refused.json()["message"]
        assert recorded(client, bundle_id) == [(0, "weights")]  # nothing of the request
        missed.clear()
        with monkeypatch.context() as patched:
            patched.setattr(layers, "get_layers", missing_once)
            record_all(client, bundle_id, 0, epoch, every).raise_for_status()
        assert missed  # the lookup did miss it
        assert recorded(client, bundle_id) == sorted((0, layer) for layer in every)
        committed = commit(client, bundle_id, epoch)
        assert committed.status_code == 200, committed.text
