"""A write to a bundle (a record, a commit) locks its run before the bundle, as every other
write does, in the one statement that reads the bundle, its run and its attempt. The test
holds the bundle's row, sends a record of a rank's layers, and once the record waits for
that row, finds the run already share-locked by it: with the locks taken the other way
round, the run is still free then, and a write that locks the run and then the bundle (a
commit, a rollback) could deadlock with it."""

from __future__ import annotations

import httpx

from tests.service.conftest import MakeServer
from tests.service.helpers import make_layer, open_bundle, register
from tests.service.test_attempt_lock_order import HANG_GUARD, run_locked_while_waiting


def test_a_record_locks_the_run_before_the_bundle(make_server: MakeServer, run_name: str) -> None:
    server = make_server("postgres")
    with server.client() as client:
        attempt = register(client, run_name)
        bundle_id = open_bundle(client, run_name, attempt, step=1).json()["id"]
    layer = make_layer(server.store)[0].model_dump(mode="json")

    def record() -> httpx.Response:
        with server.client() as trainer:
            return trainer.post(
                f"/v1/bundles/{bundle_id}/layers/0",
                json={"epoch": attempt["epoch"], "layers": {"weights": layer}},
                timeout=HANG_GUARD,
            )

    answer = run_locked_while_waiting(
        server.context.engine,
        hold="SELECT id FROM bundle WHERE id = :id FOR UPDATE",
        row=bundle_id,
        run_name=run_name,
        send=record,
    )
    assert answer.status_code == 200, answer.text
