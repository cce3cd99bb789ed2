"""A rank of an old attempt is fenced like a zombie process: once a new attempt of the run
registered, its writes (a layer of a bundle its rank 0 opened, a heartbeat, a commit) get 409
and change nothing, on Postgres and SQLite."""

from __future__ import annotations

from ckpt.core.contract import RESTORE_ORDER, Layer
from tests.service.conftest import Server
from tests.service.helpers import commit, make_layer, open_bundle, record, register


def test_a_rank_of_an_old_attempt_is_fenced(server: Server, run_name: str) -> None:
    with server.client() as client:
        old = register(client, run_name, resume=True)
        opened = open_bundle(client, run_name, old, step=1, world_size=2)  # rank 0 opened it
        assert opened.status_code == 201, opened.text
        bundle = opened.json()["id"]
        for layer in RESTORE_ORDER:  # rank 0 recorded everything before the preemption
            rec, _ = make_layer(server.store)
            assert record(client, bundle, 0, layer, old["epoch"], rec).status_code == 200
        new = register(client, run_name, resume=True)  # the replacement job's rank 0
        assert new["epoch"] > old["epoch"]
        rec, _ = make_layer(server.store)
        late = record(client, bundle, 1, Layer.WEIGHTS, old["epoch"], rec)  # a zombie rank 1
        assert late.status_code == 409 and late.json()["error"] == "fenced", late.text
        beat = client.post(f"/v1/attempts/{old['attempt_id']}/heartbeat", json={"step": 1})
        assert beat.status_code == 409 and beat.json()["error"] == "fenced", beat.text
        assert commit(client, bundle, old["epoch"]).status_code == 409
        shown = client.get(f"/v1/bundles/{bundle}").json()
        assert shown["status"] == "pending"
        assert {(x["rank"], x["layer"]) for x in shown["missing_layers"]} == {
            (1, str(layer)) for layer in RESTORE_ORDER
        }
        assert client.get(f"/v1/runs/{run_name}/resumable").status_code == 404
