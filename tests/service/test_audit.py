"""The audit log (issue 11, item 2): every change of a bundle's state is written with who
made it, what it was, the status after it and why; ``/v1/bundles/{id}/events`` and
``/v1/runs/{run}/events`` read it back, a page at a time."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx

from service.gc.service import collect
from service.models import utcnow
from tests.service.conftest import Server
from tests.service.helpers import make_layer, open_bundle, record, register, save


def events_of(client: httpx.Client, path: str) -> list[dict[str, Any]]:
    answer = client.get(path)
    assert answer.status_code == 200, answer.text
    found: list[dict[str, Any]] = answer.json()["events"]
    return found


def story(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(e["action"], e["actor"], e["status"]) for e in events]


def test_every_change_of_a_bundle_is_in_its_audit_log(server: Server, run_name: str) -> None:
    with server.client() as admin:
        created = admin.post("/v1/tokens", json={"role": "run", "run": run_name, "name": "job"})
        trainer = f"token {created.json()['id']} (job)"
        with server.client(created.json()["token"]) as job:
            attempt = register(job, run_name)
            bundle = save(job, server.store, run_name, attempt, step=10)
            save(job, server.store, run_name, attempt, step=20)
        path = f"/v1/bundles/{bundle['id']}"
        for pinned in (True, True, False):  # pinning twice changes nothing the second time
            assert admin.patch(path, json={"pinned": pinned}).status_code == 200
        assert admin.post(f"{path}/quarantine", json={"reason": "suspect"}).status_code == 200
        assert admin.post(f"{path}/unquarantine").status_code == 200
        assert admin.patch(f"/v1/runs/{run_name}", json={"keep_last": 1}).status_code == 200
        assert collect(server.context).deleted_bundles == [bundle["id"]]
        events = events_of(admin, f"{path}/events")
    assert story(events) == [
        ("opened", trainer, "pending"),
        ("committed", trainer, "complete"),
        ("pinned", "admin", "complete"),
        ("unpinned", "admin", "complete"),
        ("quarantined", "admin", "quarantined"),
        ("unquarantined", "admin", "complete"),
        ("deleted", "gc", "deleted"),
    ]
    assert events[4]["reason"] == "suspect"
    assert events[-1]["reason"] == "retention (keep_last=1, keep_every=None)"
    assert all(e["bundle_id"] == bundle["id"] and e["run"] == run_name for e in events)
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)


def test_a_bundle_pending_past_the_ttl_fails_in_the_log(server: Server, run_name: str) -> None:
    with server.client() as admin:
        attempt = register(admin, run_name)
        opened = open_bundle(admin, run_name, attempt, step=5)
        rec, _ = make_layer(server.store)
        assert record(admin, opened.json()["id"], 0, "weights", attempt["epoch"], rec).is_success
        report = collect(server.context, now=utcnow() + timedelta(days=2))
        assert report.failed_bundles == [opened.json()["id"]]
        events = events_of(admin, f"/v1/bundles/{opened.json()['id']}/events")
    assert story(events) == [("opened", "admin", "pending"), ("failed", "gc", "failed")]
    assert events[-1]["reason"] == "still pending after the TTL"


def test_the_runs_log_comes_a_page_at_a_time(server: Server, run_name: str) -> None:
    other = f"{run_name}-other"
    with server.client() as admin:
        attempt = register(admin, run_name)
        for step in (1, 2, 3):
            save(admin, server.store, run_name, attempt, step=step)
        save(admin, server.store, other, register(admin, other), step=1)  # not in this run's log
        pages, after = [], None
        while True:
            query = {"limit": 4} | ({"after": after} if after is not None else {})
            page = admin.get(f"/v1/runs/{run_name}/events", params=query).json()
            pages.append(page["events"])
            if page["next"] is None:
                break
            after = page["next"]
        assert admin.get(f"/v1/runs/{run_name}/events", params={"limit": 0}).status_code == 422
        assert admin.get("/v1/runs/no-such-run/events").status_code == 404
    assert [len(p) for p in pages] == [4, 2]
    assert [e["action"] for p in pages for e in p] == ["opened", "committed"] * 3
    assert {e["run"] for p in pages for e in p} == {run_name}


def test_reading_the_log_needs_read_access(server: Server, run_name: str) -> None:
    with server.client() as admin:
        attempt = register(admin, run_name)
        bundle = save(admin, server.store, run_name, attempt, step=1)
        reader = admin.post("/v1/tokens", json={"role": "read"}).json()["token"]
        stranger = admin.post(
            "/v1/tokens", json={"role": "run", "run": f"{run_name}-x", "name": "x"}
        ).json()["token"]
    for secret, status in ((reader, 200), (stranger, 403)):
        with server.client(secret) as client:
            assert client.get(f"/v1/bundles/{bundle['id']}/events").status_code == status
            assert client.get(f"/v1/runs/{run_name}/events").status_code == status
