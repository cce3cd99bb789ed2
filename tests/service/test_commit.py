"""Completeness over HTTP: a commit refuses an incomplete bundle, listing exactly what is
missing, and accepts it once the problem is fixed; opens, records and commits are idempotent."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from ckpt.core.contract import RESTORE_ORDER, Layer, LayerRecord
from ckpt.core.storage import keys
from tests.service.conftest import Server
from tests.service.helpers import commit, make_layer, open_bundle, put_blob, record, register, save

STEP = 20
OLDER_STEP = 10


def part(rank: int, layer: Layer) -> dict[str, Any]:
    return {"rank": rank, "layer": str(layer)}


def get_json(client: httpx.Client, path: str) -> dict[str, Any]:
    response = client.get(path)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@dataclass
class Broken:
    """A bundle with one problem: what commit must list, and how to fix it."""

    world_size: int
    expected: dict[str, Any]
    fix: Callable[[], None]


@dataclass
class Builder:
    """Records layers of one open bundle."""

    client: httpx.Client
    server: Server
    bundle_id: int
    epoch: int

    def record_ok(self, rank: int, layer: Layer) -> None:
        rec, _ = make_layer(self.server.store)
        response = record(self.client, self.bundle_id, rank, layer, self.epoch, rec)
        assert response.status_code == 200, response.text

    def record_rank(self, rank: int, *, skip: Layer | None = None) -> None:
        for layer in RESTORE_ORDER:
            if layer != skip:
                self.record_ok(rank, layer)

    def bad_blob(self, stored: Callable[[bytes], bytes | None], problem: str) -> Broken:
        """Every layer recorded; the data blob of rank 0's weights is stored as
        ``stored(data)`` (None: not at all)."""
        self.record_rank(0, skip=Layer.WEIGHTS)
        rec, pieces = make_layer(self.server.store, upload=False)
        header, data = pieces
        put_blob(self.server.store, header)
        bad = stored(data)
        if bad is not None:
            self.server.store.put(keys.blob_key(hashlib.sha256(data).hexdigest()), [bad])
        response = record(self.client, self.bundle_id, 0, Layer.WEIGHTS, self.epoch, rec)
        assert response.status_code == 200, response.text
        expected = {
            "ranks": [],
            "layers": [],
            "blobs": [
                {
                    "sha256": rec.blobs[1].sha256,
                    "size": len(data),
                    "problem": problem,
                    "found_size": None if bad is None else len(bad),
                    "used_by": [part(0, Layer.WEIGHTS)],
                }
            ],
        }

        def fix() -> None:
            put_blob(self.server.store, data)

        return Broken(world_size=1, expected=expected, fix=fix)


def missing_layer(b: Builder) -> Broken:
    b.record_rank(0, skip=Layer.COUNTERS)
    return Broken(
        world_size=1,
        expected={"ranks": [], "layers": [part(0, Layer.COUNTERS)], "blobs": []},
        fix=lambda: b.record_ok(0, Layer.COUNTERS),
    )


def missing_rank(b: Builder) -> Broken:
    b.record_rank(0)
    return Broken(
        world_size=2,
        expected={
            "ranks": [1],
            "layers": [part(1, layer) for layer in RESTORE_ORDER],
            "blobs": [],
        },
        fix=lambda: b.record_rank(1),
    )


def blob_absent(b: Builder) -> Broken:
    return b.bad_blob(lambda data: None, "absent")


def blob_wrong_size(b: Builder) -> Broken:
    return b.bad_blob(lambda data: data + b"x", "wrong_size")


BREAKS: dict[str, tuple[int, Callable[[Builder], Broken]]] = {
    "missing_layer": (1, missing_layer),
    "missing_rank": (2, missing_rank),
    "blob_absent": (1, blob_absent),
    "blob_wrong_size": (1, blob_wrong_size),
}
# A blob of its size with other bytes commits: a commit reads no bytes. The scrubber and
# every restore hash them (tests/service/test_commit_reads_no_bytes.py).


@pytest.mark.parametrize("older", [False, True], ids=["no_older", "older_complete"])
@pytest.mark.parametrize("case", sorted(BREAKS))
def test_incomplete_commit_is_refused_until_fixed(
    server: Server, run_name: str, case: str, older: bool
) -> None:
    world_size, breaker = BREAKS[case]
    with server.client() as client:
        attempt = register(client, run_name)
        epoch = attempt["epoch"]
        older_id = (
            save(client, server.store, run_name, attempt, step=OLDER_STEP)["id"] if older else None
        )
        opened = open_bundle(client, run_name, attempt, step=STEP, world_size=world_size)
        assert opened.status_code == 201, opened.text
        bundle_id = opened.json()["id"]
        broken = breaker(Builder(client, server, bundle_id, epoch))

        for _ in range(2):  # a retry lists the same
            refused = commit(client, bundle_id, epoch)
            assert refused.status_code == 409, refused.text
            body = refused.json()
            assert body["error"] == "incomplete"
            assert isinstance(body["message"], str) and body["message"]
            assert body["missing"] == broken.expected

        bundle = get_json(client, f"/v1/bundles/{bundle_id}")
        assert bundle["status"] == "pending"
        assert bundle["manifest"] is None
        assert bundle["committed_at"] is None
        run = get_json(client, f"/v1/runs/{run_name}")
        assert (run["head"] or {}).get("id") == older_id
        assert (run["resumable"] or {}).get("id") == older_id
        resumable = client.get(f"/v1/runs/{run_name}/resumable")
        if older_id is None:
            assert resumable.status_code == 404, resumable.text
            assert resumable.json()["error"] == "not_found"
        else:
            assert resumable.status_code == 200, resumable.text
            assert resumable.json()["bundle_id"] == older_id
        assert server.store.size(keys.manifest_key(run_name, STEP)) is None

        broken.fix()
        done = commit(client, bundle_id, epoch)
        assert done.status_code == 200, done.text
        committed = done.json()
        assert committed["head_id"] == bundle_id
        assert committed["bundle"]["status"] == "complete"
        assert committed["bundle"]["missing_layers"] == []
        manifest = committed["bundle"]["manifest"]
        assert manifest["step"] == STEP and manifest["world_size"] == world_size
        assert manifest["catalog"] == {
            "bundle_id": bundle_id,
            "parent_id": older_id,
            "epoch": epoch,
        }
        assert [r["rank"] for r in manifest["ranks"]] == list(range(world_size))
        stored = json.loads(server.store.get(keys.manifest_key(run_name, STEP)))
        assert stored == manifest

        resumable = client.get(f"/v1/runs/{run_name}/resumable")
        assert resumable.status_code == 200, resumable.text
        point = resumable.json()
        assert point["bundle_id"] == bundle_id
        assert point["step"] == STEP
        assert point["manifest"] == manifest
        assert get_json(client, f"/v1/bundles/{bundle_id}") == committed["bundle"]


def test_open_is_idempotent_per_attempt_and_step(server: Server, run_name: str) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        first = open_bundle(client, run_name, attempt, step=5, world_size=2)
        assert first.status_code == 201, first.text
        again = open_bundle(client, run_name, attempt, step=5, world_size=2)
        assert again.status_code in (200, 201), again.text
        assert again.json()["id"] == first.json()["id"]
        assert again.json() == first.json()
        lineage = get_json(client, f"/v1/runs/{run_name}/lineage")
        assert [b["id"] for b in lineage["bundles"]] == [first.json()["id"]]

        other_size = open_bundle(client, run_name, attempt, step=5, world_size=3)
        assert other_size.status_code == 409, other_size.text
        assert other_size.json()["error"] == "conflict"
        assert get_json(client, f"/v1/runs/{run_name}/lineage") == lineage


def test_recording_is_idempotent_and_shows_in_the_bundle(server: Server, run_name: str) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        epoch = attempt["epoch"]
        opened = open_bundle(client, run_name, attempt, step=5, world_size=2)
        assert opened.status_code == 201, opened.text
        bundle_id = opened.json()["id"]
        fresh = get_json(client, f"/v1/bundles/{bundle_id}")
        assert fresh["recorded"] == []
        assert fresh["missing_layers"] == [
            part(rank, layer) for rank in range(2) for layer in RESTORE_ORDER
        ]

        rec, _ = make_layer(server.store, size=100)
        first = record(client, bundle_id, 1, Layer.OPTIMIZER, epoch, rec)
        assert first.status_code == 200, first.text
        assert first.json() == {
            "rank": 1,
            "layer": "optimizer",
            "payload_bytes": rec.payload_bytes,
            "num_blobs": 2,
        }
        again = record(client, bundle_id, 1, Layer.OPTIMIZER, epoch, rec)
        assert again.status_code == 200, again.text
        assert again.json() == first.json()
        before = get_json(client, f"/v1/bundles/{bundle_id}")

        other, _ = make_layer(server.store, size=100)
        conflict = record(client, bundle_id, 1, Layer.OPTIMIZER, epoch, other)
        assert conflict.status_code == 409, conflict.text
        assert conflict.json()["error"] == "conflict"
        assert "optimizer" in conflict.json()["message"]
        assert get_json(client, f"/v1/bundles/{bundle_id}") == before

        assert before["status"] == "pending"
        assert before["recorded"] == [first.json()]
        assert before["missing_layers"] == [
            part(rank, layer)
            for rank in range(2)
            for layer in RESTORE_ORDER
            if (rank, layer) != (1, Layer.OPTIMIZER)
        ]

        rec0, _ = make_layer(server.store, size=8)
        assert record(client, bundle_id, 0, Layer.RNG, epoch, rec0).status_code == 200
        shown = get_json(client, f"/v1/bundles/{bundle_id}")
        assert sorted((r["rank"], r["layer"]) for r in shown["recorded"]) == [
            (0, "rng"),
            (1, "optimizer"),
        ]
        assert len(shown["missing_layers"]) == 10
        assert part(0, Layer.RNG) not in shown["missing_layers"]


def test_commit_retry_on_a_complete_bundle(server: Server, run_name: str) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        bundle = save(client, server.store, run_name, attempt, step=3)
        lineage = get_json(client, f"/v1/runs/{run_name}/lineage")
        for _ in range(2):
            retry = commit(client, bundle["id"], attempt["epoch"])
            assert retry.status_code == 200, retry.text
            assert retry.json() == {"bundle": bundle, "head_id": bundle["id"]}
        assert get_json(client, f"/v1/runs/{run_name}/lineage") == lineage

        # A complete bundle takes no new layers, but an identical re-record is a no-op.
        rec, _ = make_layer(server.store)
        late = record(client, bundle["id"], 0, Layer.WEIGHTS, attempt["epoch"], rec)
        assert late.status_code == 409, late.text
        assert get_json(client, f"/v1/bundles/{bundle['id']}") == bundle


def test_fresh_attempt_cannot_open_on_a_run_with_a_head(server: Server, run_name: str) -> None:
    with server.client() as client:
        first = register(client, run_name)
        bundle = save(client, server.store, run_name, first, step=10)
        fresh = register(client, run_name, resume=False)
        assert fresh["resume_from"] is None
        lineage = get_json(client, f"/v1/runs/{run_name}/lineage")
        for step in (5, 10, 20):
            refused = open_bundle(client, run_name, fresh, step=step)
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"] == "conflict"
            assert "resume" in refused.json()["message"]
        assert get_json(client, f"/v1/runs/{run_name}/lineage") == lineage
        assert get_json(client, f"/v1/runs/{run_name}")["head"]["id"] == bundle["id"]


def test_fresh_attempt_may_open_on_a_run_without_a_head(server: Server, run_name: str) -> None:
    with server.client() as client:
        register(client, run_name)
        fresh = register(client, run_name, resume=False)
        bundle = save(client, server.store, run_name, fresh, step=0)
        assert bundle["status"] == "complete"


def test_open_behind_the_resumed_step_is_refused(server: Server, run_name: str) -> None:
    with server.client() as client:
        first = register(client, run_name)
        bundle = save(client, server.store, run_name, first, step=10)
        second = register(client, run_name)
        assert second["resume_from"]["bundle_id"] == bundle["id"]
        lineage = get_json(client, f"/v1/runs/{run_name}/lineage")
        for step in (0, 9):
            refused = open_bundle(client, run_name, second, step=step)
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"] == "conflict"
            assert f"step {step} is behind step 10" in refused.json()["message"]
        assert get_json(client, f"/v1/runs/{run_name}/lineage") == lineage

        # Behind the attempt's own latest complete save is refused too.
        later = save(client, server.store, run_name, second, step=30)
        behind = open_bundle(client, run_name, second, step=20)
        assert behind.status_code == 409, behind.text
        ahead = open_bundle(client, run_name, second, step=31)
        assert ahead.status_code == 201, ahead.text
        assert ahead.json()["parent_id"] == later["id"]


def test_blob_shared_by_layers_is_listed_once(server: Server, run_name: str) -> None:
    """A missing blob used by several layers is listed once, with every user."""
    with server.client() as client:
        attempt = register(client, run_name)
        epoch = attempt["epoch"]
        opened = open_bundle(client, run_name, attempt, step=1)
        bundle_id = opened.json()["id"]
        data = os.urandom(32)
        rec, pieces = make_layer(server.store, upload=False, data=data)
        for layer in (Layer.RNG, Layer.DATA):
            assert record(client, bundle_id, 0, layer, epoch, rec).status_code == 200
        for layer in (Layer.WEIGHTS, Layer.OPTIMIZER, Layer.SCHEDULER, Layer.COUNTERS):
            Builder(client, server, bundle_id, epoch).record_ok(0, layer)
        refused = commit(client, bundle_id, epoch)
        assert refused.status_code == 409, refused.text
        shas = [hashlib.sha256(p).hexdigest() for p in pieces]
        users = [part(0, Layer.RNG), part(0, Layer.DATA)]  # rank, then restore order
        expected_blobs = sorted(
            (
                {
                    "sha256": sha,
                    "size": len(piece),
                    "problem": "absent",
                    "found_size": None,
                    "used_by": users,
                }
                for sha, piece in zip(shas, pieces, strict=True)
            ),
            key=lambda blob: str(blob["sha256"]),
        )
        assert refused.json()["missing"] == {"ranks": [], "layers": [], "blobs": expected_blobs}
        for piece in pieces:
            put_blob(server.store, piece)
        assert commit(client, bundle_id, epoch).status_code == 200


def _layer_record_of(manifest: dict[str, Any], rank: int, layer: Layer) -> LayerRecord:
    ranks = {r["rank"]: r for r in manifest["ranks"]}
    return LayerRecord.model_validate(ranks[rank]["layers"][str(layer)])


def test_manifest_lists_the_recorded_layers(server: Server, run_name: str) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        epoch = attempt["epoch"]
        opened = open_bundle(client, run_name, attempt, step=7, world_size=2)
        bundle_id = opened.json()["id"]
        records: dict[tuple[int, Layer], LayerRecord] = {}
        for rank in (1, 0):
            for layer in RESTORE_ORDER:
                rec, _ = make_layer(server.store, size=16 + rank)
                records[rank, layer] = rec
                assert record(client, bundle_id, rank, layer, epoch, rec).status_code == 200
        done = commit(client, bundle_id, epoch)
        assert done.status_code == 200, done.text
        manifest = done.json()["bundle"]["manifest"]
        for (rank, layer), rec in records.items():
            assert _layer_record_of(manifest, rank, layer) == rec
        assert json.loads(server.store.get(keys.manifest_key(run_name, 7))) == manifest
