"""A write to a bundle (a record, a commit) locks its run before the bundle, as every other
write does, in the one statement that reads the bundle, its run and its attempt. The test
holds the bundle's row, sends a record of a rank's layers, and once the record waits for
that row, finds the run already share-locked by it: with the locks taken the other way
round, the run is still free then, and a write that locks the run and then the bundle (a
commit, a rollback) could deadlock with it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from tests.service.conftest import MakeServer
from tests.service.helpers import make_layer, open_bundle, register
from tests.service.test_attempt_lock_order import HANG_GUARD, waiting_on_locks


def test_a_record_locks_the_run_before_the_bundle(make_server: MakeServer, run_name: str) -> None:
    server = make_server("postgres")
    engine = server.context.engine
    with server.client() as client:
        attempt = register(client, run_name)
        bundle_id = open_bundle(client, run_name, attempt, step=1).json()["id"]
    layer = make_layer(server.store)[0].model_dump(mode="json")
    answers: list[httpx.Response] = []

    def record() -> None:
        with server.client() as trainer:
            answers.append(
                trainer.post(
                    f"/v1/bundles/{bundle_id}/layers/0",
                    json={"epoch": attempt["epoch"], "layers": {"weights": layer}},
                    timeout=HANG_GUARD,
                )
            )

    with engine.connect() as holder, engine.connect() as watcher, engine.connect() as probe:
        holder.execute(text("SELECT id FROM bundle WHERE id = :id FOR UPDATE"), {"id": bundle_id})
        recording = threading.Thread(target=record)
        recording.start()
        deadline = time.monotonic() + HANG_GUARD
        while waiting_on_locks(watcher) < 1:  # the record waits for the bundle's row
            assert time.monotonic() < deadline, "the record never waited for the bundle"
            time.sleep(0.02)
            watcher.rollback()
        with pytest.raises(OperationalError, match="could not obtain lock"):
            probe.execute(
                text("SELECT id FROM run WHERE name = :name FOR UPDATE NOWAIT"), {"name": run_name}
            )
        probe.rollback()
        holder.rollback()  # the record goes on
        recording.join(HANG_GUARD)
    assert [answer.status_code for answer in answers] == [200], answers[0].text
