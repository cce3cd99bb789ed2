"""Run isolation (issue 11, item 7): a run token learns about, and may use without writing
them, only the blobs its own run, or a run of its dedup group, has committed. Every other
blob is missing to it whether the store holds it or not, and a commit that uses one must
find it written since the bundle was opened."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx

from ckpt.core.contract import RESTORE_ORDER, BlobRef, LayerRecord
from ckpt.core.storage import keys
from tests.service.conftest import Server
from tests.service.helpers import commit, make_layer, open_bundle, record, register, save

HOUR = 3600.0


def token(admin: httpx.Client, run: str) -> str:
    created = admin.post("/v1/tokens", json={"role": "run", "run": run, "name": run[-12:]})
    assert created.status_code == 201, created.text
    secret: str = created.json()["token"]
    return secret


def missing(client: httpx.Client, blobs: list[BlobRef]) -> list[str]:
    answer = client.post(
        "/v1/blobs/missing", json={"blobs": [b.model_dump(mode="json") for b in blobs]}
    )
    assert answer.status_code == 200, answer.text
    found: list[str] = answer.json()["missing"]
    return found


def written_an_hour_ago(server: Server, blob: BlobRef) -> None:
    """Make the stored blob look as old as it would be in a real store."""
    path = server.store.root / keys.blob_key(blob.sha256)
    then = time.time() - HOUR
    os.utime(path, (then, then))


def a_runs_blob(server: Server, run: str) -> tuple[LayerRecord, BlobRef]:
    """Run ``run`` commits a bundle with its own token; a layer of it and one of its blobs,
    written an hour ago."""
    with server.client() as admin:
        secret = token(admin, run)
    with server.client(secret) as client:
        bundle = save(client, server.store, run, register(client, run), step=1)
    weights = LayerRecord.model_validate(bundle["manifest"]["ranks"][0]["layers"]["weights"])
    written_an_hour_ago(server, weights.blobs[1])
    return weights, weights.blobs[1]


def commit_using(
    client: httpx.Client, server: Server, run: str, weights: LayerRecord, *, step: int
) -> tuple[int, dict[str, Any], httpx.Response]:
    """Open a bundle of ``run``, record ``weights`` (not written) and fresh other layers
    (written now), and commit."""
    attempt = register(client, run)
    opened = open_bundle(client, run, attempt, step=step)
    assert opened.status_code == 201, opened.text
    bundle_id: int = opened.json()["id"]
    for layer in RESTORE_ORDER:
        rec = weights if layer == "weights" else make_layer(server.store)[0]
        assert record(client, bundle_id, 0, layer, attempt["epoch"], rec).status_code == 200
    return bundle_id, attempt, commit(client, bundle_id, attempt["epoch"])


def test_a_run_token_does_not_learn_that_another_runs_blob_exists(
    server: Server, run_name: str
) -> None:
    _, theirs = a_runs_blob(server, f"{run_name}-a")
    nowhere = BlobRef(sha256="ab" * 32, size=theirs.size)
    with server.client() as admin:
        own = token(admin, f"{run_name}-b")
        assert missing(admin, [theirs, nowhere]) == [nowhere.sha256]  # admins are not limited
    with server.client(own) as client:
        assert missing(client, [theirs, nowhere]) == sorted([theirs.sha256, nowhere.sha256])


def test_a_run_token_cannot_commit_another_runs_blob_without_writing_it(
    server: Server, run_name: str
) -> None:
    weights, theirs = a_runs_blob(server, f"{run_name}-a")
    run = f"{run_name}-b"
    with server.client() as admin:
        own = token(admin, run)
    with server.client(own) as client:
        bundle_id, attempt, refused = commit_using(client, server, run, weights, step=1)
        assert refused.status_code == 409, refused.text
        [problem] = refused.json()["missing"]["blobs"]
        # Told the same as for a blob no store holds: nothing about the other run's data.
        assert (problem["sha256"], problem["problem"], problem["found_size"]) == (
            theirs.sha256,
            "not_written",
            None,
        )
        assert "1 blob(s) not written" in refused.json()["message"]
        data = (server.store.root / keys.blob_key(theirs.sha256)).read_bytes()
        server.store.put(keys.blob_key(theirs.sha256), [data])  # the run writes it itself
        done = commit(client, bundle_id, attempt["epoch"])
        assert done.status_code == 200, done.text
        assert missing(client, [theirs]) == []  # its run has committed it now


def test_a_pending_bundle_does_not_make_a_blob_the_runs(server: Server, run_name: str) -> None:
    weights, theirs = a_runs_blob(server, f"{run_name}-a")
    run = f"{run_name}-b"
    with server.client() as admin:
        own = token(admin, run)
    with server.client(own) as client:
        attempt = register(client, run)
        opened = open_bundle(client, run, attempt, step=1)
        recorded = record(client, opened.json()["id"], 0, "weights", attempt["epoch"], weights)
        assert recorded.status_code == 200, recorded.text
        assert missing(client, [theirs]) == [theirs.sha256]


def test_runs_of_one_dedup_group_use_each_others_blobs(server: Server, run_name: str) -> None:
    first, second = f"{run_name}-a", f"{run_name}-b"
    weights, theirs = a_runs_blob(server, first)
    with server.client() as admin:
        own = token(admin, second)
        register(admin, second)
        with server.client(own) as client:
            refused = client.patch(f"/v1/runs/{second}", json={"dedup_group": "team"})
            assert refused.status_code == 403, refused.text
            assert client.patch(f"/v1/runs/{second}", json={"keep_last": 3}).status_code == 200
        for run in (first, second):
            patched = admin.patch(f"/v1/runs/{run}", json={"dedup_group": "team"})
            assert patched.status_code == 200, patched.text
            assert patched.json()["dedup_group"] == "team"
        assert admin.get(f"/v1/runs/{second}").json()["keep_last"] == 3
    with server.client(own) as client:
        assert missing(client, [theirs]) == []
        _, _, done = commit_using(client, server, second, weights, step=1)
        assert done.status_code == 200, done.text
    with server.client() as admin:
        for run in (first, second):
            assert admin.patch(f"/v1/runs/{run}", json={"dedup_group": None}).status_code == 200
    fresh, _ = make_layer(server.store)  # first commits a blob second never used
    with server.client() as admin:
        secret = token(admin, first)
    with server.client(secret) as client:
        _, _, done = commit_using(client, server, first, fresh, step=2)
        assert done.status_code == 200, done.text
    with server.client(own) as client:
        assert missing(client, [fresh.blobs[1]]) == [fresh.blobs[1].sha256]
        assert missing(client, [theirs]) == []  # committed by its own run meanwhile
