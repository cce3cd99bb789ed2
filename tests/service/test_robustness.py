"""Defects a review found, kept fixed: lock order, conflicting blob sizes, steps going back,
control characters, bind-parameter limits, and idempotent catalog rebuilds."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from pathlib import Path

import pytest

from ckpt.core.contract import RESTORE_ORDER, BlobRef, LayerRecord, TensorEntry
from ckpt.core.storage import keys
from service.context import Context
from service.db import upgrade
from service.gc import service as gc
from service.models import Blob
from service.rebuild import rebuild
from service.settings import Settings
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import (
    commit,
    make_layer,
    open_bundle,
    put_blob,
    record,
    register,
    save,
)


def test_heartbeats_and_opens_do_not_deadlock(make_server: MakeServer, run_name: str) -> None:
    """Heartbeats lock the attempt, opening a bundle references it: the run is locked first
    by both, and the attempt only FOR NO KEY UPDATE, so Postgres finds no deadlock."""
    server = make_server("postgres")
    with server.client() as client:
        attempt = register(client, run_name)
    statuses: Counter[tuple[str, int]] = Counter()
    stop = threading.Event()

    def beat() -> None:
        with server.client() as client:
            while not stop.is_set():
                answer = client.post(
                    f"/v1/attempts/{attempt['attempt_id']}/heartbeat", json={"step": 1}
                )
                statuses["heartbeat", answer.status_code] += 1

    def open_many(first: int) -> None:
        with server.client() as client:
            for step in range(first, first + 30):
                statuses["open", open_bundle(client, run_name, attempt, step=step).status_code] += 1

    beaters = [threading.Thread(target=beat) for _ in range(2)]
    openers = [threading.Thread(target=open_many, args=(i * 100,)) for i in range(2)]
    for thread in beaters + openers:
        thread.start()
    for thread in openers:
        thread.join()
    stop.set()
    for thread in beaters:
        thread.join()
    assert statuses["heartbeat", 200] > 0
    # Opens interleave: one thread's lower steps come after the other's higher ones (409).
    assert {status for (_, status) in statuses} <= {200, 201, 409}, statuses


def test_a_record_listing_one_blob_with_two_sizes_is_refused(server: Server, run_name: str) -> None:
    sha = hashlib.sha256(b"the real blob").hexdigest()
    body = {
        "payload_bytes": 30,
        "header_bytes": 20,
        "blobs": [{"sha256": sha, "size": 20}, {"sha256": sha, "size": 10}],
        "tensors": {"t": {"dtype": "U8", "shape": [10], "data_offsets": [0, 10]}},
    }
    with server.client() as client:
        attempt = register(client, run_name)
        bundle = open_bundle(client, run_name, attempt, step=1).json()
        answer = client.put(
            f"/v1/bundles/{bundle['id']}/layers/0/weights",
            json={"epoch": attempt["epoch"], "record": body},
        )
    assert answer.status_code == 422
    assert "one SHA-256, one content, one size" in answer.json()["message"]


def test_a_wrong_size_claimed_by_one_run_does_not_block_another(server: Server) -> None:
    with server.client() as admin:
        tokens = {
            run: admin.post("/v1/tokens", json={"role": "run", "run": run}).json()["token"]
            for run in ("run-x", "run-y")
        }
    data = bytes(64)  # a zero tensor: the kind of blob many runs share
    sha = hashlib.sha256(data).hexdigest()
    with server.client(tokens["run-x"]) as x:
        attempt = register(x, "run-x")
        bundle = open_bundle(x, "run-x", attempt, step=0).json()
        header = put_blob(server.store, b"h" * 10)
        wrong = LayerRecord(
            payload_bytes=75,
            header_bytes=10,
            blobs=(header, BlobRef(sha256=sha, size=65)),
            tensors={"t": TensorEntry(dtype="U8", shape=(65,), data_offsets=(0, 65))},
        )
        assert record(x, bundle["id"], 0, "weights", attempt["epoch"], wrong).status_code == 200
    with server.client(tokens["run-y"]) as y:
        bundle_y = save(y, server.store, "run-y", register(y, "run-y"), step=0)
        rec, _ = make_layer(server.store, data=data)
        attempt_y = register(y, "run-y")
        opened = open_bundle(y, "run-y", attempt_y, step=1).json()
        assert record(y, opened["id"], 0, "weights", attempt_y["epoch"], rec).status_code == 200
        for layer in RESTORE_ORDER[1:]:
            other, _ = make_layer(server.store)
            assert record(y, opened["id"], 0, layer, attempt_y["epoch"], other).status_code == 200
        assert commit(y, opened["id"], attempt_y["epoch"]).status_code == 200
    assert bundle_y["status"] == "complete"
    # The commit found the stored size and wrote it over the one run-x's record claimed.
    with server.context.transaction() as session:
        blob = session.get(Blob, sha)
        assert blob is not None and blob.size == 64 and blob.verified_at is not None


def test_steps_never_go_back_within_an_attempt(server: Server, run_name: str) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        assert open_bundle(client, run_name, attempt, step=20).status_code == 201
        behind = open_bundle(client, run_name, attempt, step=10)
    assert behind.status_code == 409
    assert "behind step 20" in behind.json()["message"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/runs/{run}/attempts", {"pod": "pod\x00"}),
        ("POST", "/v1/runs/{run}/attempts", {"node": "a\nb"}),
        ("POST", "/v1/tokens", {"role": "read", "name": "x\x00"}),
        ("GET", "/v1/runs?prefix=a%00", None),
        ("GET", "/v1/runs?after=a%00", None),
    ],
)
def test_control_characters_are_refused(
    server: Server, run_name: str, method: str, path: str, body: object
) -> None:
    with server.client() as client:
        answer = client.request(method, path.format(run=run_name), json=body)
    assert answer.status_code == 422, answer.text
    assert "should match pattern" in answer.json()["message"]


@pytest.mark.slow
def test_layers_of_many_blobs_fit_the_bind_parameter_limits(server: Server, run_name: str) -> None:
    count = 17_000  # x 4 parameters per blob claim > Postgres's 65535
    datas = [b"%08d" % i for i in range(count)]
    with server.store.batch():  # durable together: 17,000 fsyncs one by one took ~25 s
        refs = tuple(put_blob(server.store, data) for data in datas)
    record_ = LayerRecord(
        payload_bytes=8 * count,
        header_bytes=8,
        blobs=refs,
        tensors={
            "t": TensorEntry(
                dtype="U8", shape=(8 * (count - 1),), data_offsets=(0, 8 * (count - 1))
            )
        },
    )
    with server.client() as client:
        # A query holds at most 10,000 blobs (test_bounds.py): ask in two.
        for page in (refs[:10_000], refs[10_000:]):
            body = {"blobs": [r.model_dump() for r in page]}
            missing = client.post("/v1/blobs/missing", json=body)
            assert missing.status_code == 200 and missing.json() == {"missing": []}
        attempt = register(client, run_name)
        bundle = open_bundle(client, run_name, attempt, step=0).json()
        assert (
            record(client, bundle["id"], 0, "weights", attempt["epoch"], record_).status_code == 200
        )


def test_rebuilding_twice_adds_nothing_and_retention_cleans_rebuilt_bundles(
    make_server: MakeServer, tmp_path: Path
) -> None:
    server = make_server("sqlite")
    with server.client() as client:
        attempts = {run: register(client, run) for run in ("ra", "rb")}
        bundles = {
            (run, step): save(client, server.store, run, attempts[run], step=step)
            for step in (1, 2, 3)
            for run in ("ra", "rb")
        }
    damaged = bundles["rb", 1]["manifest"]["ranks"][0]["layers"]["weights"]["blobs"][1]
    server.store.delete(keys.blob_key(damaged["sha256"]))
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    upgrade(url)
    settings = Settings(
        database_url=url,
        store=str(server.store.root),
        admin_token="x" * 20,
        gc_interval_seconds=0,
        auto_migrate=False,
        keep_last=1,
    )
    context = Context.create(settings)
    try:
        first = rebuild(context)
        second = rebuild(context)
        gc.collect(context)
        third = rebuild(context)
    finally:
        context.close()
    assert first.failed == ["rb@1"] and len(first.added) == 5
    assert second.added == second.failed == []
    # Retention (keep_last=1) deleted the rebuilt ra@1 and ra@2 and their manifests.
    assert [o.key for o in server.store.list_objects("runs/ra/")] == [keys.manifest_key("ra", 3)]
    assert third.added == third.failed == []
