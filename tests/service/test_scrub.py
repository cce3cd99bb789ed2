"""The scrubber (issue 11, item 1 and its acceptance): stored blobs are re-read at a bounded
rate, each run's resumable bundle first; a blob found missing or damaged quarantines every
complete bundle using it before an agent relies on it, and the next save writes it again.
A store that fails to answer quarantines nothing. One pass runs at a time across replicas."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt import Checkpointer
from ckpt.core.contract import Layer, Manifest
from ckpt.core.storage import DirectoryStore, keys
from service.app import create_app
from service.context import Context
from service.db import upgrade
from service.gc.service import collect
from service.maintenance import repository as passes
from service.maintenance.service import Task, exclusive
from service.models import MaintenancePass
from service.scrub.service import scrub
from service.settings import Settings
from tests.service.conftest import ADMIN_TOKEN, MakeServer, Server, create_pg_database, serve
from tests.service.helpers import register, save

MIB = 1 << 20


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(512, 512, bias=False)  # 1 MiB: a blob of its own
        self.head = nn.Linear(4, 2)


def checkpointer(server: Server, run: str, model: nn.Module) -> Checkpointer:
    return Checkpointer(
        run=run,
        models=model,
        store=server.store,
        server=server.url,
        token=server.admin_token,
        handle_signals=False,
        quiet=True,
    )


def train_to(ckpt: Checkpointer, model: Net, step: int) -> None:
    """The run's changes up to ``step``, each saved: the frozen layer changes once, after
    step 1, so that the bundles at steps 2 and 3 share its blob."""
    while ckpt.counters.step < step:
        ckpt.counters.step += 1
        with torch.no_grad():
            model.head.weight.add_(1.0)
            if ckpt.counters.step == 2:
                model.frozen.weight.mul_(2.0)
        ckpt.save().wait()


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in model.state_dict().items()}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def manifest(server: Server, run: str, step: int) -> Manifest:
    return Manifest.model_validate_json(server.store.get(keys.manifest_key(run, step)))


def blobs(found: Manifest, layer: Layer) -> list[str]:
    return [blob.sha256 for blob in found.ranks[0].layers[layer].blobs]


def intact(server: Server, sha: str) -> bool:
    path = server.store.root / keys.blob_key(sha)
    return path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == sha


@dataclass(frozen=True)
class Damaged:
    """A run of three bundles whose head lost a blob of its own (``counters``) and had a
    byte flipped in a blob it shares with the bundle before (``frozen``)."""

    ids: dict[int, int]  # step -> bundle id
    states: dict[int, dict[str, torch.Tensor]]  # step -> the model as saved
    counters: str
    frozen: str


def damage_a_run(server: Server, run: str) -> Damaged:
    torch.manual_seed(0)
    model = Net()
    ckpt = checkpointer(server, run, model)
    ckpt.resume()
    states = {}
    for step in (1, 2, 3):
        train_to(ckpt, model, step)
        states[step] = state(model)
    ckpt.close()
    first, second, head = (manifest(server, run, step) for step in (1, 2, 3))
    [frozen] = [s for s in blobs(head, Layer.WEIGHTS) if server.store.size(keys.blob_key(s)) == MIB]
    assert frozen in blobs(second, Layer.WEIGHTS) and frozen not in blobs(first, Layer.WEIGHTS)
    counters = blobs(head, Layer.COUNTERS)[-1]
    assert counters not in blobs(second, Layer.COUNTERS) + blobs(first, Layer.COUNTERS)
    (server.store.root / keys.blob_key(counters)).unlink()
    flipped = server.store.root / keys.blob_key(frozen)
    data = bytearray(flipped.read_bytes())
    data[12345] ^= 0x10
    flipped.write_bytes(bytes(data))
    ids = {m.step: m.catalog.bundle_id for m in (first, second, head) if m.catalog}
    return Damaged(ids=ids, states=states, counters=counters, frozen=frozen)


def test_one_pass_sets_aside_every_bundle_with_a_bad_blob_and_the_next_save_heals_it(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server = make_server(backend, scrub_bytes_per_second=0)
    damaged = damage_a_run(server, run_name)
    ids, counters, frozen = damaged.ids, damaged.counters, damaged.frozen
    with server.client() as client:
        report = client.post("/v1/scrub")
        assert report.status_code == 200, report.text
        assert {(d["sha256"], d["problem"]) for d in report.json()["damaged"]} == {
            (counters, "absent"),
            (frozen, "wrong_hash"),
        }
        assert sorted(report.json()["quarantined"]) == [ids[2], ids[3]]
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == ids[1]
        for step in (2, 3):
            bundle = client.get(f"/v1/bundles/{ids[step]}").json()
            assert bundle["status"] == "quarantined"
            assert f"blob {frozen} does not match its SHA-256" in bundle["reason"]
            assert "found by the scrubber" in bundle["reason"]
            last = client.get(f"/v1/bundles/{ids[step]}/events").json()["events"][-1]
            assert (last["action"], last["actor"]) == ("quarantined", "scrubber")
        sizes = [{"sha256": counters, "size": 1}, {"sha256": frozen, "size": MIB}]
        wanted = client.post("/v1/blobs/missing", json={"blobs": sizes}).json()["missing"]
        assert sorted(wanted) == sorted([counters, frozen])
        metrics = client.get("/metrics").text
    assert "ckpt_scrub_damaged_total 2.0" in metrics
    assert "ckpt_scrub_passes_total 1.0" in metrics

    # The next attempt resumes from the bundle that is whole and saves the same steps again:
    # the blobs are written again and the commits succeed.
    torch.manual_seed(1)
    model = Net()
    again = checkpointer(server, run_name, model)
    assert again.resume().step == 1
    assert equal(state(model), damaged.states[1])
    train_to(again, model, 3)
    again.close()
    assert intact(server, frozen) and intact(server, counters)
    with server.client() as client:
        resumable = client.get(f"/v1/runs/{run_name}/resumable").json()
        assert resumable["step"] == 3 and resumable["bundle_id"] not in ids.values()
        assert client.post("/v1/scrub").json()["damaged"] == []

    torch.manual_seed(2)
    model = Net()
    last = checkpointer(server, run_name, model)
    assert last.resume().step == 3
    last.close()
    assert equal(state(model), damaged.states[3])  # bit-exact


def save_two(server: Server, run: str) -> list[int]:
    with server.client() as client:
        attempt = register(client, run)
        return [save(client, server.store, run, attempt, step=step)["id"] for step in (1, 2)]


@pytest.mark.parametrize("outage", ["broken", "unmounted"])
def test_a_store_that_fails_during_a_pass_quarantines_nothing(
    server: Server, run_name: str, outage: str
) -> None:
    ids = save_two(server, run_name)
    root = server.store.root
    aside = root.with_name(root.name + ".aside")
    if outage == "broken":  # stat and open fail with an error, not "no such file"
        (root / "blobs").rename(aside)
        (root / "blobs").write_text("not a directory")
    else:  # an empty mount point: every object seems absent
        root.rename(aside)
        root.mkdir()
    with server.client() as client:
        failed = client.post("/v1/scrub")
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"] == "store_unavailable"
        if outage == "unmounted":
            assert "looks unmounted" in failed.json()["message"]
        statuses = [client.get(f"/v1/bundles/{i}").json()["status"] for i in ids]
        events = client.get(f"/v1/runs/{run_name}/events").json()["events"]
        assert statuses == ["complete", "complete"]
        assert "quarantined" not in {event["action"] for event in events}
        if outage == "broken":
            (root / "blobs").unlink()
            aside.rename(root / "blobs")
        else:
            root.rmdir()
            aside.rename(root)
        passed = client.post("/v1/scrub")
        assert passed.status_code == 200, passed.text
        assert (passed.json()["bundles"], passed.json()["damaged"]) == (2, [])
    with server.context.transaction() as session:
        outcomes = [row.outcome or "" for row in passes.passes(session, task="scrub")]
    assert outcomes[0].startswith("failed: StoreUnavailableError")
    assert json.loads(outcomes[1])["bundles"] == 2


def test_one_pass_of_each_task_at_a_time_across_replicas(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server = make_server(backend, scrub_bytes_per_second=0)
    save_two(server, run_name)
    replica = Context.create(server.context.settings)  # a second server on the same catalog
    try:
        with exclusive(server.context, Task.SCRUB) as held:
            assert held is not None
            assert scrub(replica).skipped
            assert not collect(replica).skipped  # the other task is free
            with exclusive(replica, Task.GC) as gc_held:
                assert gc_held is not None
                assert collect(server.context).skipped
        assert scrub(replica).bundles == 2
        assert not collect(server.context).skipped
    finally:
        replica.close()
    with server.context.transaction() as session:
        rows = {task: passes.passes(session, task=task) for task in ("scrub", "gc")}
    for task, recorded in rows.items():
        assert [row.outcome is not None for row in recorded] == [True] * len(recorded), task
        for before, after in itertools.pairwise(recorded):
            assert before.ended_at is not None and before.ended_at <= after.started_at, task
    assert len(rows["scrub"]) == 2 and len(rows["gc"]) == 3
    assert all(row.holder == f"{socket.gethostname()}:{os.getpid()}" for row in rows["scrub"])


def test_the_scrubber_reads_no_faster_than_its_rate(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server = make_server(backend)
    save_two(server, run_name)
    total = sum(obj.size for obj in server.store.list_objects("blobs/"))
    paced = Context.create(replace(server.context.settings, scrub_bytes_per_second=total / 1.0))
    try:
        started = time.monotonic()
        report = scrub(paced)
        elapsed = time.monotonic() - started
    finally:
        paced.close()
    assert report.bytes == total
    assert elapsed >= 1.0


def test_stopping_the_server_ends_a_pass_in_flight(
    backend: str, tmp_path: Path, pg_databases: list[str]
) -> None:
    if backend == "postgres":
        url = create_pg_database()
        pg_databases.append(url)
    else:
        url = f"sqlite:///{tmp_path / 'catalog.db'}"
    upgrade(url)
    settings = Settings(
        database_url=url,
        store=str(tmp_path / "store"),
        admin_token=ADMIN_TOKEN,
        auto_migrate=False,
        gc_interval_seconds=0,
        scrub_interval_seconds=0.1,
        scrub_bytes_per_second=1.0,  # the first blob would take minutes
    )
    context = Context.create(settings)
    assert isinstance(context.store, DirectoryStore)
    base, stop = serve(create_app(settings, context=context))
    try:
        save_two(Server(url=base, context=context, store=context.store), "slow")
        deadline = time.monotonic() + 30
        while not (in_flight := [row for row in _passes(context) if row.ended_at is None]):
            assert time.monotonic() < deadline, "no periodic pass of the scrubber started"
            time.sleep(0.05)
        started = time.monotonic()
        stop()
        assert time.monotonic() - started < 10
        [row] = [row for row in _passes(context) if row.id == in_flight[0].id]
        assert row.ended_at is not None
        assert json.loads(row.outcome or "{}")["stopped"] is True
    finally:
        stop()
        context.close()


def _passes(context: Context) -> list[MaintenancePass]:
    with context.transaction() as session:
        return passes.passes(session, task="scrub")


def test_ckpt_scrub_runs_one_pass(server: Server, run_name: str, tmp_path: Path) -> None:
    [_, head] = save_two(server, run_name)
    settings = server.context.settings
    env = {
        **os.environ,
        "CKPT_DATABASE_URL": settings.database_url,
        "CKPT_STORE": settings.store,
        "CKPT_SCRUB_BYTES_PER_SECOND": "0",
    }
    with server.client() as client:
        lost = client.get(f"/v1/bundles/{head}").json()["manifest"]["ranks"][0]["layers"]["rng"]
    server.store.delete(keys.blob_key(lost["blobs"][1]["sha256"]))
    done = subprocess.run(
        [sys.executable, "-m", "ckpt", "scrub"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["quarantined"] == [head]
    shutil.rmtree(server.store.root / "blobs")
    (server.store.root / "blobs").write_text("broken")
    failed = subprocess.run(
        [sys.executable, "-m", "ckpt", "scrub"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert failed.returncode == 1
    assert "cannot" in failed.stderr
