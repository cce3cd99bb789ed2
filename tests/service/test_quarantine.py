"""Quarantine: a complete bundle whose bytes failed verification is never resumable again."""

from __future__ import annotations

from typing import Any

import httpx

from ckpt.core.storage import keys
from service.gc.service import collect
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import open_bundle, register, save


def test_a_quarantined_bundle_is_skipped_and_the_run_continues_from_its_parent(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        first = register(client, run_name)
        older = save(client, server.store, run_name, first, step=10)
        newer = save(client, server.store, run_name, first, step=20)
        pending = open_bundle(client, run_name, first, step=30).json()
        refused = client.post(
            f"/v1/bundles/{pending['id']}/quarantine", json={"reason": "not complete"}
        )
        assert refused.status_code == 409
        reason = {"reason": f"blob {'ab' * 32} does not match its SHA-256"}
        for _ in range(2):  # a retry is a no-op
            answer = client.post(f"/v1/bundles/{newer['id']}/quarantine", json=reason)
            assert answer.status_code == 200, answer.text
            assert answer.json()["status"] == "quarantined"
            assert answer.json()["reason"] == reason["reason"]
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == older["id"]
        second = register(client, run_name)
        assert second["resume_from"]["bundle_id"] == older["id"]
        replacement = save(client, server.store, run_name, second, step=20)
        lineage = client.get(f"/v1/runs/{run_name}/lineage").json()
    assert replacement["parent_id"] == older["id"]
    assert lineage["head_id"] == replacement["id"]
    assert lineage["forks"] == [older["id"]]


# -- fenced and reversible (issue 11, item 2) ---------------------------------------------


def token(client: httpx.Client, **body: Any) -> str:
    created = client.post("/v1/tokens", json=body)
    assert created.status_code == 201, created.text
    secret: str = created.json()["token"]
    return secret


def a_blob_of(bundle: dict[str, Any]) -> str:
    blob: str = bundle["manifest"]["ranks"][0]["layers"]["weights"]["blobs"][-1]["sha256"]
    return blob


def test_a_run_token_quarantines_only_with_the_current_epoch_and_a_damaged_blob(
    server: Server, run_name: str
) -> None:
    with server.client() as admin:
        zombie = register(admin, run_name)
        older = save(admin, server.store, run_name, zombie, step=10)
        head = save(admin, server.store, run_name, zombie, step=20)
        live = register(admin, run_name)  # fences the zombie
        own = token(admin, role="run", run=run_name, name="trainer")
        reader = token(admin, role="read", name="dashboard")
    sha = a_blob_of(head)
    path = f"/v1/bundles/{head['id']}/quarantine"
    reason = {"reason": "restore failed", "blob": sha}
    with server.client(own) as client:
        for body in (reason, reason | {"epoch": zombie["epoch"]}):  # no epoch, a stale one
            answer = client.post(path, json=body)
            assert answer.status_code == 409, answer.text
            assert answer.json()["error"] == "fenced"
        answer = client.post(path, json={"reason": "restore failed", "epoch": live["epoch"]})
        assert answer.status_code == 422, answer.text
        assert "name the blob" in answer.json()["message"]
        intact = client.post(path, json=reason | {"epoch": live["epoch"]})
        assert intact.status_code == 409, intact.text
        assert (intact.json()["error"], intact.json()["blob"]) == ("intact", sha)
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == head["id"]

        damaged = server.store.root / keys.blob_key(sha)
        damaged.write_bytes(b"x" * damaged.stat().st_size)
        answer = client.post(path, json=reason | {"epoch": live["epoch"]})
        assert answer.status_code == 200, answer.text
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == older["id"]
        events = client.get(f"/v1/bundles/{head['id']}/events").json()["events"]
    assert [(e["action"], e["actor"]) for e in events][-1] == (
        "quarantined",
        f"token {_token_id(server, 'trainer')} (trainer)",
    )
    with server.client(reader) as client:
        answer = client.post(path, json=reason)
        assert answer.status_code == 403, answer.text


def _token_id(server: Server, name: str) -> int:
    with server.client() as admin:
        [found] = [t["id"] for t in admin.get("/v1/tokens").json() if t["name"] == name]
    return int(found)


def test_an_admin_lifts_a_quarantine_once_every_blob_reads_back_intact(
    server: Server, run_name: str
) -> None:
    with server.client() as admin:
        attempt = register(admin, run_name)
        save(admin, server.store, run_name, attempt, step=10)
        head = save(admin, server.store, run_name, attempt, step=20)
        own = token(admin, role="run", run=run_name, name="trainer")
        sha = a_blob_of(head)
        damaged = server.store.root / keys.blob_key(sha)
        original = damaged.read_bytes()
        damaged.write_bytes(b"x" * len(original))
        answer = admin.post(
            f"/v1/bundles/{head['id']}/quarantine", json={"reason": "scrub", "blob": sha}
        )
        assert answer.status_code == 200, answer.text

        path = f"/v1/bundles/{head['id']}/unquarantine"
        with server.client(own) as client:
            assert client.post(path).status_code == 403
        refused = admin.post(path)
        assert refused.status_code == 409, refused.text
        assert [(b["sha256"], b["problem"]) for b in refused.json()["missing"]["blobs"]] == [
            (sha, "wrong_hash")
        ]
        assert admin.get(f"/v1/bundles/{head['id']}").json()["status"] == "quarantined"

        server.store.put(keys.blob_key(sha), [original])
        for _ in range(2):  # a retry is a no-op
            lifted = admin.post(path, json={"reason": "blob restored from a backup"})
            assert lifted.status_code == 200, lifted.text
            assert (lifted.json()["status"], lifted.json()["reason"]) == ("complete", None)
        assert admin.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == head["id"]
        missing = admin.post(
            "/v1/blobs/missing", json={"blobs": [{"sha256": sha, "size": len(original)}]}
        )
        assert missing.json()["missing"] == []  # the damage is cleared
        events = admin.get(f"/v1/bundles/{head['id']}/events").json()["events"]
    assert [(e["action"], e["status"]) for e in events][-2:] == [
        ("quarantined", "quarantined"),
        ("unquarantined", "complete"),
    ]
    assert events[-1]["reason"] == "blob restored from a backup"
    assert events[-1]["actor"] == "admin"


def test_an_admin_quarantines_an_intact_bundle_alone_and_lifts_it(
    server: Server, run_name: str
) -> None:
    # The reproduction: an intact head was quarantined, rollback to it answered 409,
    # and nothing restored it.
    with server.client() as admin:
        attempt = register(admin, run_name)
        older = save(admin, server.store, run_name, attempt, step=10)
        head = save(admin, server.store, run_name, attempt, step=20)
        answer = admin.post(
            f"/v1/bundles/{head['id']}/quarantine", json={"reason": "suspect hardware"}
        )
        assert answer.status_code == 200, answer.text
        assert admin.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == older["id"]
        rollback = {"bundle_id": head["id"]}
        assert admin.post(f"/v1/runs/{run_name}/rollback", json=rollback).status_code == 409
        assert admin.post(f"/v1/bundles/{head['id']}/unquarantine").status_code == 200
        assert admin.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == head["id"]
        back = admin.post(f"/v1/runs/{run_name}/rollback", json=rollback)
        assert back.status_code == 200, back.text


def test_garbage_collection_keeps_a_quarantined_bundle_until_retention_lets_it_go(
    make_server: MakeServer, run_name: str
) -> None:
    server = make_server("sqlite", blob_grace_seconds=0)
    with server.client() as admin:
        attempt = register(admin, run_name)
        quarantined = [save(admin, server.store, run_name, attempt, step=s) for s in (1, 2, 3)]
        save(admin, server.store, run_name, attempt, step=4)
        for bundle in quarantined:
            answer = admin.post(f"/v1/bundles/{bundle['id']}/quarantine", json={"reason": "x"})
            assert answer.status_code == 200, answer.text
        assert collect(server.context).deleted_blobs == 0  # a quarantine may be lifted
        lifted = admin.post(f"/v1/bundles/{quarantined[0]['id']}/unquarantine")
        assert lifted.status_code == 200, lifted.text
        admin.post(f"/v1/bundles/{quarantined[0]['id']}/quarantine", json={"reason": "x"})
        assert admin.patch(f"/v1/runs/{run_name}", json={"keep_last": 1}).status_code == 200
        report = collect(server.context)
        statuses = [admin.get(f"/v1/bundles/{b['id']}").json()["status"] for b in quarantined]
    # The policy, applied to the quarantined bundles apart: the newest of them stays.
    assert sorted(report.deleted_bundles) == [quarantined[0]["id"], quarantined[1]["id"]]
    assert statuses == ["deleted", "deleted", "quarantined"]
    assert report.deleted_blobs > 0
