from __future__ import annotations

from tests.service.conftest import Server
from tests.service.helpers import register, save


def test_save_and_resume(server: Server, run_name: str) -> None:
    with server.client() as client:
        first = register(client, run_name)
        assert first["resume_from"] is None
        bundle = save(client, server.store, run_name, first, step=10)
        assert bundle["status"] == "complete"
        second = register(client, run_name)
        assert second["epoch"] == first["epoch"] + 1
        assert second["resume_from"]["bundle_id"] == bundle["id"]
        resumable = client.get(f"/v1/runs/{run_name}/resumable").json()
        assert resumable["step"] == 10
