"""Quarantine: a complete bundle whose bytes failed verification is never resumable again."""

from __future__ import annotations

from tests.service.conftest import Server
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
