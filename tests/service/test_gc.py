"""Retention, the pending TTL and the blob sweep, on PostgreSQL and SQLite.

The last test is the acceptance test of garbage collection: with saves and collections
interleaved (and a grace period of zero, the adversarial case), no blob that a complete or
in-flight bundle references is ever deleted.
"""

from __future__ import annotations

import os
import random
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event, select, text

from ckpt.core.contract import RESTORE_ORDER, LayerRecord, Manifest
from ckpt.core.storage import DirectoryStore, keys
from service.bundles import service as bundles_service
from service.bundles.blobs import stored_sizes
from service.gc import repository as gc_repository
from service.gc import service as gc_service
from service.gc.service import GcReport, collect
from service.models import Blob, Layer, LayerBlob, Run, utcnow
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import (
    commit,
    make_layer,
    open_bundle,
    record,
    register,
    save,
    statements,
)

HOUR = timedelta(hours=1)


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


# Helpers.


def blob_present(store: DirectoryStore, sha: str, size: int | None = None) -> bool:
    found = store.size(keys.blob_key(sha))
    return found is not None and (size is None or found == size)


def manifest_blobs(manifest: dict[str, Any] | Manifest) -> dict[str, int]:
    parsed = manifest if isinstance(manifest, Manifest) else Manifest.model_validate(manifest)
    return {
        blob.sha256: blob.size
        for rank in parsed.ranks
        for layer in rank.layers.values()
        for blob in layer.blobs
    }


def get_bundle(client: httpx.Client, bundle_id: int) -> dict[str, Any]:
    response = client.get(f"/v1/bundles/{bundle_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def statuses(client: httpx.Client, run: str) -> dict[int, str]:
    response = client.get(f"/v1/runs/{run}/lineage")
    assert response.status_code == 200, response.text
    return {b["id"]: b["status"] for b in response.json()["bundles"]}


def set_keep(client: httpx.Client, run: str, **policy: int | None) -> None:
    response = client.patch(f"/v1/runs/{run}", json=policy)
    assert response.status_code == 200, response.text
    for name, value in policy.items():
        assert response.json()[name] == value


def pin(client: httpx.Client, bundle_id: int) -> None:
    response = client.patch(f"/v1/bundles/{bundle_id}", json={"pinned": True})
    assert response.status_code == 200, response.text
    assert response.json()["pinned"] is True


def store_listing(store: DirectoryStore) -> dict[str, int]:
    return {obj.key: obj.size for obj in store.list_objects("")}


def save_steps(
    server: Server, client: httpx.Client, run: str, attempt: dict[str, Any], steps: list[int]
) -> list[dict[str, Any]]:
    return [save(client, server.store, run, attempt, step=step) for step in steps]


def age(store: DirectoryStore, key: str, seconds: float) -> None:
    """Make an object look ``seconds`` old on disk."""
    when = time.time() - seconds
    os.utime(store.root / key, (when, when))


# Retention.


def test_keep_last_deletes_older_complete_bundles(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server = make_server(backend)
    with server.client() as client:
        attempt = register(client, run_name)
        bundles = save_steps(server, client, run_name, attempt, [1, 2, 3, 4, 5])
        ids = [b["id"] for b in bundles]

        before = collect(server.context)  # no policy: everything is kept
        assert before.deleted_bundles == []
        set_keep(client, run_name, keep_last=2)
        report = collect(server.context)

        assert sorted(report.deleted_bundles) == ids[:3]
        for bundle in bundles:
            out = get_bundle(client, bundle["id"])
            kept = bundle["id"] in ids[3:]
            assert out["status"] == ("complete" if kept else "deleted")
            manifest = server.store.size(keys.manifest_key(run_name, bundle["step"]))
            assert (manifest is not None) == kept
        assert statuses(client, run_name) == {
            i: ("complete" if i in ids[3:] else "deleted") for i in ids
        }
        # The deleted bundles' blobs are inside their grace period: still there.
        for bundle in bundles:
            for sha, size in manifest_blobs(bundle["manifest"]).items():
                assert blob_present(server.store, sha, size)
        assert report.deleted_blobs == 0 and report.young_blobs > 0

        # An hour later the grace is over: the deleted bundles' blobs go, the kept ones stay.
        later = collect(server.context, now=utcnow() + 2 * HOUR)
        assert later.deleted_bundles == []
        doomed = {s for b in bundles[:3] for s in manifest_blobs(b["manifest"])}
        kept_blobs = {s for b in bundles[3:] for s in manifest_blobs(b["manifest"])}
        assert later.deleted_blobs == len(doomed - kept_blobs) > 0
        for sha in doomed - kept_blobs:
            assert not blob_present(server.store, sha)
        for bundle in bundles[3:]:
            for sha, size in manifest_blobs(bundle["manifest"]).items():
                assert blob_present(server.store, sha, size)

        # A second pass deletes nothing more; the run still resumes from the newest.
        again = collect(server.context, now=utcnow() + 2 * HOUR)
        assert again.deleted_bundles == [] and again.deleted_blobs == 0
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == ids[-1]


def test_a_server_wide_policy_visits_only_runs_with_more_than_it_always_keeps(
    make_server: MakeServer, backend: str
) -> None:
    server = make_server(backend, keep_last=2)
    with server.client() as client:
        for run, steps in (("few", [1, 2]), ("many", [1, 2, 3]), ("own", [1])):
            save_steps(server, client, run, register(client, run), steps)
        set_keep(client, "own", keep_last=1)  # a policy of its own: always visited
        with server.context.transaction() as session:
            by_name = {name: run_id for name, run_id in session.execute(select(Run.name, Run.id))}
            assert gc_repository.run_ids(session, server_keeps=2) == [
                by_name["many"],
                by_name["own"],
            ]
            assert gc_repository.run_ids(session, server_keeps=None) == [by_name["own"]]
        report = collect(server.context)
        assert len(report.deleted_bundles) == 1  # "many"'s oldest; "few" was not even read
        assert statuses(client, "few") == dict.fromkeys(statuses(client, "few"), "complete")


def test_retention_weighs_runs_in_batches_and_leaves_a_run_being_committed_for_later(
    make_server: MakeServer, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of runs costs the same few queries however many runs it holds; batches add
    up to the whole; a run whose row another transaction holds (a commit) waits for the
    next pass instead of stalling this one."""
    server = make_server(backend, keep_last=1)
    with server.client() as client:

        def dry_pass() -> int:
            return statements(server, lambda: collect(server.context, dry_run=True))

        saved = {"a": save_steps(server, client, "a", register(client, "a"), [1, 2, 3])}
        one_run = dry_pass()
        for run in "bcde":
            saved[run] = save_steps(server, client, run, register(client, run), [1, 2, 3])
        assert dry_pass() == one_run  # five runs in one batch
        monkeypatch.setattr(gc_service, "_RUNS_AT_ONCE", 2)  # a, b | c, d | e
        assert dry_pass() > one_run
        oldest = {run: [b["id"] for b in bundles[:2]] for run, bundles in saved.items()}
        if backend == "postgres":  # SQLite's transactions lock the whole file instead
            with server.context.transaction() as session:
                session.execute(select(Run).where(Run.name == "c").with_for_update())
                report = collect(server.context)
            assert sorted(report.deleted_bundles) == sorted(
                i for run in "abde" for i in oldest[run]
            )
        report = collect(server.context)
        assert sorted(report.deleted_bundles) == sorted(
            oldest["c"] if backend == "postgres" else [i for ids in oldest.values() for i in ids]
        )
        for run, bundles in saved.items():
            assert statuses(client, run) == {
                bundles[0]["id"]: "deleted",
                bundles[1]["id"]: "deleted",
                bundles[2]["id"]: "complete",
            }


def test_pinned_and_keep_every_are_kept(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server = make_server(backend)
    with server.client() as client:
        attempt = register(client, run_name)
        bundles = save_steps(server, client, run_name, attempt, [10, 20, 30, 40, 50, 60, 70])
        by_step = {b["step"]: b["id"] for b in bundles}
        pin(client, by_step[10])
        set_keep(client, run_name, keep_last=1, keep_every=30)

        dry = collect(server.context, dry_run=True)
        report = collect(server.context)

        kept = {by_step[s] for s in (10, 30, 60, 70)}  # pinned, every 30th, the newest
        assert sorted(report.deleted_bundles) == sorted(set(by_step.values()) - kept)
        assert sorted(dry.deleted_bundles) == sorted(report.deleted_bundles)
        assert statuses(client, run_name) == {
            i: ("complete" if i in kept else "deleted") for i in by_step.values()
        }
        assert get_bundle(client, by_step[10])["pinned"] is True


def test_newest_complete_bundle_is_never_deleted(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    # The settings' policy applies to runs that set none.
    server = make_server(backend, keep_every=1000)
    with server.client() as client:
        attempt = register(client, run_name)
        first, second = save_steps(server, client, run_name, attempt, [1, 2])
        # A newer bundle that is still pending does not count: the newest complete stays.
        opened = open_bundle(client, run_name, attempt, step=3)
        assert opened.status_code == 201, opened.text
        report = collect(server.context)
        assert report.deleted_bundles == [first["id"]]
        assert statuses(client, run_name) == {
            first["id"]: "deleted",
            second["id"]: "complete",
            opened.json()["id"]: "pending",
        }
        run = client.get(f"/v1/runs/{run_name}").json()
        assert run["head"]["id"] == second["id"]
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == second["id"]


def test_rollback_head_is_protected(make_server: MakeServer, backend: str, run_name: str) -> None:
    server = make_server(backend)
    with server.client() as client:
        attempt = register(client, run_name)
        old = save_steps(server, client, run_name, attempt, [1, 2, 3, 4, 5])
        ids = [b["id"] for b in old]
        back = client.post(f"/v1/runs/{run_name}/rollback", json={"bundle_id": ids[0]})
        assert back.status_code == 200, back.text
        set_keep(client, run_name, keep_last=2)

        report = collect(server.context)
        # The head (step 1, the oldest) and the two newest stay.
        assert sorted(report.deleted_bundles) == [ids[1], ids[2]]
        assert get_bundle(client, ids[0])["status"] == "complete"
        assert server.store.size(keys.manifest_key(run_name, 1)) is not None
        resumable = client.get(f"/v1/runs/{run_name}/resumable").json()
        assert resumable["bundle_id"] == ids[0]
        for sha, size in manifest_blobs(resumable["manifest"]).items():
            assert blob_present(server.store, sha, size)

        # A new attempt resumes from the head and saves steps 2-4 again: a fork. Retention
        # now drops the old branch; deleting the old step-4 bundle keeps the new step-4
        # bundle's manifest, which replaced it in the store.
        again = register(client, run_name)
        assert again["resume_from"]["bundle_id"] == ids[0]
        new = save_steps(server, client, run_name, again, [2, 3, 4])
        report = collect(server.context)
        assert sorted(report.deleted_bundles) == sorted([ids[0], ids[3], ids[4], new[0]["id"]])
        assert statuses(client, run_name)[new[2]["id"]] == "complete"
        stored = Manifest.model_validate_json(server.store.get(keys.manifest_key(run_name, 4)))
        assert stored.catalog is not None and stored.catalog.bundle_id == new[2]["id"]
        assert server.store.size(keys.manifest_key(run_name, 5)) is None
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == new[2]["id"]


# The pending TTL.


def test_pending_bundle_fails_after_ttl(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server = make_server(backend, pending_ttl_seconds=600, blob_grace_seconds=60)
    with server.client() as client:
        attempt = register(client, run_name)
        opened = open_bundle(client, run_name, attempt, step=1)
        assert opened.status_code == 201, opened.text
        bundle_id = opened.json()["id"]
        rec, _ = make_layer(server.store)
        assert record(client, bundle_id, 0, "weights", attempt["epoch"], rec).status_code == 200
        shas = {b.sha256 for b in rec.blobs}

        early = collect(server.context, now=utcnow() + timedelta(seconds=300))
        assert early.failed_bundles == []
        assert get_bundle(client, bundle_id)["status"] == "pending"
        assert all(blob_present(server.store, sha) for sha in shas)  # a pending bundle's

        late = collect(server.context, now=utcnow() + timedelta(seconds=700))
        assert late.failed_bundles == [bundle_id]
        failed = get_bundle(client, bundle_id)
        assert failed["status"] == "failed" and failed["reason"]
        # Its blobs went in the same pass: the grace (60 s) is over at that time.
        assert late.deleted_blobs == len(shas)
        assert not any(blob_present(server.store, sha) for sha in shas)
        # A failed bundle cannot be committed, and its layers cannot be added to.
        done = commit(client, bundle_id, attempt["epoch"])
        assert done.status_code == 409, done.text
        rec2, _ = make_layer(server.store)
        assert record(client, bundle_id, 0, "rng", attempt["epoch"], rec2).status_code == 409


def test_expiry_reads_only_the_index_of_pending_bundles(
    make_server: MakeServer, backend: str
) -> None:
    """The TTL's query is a range of the partial index of pending bundles on both databases
    (asked for the ids in order, SQLite walks the whole table instead)."""
    server = make_server(backend)
    engine = server.context.engine
    seen: list[tuple[str, Any]] = []

    def before(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, parameters))

    with server.context.transaction() as session:
        event.listen(engine, "before_cursor_execute", before)
        try:
            gc_repository.stale_pending(session, older_than=utcnow(), lock=False)
        finally:
            event.remove(engine, "before_cursor_execute", before)
        ((statement, parameters),) = seen
        if backend == "postgres":
            session.execute(text("SET LOCAL enable_seqscan = off"))  # an empty table, else
            explain = "EXPLAIN "
        else:
            explain = "EXPLAIN QUERY PLAN "
        connection = session.connection()
        plan = str(connection.exec_driver_sql(explain + statement, parameters).all())
    assert "ix_bundle_pending_created_at" in plan, plan


# The sweep.


def test_sweep_respects_grace_and_shared_blobs(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server = make_server(backend, blob_grace_seconds=600, keep_last=1)
    with server.client() as client:
        attempt = register(client, run_name)
        first = save(client, server.store, run_name, attempt, step=1)
        # The second bundle shares one payload with the first: its blobs must survive.
        opened = open_bundle(client, run_name, attempt, step=2)
        second_id = opened.json()["id"]
        shared = Manifest.model_validate(first["manifest"]).ranks[0].layers[RESTORE_ORDER[0]]
        for layer in RESTORE_ORDER:
            rec = shared if layer is RESTORE_ORDER[0] else make_layer(server.store)[0]
            assert record(client, second_id, 0, layer, attempt["epoch"], rec).status_code == 200
        assert commit(client, second_id, attempt["epoch"]).status_code == 200
        second = get_bundle(client, second_id)

        report = collect(server.context)
        assert report.deleted_bundles == [first["id"]]
        only_first = set(manifest_blobs(first["manifest"])) - set(
            manifest_blobs(second["manifest"])
        )
        assert len(only_first) == 5  # five payloads (equal-sized payloads share a header)

        young = collect(server.context, now=utcnow() + timedelta(seconds=300))
        assert young.deleted_blobs == 0 and young.young_blobs == len(only_first)
        assert all(blob_present(server.store, sha) for sha in only_first)

        old = collect(server.context, now=utcnow() + timedelta(seconds=900))
        assert old.deleted_blobs == len(only_first)
        assert old.deleted_bytes == sum(manifest_blobs(first["manifest"])[s] for s in only_first)
        assert not any(blob_present(server.store, sha) for sha in only_first)
        for sha, size in manifest_blobs(second["manifest"]).items():
            assert blob_present(server.store, sha, size)
        # The catalog forgets the swept blobs too.
        with server.context.transaction() as session:
            rows = set(session.scalars(select(Blob.sha256)))
        assert not rows & only_first
        assert set(manifest_blobs(second["manifest"])) <= rows


def test_unrecorded_upload_is_deleted_only_after_grace(
    make_server: MakeServer, backend: str
) -> None:
    server = make_server(backend, blob_grace_seconds=600)
    rec, _ = make_layer(server.store)  # uploaded, never recorded
    fresh, old_on_disk = rec.blobs
    age(server.store, keys.blob_key(old_on_disk.sha256), 900)

    report = collect(server.context)
    assert report.deleted_blobs == 1 and report.young_blobs == 1
    assert blob_present(server.store, fresh.sha256, fresh.size)
    assert not blob_present(server.store, old_on_disk.sha256)

    # The fresh one is kept on each pass inside its grace, and goes once it is over.
    assert collect(server.context, now=utcnow() + timedelta(seconds=300)).deleted_blobs == 0
    assert blob_present(server.store, fresh.sha256, fresh.size)
    assert collect(server.context, now=utcnow() + timedelta(seconds=900)).deleted_blobs == 1
    assert not blob_present(server.store, fresh.sha256)


def empty_directories(root: Path) -> list[str]:
    return sorted(
        path.relative_to(root).as_posix()
        for path in root.rglob("*")
        if path.is_dir() and not any(path.iterdir())
    )


def test_collection_leaves_no_empty_directories(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server = make_server(backend, blob_grace_seconds=600)
    root = server.store.root
    with server.client() as client:
        attempt = register(client, run_name)
        bundles = save_steps(server, client, run_name, attempt, [1, 2, 3])
        set_keep(client, run_name, keep_last=1)
    stray, _ = make_layer(server.store)  # uploaded, never recorded

    report = collect(server.context, now=utcnow() + 2 * HOUR)

    assert sorted(report.deleted_bundles) == [b["id"] for b in bundles[:2]]
    assert report.deleted_blobs > len(stray.blobs)
    assert empty_directories(root) == []
    # What is left is exactly the newest bundle: its manifest and its blobs.
    kept = {keys.blob_key(sha) for sha in manifest_blobs(bundles[2]["manifest"])}
    assert set(store_listing(server.store)) == kept | {keys.manifest_key(run_name, 3)}


def test_blobs_reported_present_are_claimed(make_server: MakeServer, backend: str) -> None:
    server = make_server(backend, blob_grace_seconds=600)
    rec, _ = make_layer(server.store)
    claimed, unclaimed = rec.blobs
    for blob in rec.blobs:  # both old on disk: unclaimed, each would be swept
        age(server.store, keys.blob_key(blob.sha256), 3600)
    absent = make_layer(server.store, upload=False)[0].blobs[1]

    with server.client() as client:
        response = client.post(
            "/v1/blobs/missing",
            json={"blobs": [claimed.model_dump(), absent.model_dump()]},
        )
    assert response.status_code == 200, response.text
    assert response.json()["missing"] == [absent.sha256]

    report = collect(server.context)
    assert report.deleted_blobs == 1  # the unclaimed one, the control
    assert not blob_present(server.store, unclaimed.sha256)
    assert blob_present(server.store, claimed.sha256, claimed.size)
    assert collect(server.context, now=utcnow() + timedelta(seconds=300)).deleted_blobs == 0
    assert blob_present(server.store, claimed.sha256, claimed.size)
    # The claim lasts one grace period.
    assert collect(server.context, now=utcnow() + timedelta(seconds=900)).deleted_blobs == 1
    assert not blob_present(server.store, claimed.sha256)


@pytest.mark.parametrize("use", ["record", "claim"])
def test_blob_used_during_the_sweep_is_kept(
    make_server: MakeServer,
    backend: str,
    run_name: str,
    use: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A blob that is unreferenced when the collector lists the store, then recorded (or
    reported present) before it is deleted, survives: the decision is re-made under the
    blob's row lock."""
    server = make_server(backend, blob_grace_seconds=600)
    with server.client() as client:
        attempt = register(client, run_name)
        opened = open_bundle(client, run_name, attempt, step=1)
        bundle_id = opened.json()["id"]
        records = {
            layer: make_layer(server.store, size=32 + i)[0] for i, layer in enumerate(RESTORE_ORDER)
        }
        for key in list(store_listing(server.store)):
            age(server.store, key, 3600)  # every blob is old and, so far, unreferenced
        late = records[RESTORE_ORDER[0]]
        for layer, rec in records.items():
            if layer is not RESTORE_ORDER[0]:
                assert record(client, bundle_id, 0, layer, attempt["epoch"], rec).status_code == 200

        real_batch = gc_service._sweep_batch
        used: list[int] = []

        def batch_after_use(*args: Any, **kwargs: Any) -> None:
            if not used:  # between the listing and the locked re-check
                if use == "record":
                    response = record(
                        client, bundle_id, 0, RESTORE_ORDER[0], attempt["epoch"], late
                    )
                else:
                    blobs = [b.model_dump() for b in late.blobs]
                    response = client.post("/v1/blobs/missing", json={"blobs": blobs})
                    assert response.json()["missing"] == []
                assert response.status_code == 200, response.text
                used.append(1)
            real_batch(*args, **kwargs)

        monkeypatch.setattr(gc_service, "_sweep_batch", batch_after_use)
        report = collect(server.context)
        assert used
        assert report.deleted_blobs == 0, report
        for blob in late.blobs:
            assert blob_present(server.store, blob.sha256, blob.size)
        if use == "claim":  # the claim lets the upload be recorded now and committed
            response = record(client, bundle_id, 0, RESTORE_ORDER[0], attempt["epoch"], late)
            assert response.status_code == 200, response.text
        done = commit(client, bundle_id, attempt["epoch"])
        assert done.status_code == 200, done.text


def test_blob_swept_before_its_claim_is_reported_missing(
    make_server: MakeServer, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/v1/blobs/missing`` finds a blob in the store, and the collector deletes it before
    the claim lands: the answer is "missing" (the agent uploads it), not "held" (the agent
    would record a blob that is gone, and its commit would find it missing). Found by the
    two-replica campaign (tests/integration/test_replicas.py), where saves kept reporting
    blobs that vanished between ``/missing`` and the commit."""
    server = make_server(backend, blob_grace_seconds=600)
    blob = make_layer(server.store)[0].blobs[1]
    age(server.store, keys.blob_key(blob.sha256), 3600)  # old and unreferenced: collectable
    collected: list[GcReport] = []

    def collected_after_the_read(*args: Any, **kwargs: Any) -> dict[str, int | None]:
        found = stored_sizes(*args, **kwargs)
        if not collected:  # between the store read and the claim
            collected.append(collect(server.context))
        return found

    monkeypatch.setattr(bundles_service, "stored_sizes", collected_after_the_read)
    with server.client() as client:
        response = client.post("/v1/blobs/missing", json={"blobs": [blob.model_dump()]})
    assert response.status_code == 200, response.text
    assert collected[0].deleted_blobs == 1
    assert not blob_present(server.store, blob.sha256)
    assert response.json()["missing"] == [blob.sha256]


def test_dry_run_changes_nothing(make_server: MakeServer, backend: str, run_name: str) -> None:
    server = make_server(backend, pending_ttl_seconds=600, blob_grace_seconds=600, keep_last=1)
    with server.client() as client:
        attempt = register(client, run_name)
        save_steps(server, client, run_name, attempt, [1, 2, 3])
        opened = open_bundle(client, run_name, attempt, step=4)
        rec, _ = make_layer(server.store)
        assert (
            record(client, opened.json()["id"], 0, "data", attempt["epoch"], rec).status_code == 200
        )
        make_layer(server.store)  # an unrecorded upload
        for obj in server.store.list_objects("blobs/"):
            age(server.store, obj.key, 3600)
        before_status = statuses(client, run_name)
        before_store = store_listing(server.store)
        with server.context.transaction() as session:
            before_rows = sorted(
                tuple(r) for r in session.execute(select(Blob.sha256, Blob.claimed_at))
            )

        when = utcnow() + HOUR
        dry = collect(server.context, dry_run=True, now=when)
        via_api = client.post("/v1/gc", params={"dry_run": "true"})
        assert via_api.status_code == 200, via_api.text
        api_report = GcReport.model_validate(via_api.json())

        assert dry.dry_run and api_report.dry_run
        assert dry.failed_bundles == [opened.json()["id"]]
        assert len(dry.deleted_bundles) == 2
        # Unreferenced now: the unrecorded upload's payload blob (its header is shared).
        assert dry.deleted_blobs == 1
        assert dry.young_blobs == 0  # every blob is an hour old, the grace ten minutes
        assert sorted(api_report.deleted_bundles) == sorted(dry.deleted_bundles)
        assert statuses(client, run_name) == before_status
        assert store_listing(server.store) == before_store
        with server.context.transaction() as session:
            after_rows = sorted(
                tuple(r) for r in session.execute(select(Blob.sha256, Blob.claimed_at))
            )
        assert after_rows == before_rows

        real = collect(server.context, now=when)
        assert real.failed_bundles == dry.failed_bundles
        assert sorted(real.deleted_bundles) == sorted(dry.deleted_bundles)
        # The real pass also sweeps what the bundles it deleted and failed held.
        assert real.deleted_blobs > dry.deleted_blobs and real.young_blobs == 0
        assert store_listing(server.store) != before_store


def test_gc_endpoint_is_admin_only(make_server: MakeServer, backend: str) -> None:
    server = make_server(backend)
    with server.client(token=None) as anonymous:
        assert anonymous.post("/v1/gc").status_code == 401
    with server.client() as admin:
        response = admin.post("/v1/gc")
    assert response.status_code == 200, response.text
    assert GcReport.model_validate(response.json()).dry_run is False


# The acceptance test: saves and collections interleaved.

DURATION = 5.0  # seconds of interleaving per backend, at least
# The interleaving goes on until it is worth something (enough saves, deletions and checks,
# however slowly a busy machine makes them come); this only stops a hung one.
HANG_GUARD = 600.0
CHECKPOINTS = 6  # rounds of checks of both runs' live bundles, at least
SHARED = [os.urandom(n) for n in (64, 64, 96, 128, 128, 160)]  # payloads bundles reuse
LIVE = ("pending", "complete")


class Saver:
    """Saves bundles in a loop the way the agent does, beside a collector with no grace.

    Some payloads repeat across bundles (deduplicated through ``/v1/blobs/missing``); every
    fourth bundle is left in flight: pending, one layer short, its recorded blobs stored.
    """

    def __init__(self, server: Server, run: str, stop: threading.Event, *, seed: int) -> None:
        self.server = server
        self.run = run
        self.stop = stop
        self.rng = random.Random(seed)
        self.completed: list[int] = []
        self.sealed: set[int] = set()  # pending bundles whose recorded blobs are all stored
        self.reuploads = 0  # blobs the collector deleted under a save, re-sent on a 409
        self.errors: list[str] = []

    def loop(self) -> None:
        try:
            with self.server.client() as client:
                attempt = register(client, self.run)
                step = 0
                while not self.stop.is_set():
                    step += 1
                    self.save(client, attempt, step, in_flight=step % 4 == 0)
        except BaseException as err:  # reported by the test's thread
            self.errors.append(f"{type(err).__name__}: {err}")

    def save(
        self, client: httpx.Client, attempt: dict[str, Any], step: int, *, in_flight: bool
    ) -> None:
        epoch = attempt["epoch"]
        opened = open_bundle(client, self.run, attempt, step=step)
        assert opened.status_code == 201, opened.text
        bundle_id = opened.json()["id"]
        pieces: dict[str, bytes] = {}
        for layer in RESTORE_ORDER[:-1] if in_flight else RESTORE_ORDER:
            data = self.rng.choice(SHARED) if self.rng.random() < 0.6 else os.urandom(80)
            rec, parts = make_layer(self.server.store, upload=False, data=data)
            pieces.update(zip((b.sha256 for b in rec.blobs), parts, strict=True))
            self.upload_missing(client, rec, parts)
            response = record(client, bundle_id, 0, layer, epoch, rec)
            assert response.status_code == 200, response.text
        for _ in range(50):
            done = commit(client, bundle_id, epoch)
            if done.status_code == 200:
                assert not in_flight, done.text
                assert done.json()["bundle"]["status"] == "complete"
                self.completed.append(bundle_id)
                return
            assert done.status_code == 409, done.text
            body = done.json()
            assert body["error"] == "incomplete", body
            absent = [b["sha256"] for b in body["missing"]["blobs"] if b["problem"] == "absent"]
            assert len(absent) == len(body["missing"]["blobs"]), body
            if not absent:
                assert in_flight, body
                assert [p["layer"] for p in body["missing"]["layers"]] == [RESTORE_ORDER[-1]]
                self.sealed.add(bundle_id)  # left pending; every blob it recorded is stored
                return
            for sha in absent:  # the protocol: upload what is absent, commit again
                self.server.store.put(keys.blob_key(sha), [pieces[sha]])
                self.reuploads += 1
        raise AssertionError(f"bundle {bundle_id} did not get past 50 commit rounds")

    def upload_missing(self, client: httpx.Client, rec: LayerRecord, parts: list[bytes]) -> None:
        """Dedup: ask which blobs the store lacks and upload only those."""
        response = client.post(
            "/v1/blobs/missing", json={"blobs": [b.model_dump() for b in rec.blobs]}
        )
        assert response.status_code == 200, response.text
        missing = set(response.json()["missing"])
        for blob, data in zip(rec.blobs, parts, strict=True):
            if blob.sha256 in missing:
                self.server.store.put(keys.blob_key(blob.sha256), [data])


class Collector:
    def __init__(self, server: Server, stop: threading.Event) -> None:
        self.server = server
        self.stop = stop
        self.reports: list[GcReport] = []
        self.errors: list[str] = []

    def loop(self) -> None:
        try:
            while not self.stop.is_set():
                self.reports.append(collect(self.server.context))
        except BaseException as err:
            self.errors.append(f"{type(err).__name__}: {err}")


def recorded_blobs(server: Server, bundle_id: int) -> dict[str, int]:
    """The blobs a bundle's recorded layers reference, from the catalog's tables."""
    with server.context.transaction() as session:
        records = session.scalars(select(Layer.record).where(Layer.bundle_id == bundle_id))
        refs = list(
            session.scalars(
                select(LayerBlob.blob_sha256)
                .join(Layer, Layer.id == LayerBlob.layer_id)
                .where(Layer.bundle_id == bundle_id)
            )
        )
        blobs = {
            blob.sha256: blob.size
            for rec in records
            for blob in LayerRecord.model_validate(rec).blobs
        }
    assert set(refs) == set(blobs)
    return blobs


def violations(server: Server, client: httpx.Client, run: str, sealed: set[int]) -> list[str]:
    """Blobs missing from the store that a live bundle references, safe to call while saves
    and collections go on: a bundle counts when it was live both before and after the store
    was looked at (a status never returns to live, so it was live throughout)."""
    before = statuses(client, run)
    expected: dict[int, dict[str, int]] = {}
    for bundle_id, status in before.items():
        if status == "complete":
            manifest = get_bundle(client, bundle_id)["manifest"]
            assert manifest is not None, bundle_id
            expected[bundle_id] = manifest_blobs(manifest)
        elif status == "pending" and bundle_id in sealed:
            expected[bundle_id] = recorded_blobs(server, bundle_id)
    resumable = client.get(f"/v1/runs/{run}/resumable")
    resume_id: int | None = None
    if resumable.status_code == 200:
        resume_id = resumable.json()["bundle_id"]
        expected[-1] = manifest_blobs(resumable.json()["manifest"])
    else:
        assert resumable.status_code == 404, resumable.text
    absent = {
        bundle_id: sorted(
            f"{sha[:12]} ({size} B: {server.store.size(keys.blob_key(sha))})"
            for sha, size in blobs.items()
            if not blob_present(server.store, sha, size)
        )
        for bundle_id, blobs in expected.items()
    }
    after = statuses(client, run)
    found = []
    for bundle_id, bad in absent.items():
        if bundle_id == -1:
            assert resume_id is not None
            if bad and after.get(resume_id) == "complete":
                found.append(f"resumable bundle {resume_id} lacks blobs {bad}")
        elif bad and after.get(bundle_id) in LIVE:
            found.append(f"{before[bundle_id]} bundle {bundle_id} lacks blobs {bad}")
    return found


@pytest.mark.timeout(HANG_GUARD + 180)
def test_interleaved_saves_and_gc_never_delete_live_blobs(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server = make_server(backend, blob_grace_seconds=0, keep_last=2)
    stop = threading.Event()
    # Two runs save at once: their payloads overlap, so a blob one run's retention frees
    # may be the one the other run is about to reuse.
    savers = [Saver(server, f"{run_name}-{i}", stop, seed=i) for i in range(2)]
    collector = Collector(server, stop)
    threads = [threading.Thread(target=s.loop, name=f"saver-{s.run}") for s in savers]
    threads.append(threading.Thread(target=collector.loop, name="collector"))
    for thread in threads:
        thread.start()

    def errors() -> list[str]:
        return [e for s in savers for e in s.errors] + collector.errors

    def enough() -> bool:  # what makes the run worth something (asserted below)
        return (
            all(len(s.completed) >= 4 and s.sealed for s in savers)
            and sum(len(r.deleted_bundles) for r in collector.reports) > 0
            and sum(r.deleted_blobs for r in collector.reports) > 0
        )

    problems: list[str] = []
    checkpoints = 0
    try:
        with server.client() as client:
            start = time.monotonic()
            while not errors():
                elapsed = time.monotonic() - start
                if elapsed > DURATION and enough() and checkpoints >= CHECKPOINTS:
                    break
                assert elapsed < HANG_GUARD, [(len(s.completed), len(s.sealed)) for s in savers]
                time.sleep(0.3)
                for saver in savers:
                    if client.get(f"/v1/runs/{saver.run}").status_code == 200:
                        problems += violations(server, client, saver.run, set(saver.sealed))
                        checkpoints += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not errors(), errors()
    assert not problems, problems

    # At rest, after one more collection: every live bundle's blobs, and its manifest.
    collector.reports.append(collect(server.context))
    with server.client() as client:
        for saver in savers:
            assert violations(server, client, saver.run, saver.sealed) == []
            final = statuses(client, saver.run)
            for bundle_id, status in final.items():
                if status == "complete":
                    step = get_bundle(client, bundle_id)["step"]
                    assert server.store.size(keys.manifest_key(saver.run, step)) is not None
            resumable = client.get(f"/v1/runs/{saver.run}/resumable").json()
            assert resumable["bundle_id"] == saver.completed[-1]
            assert sum(1 for s in final.values() if s == "complete") == 2  # keep_last
            assert saver.sealed and all(final[i] == "pending" for i in saver.sealed)

    # The test is only worth something if the collector did delete under the saves.
    assert checkpoints >= CHECKPOINTS
    assert enough(), [(len(s.completed), len(s.sealed)) for s in savers]
