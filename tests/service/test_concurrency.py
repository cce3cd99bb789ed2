"""Races against a real ``ckpt server`` process, on PostgreSQL and SQLite.

Eight ranks of one attempt open, record and commit the same bundle at the same moment
(some of them twice): one complete bundle comes out, with each of its 48 layers recorded
once. Two attempts that register at the same moment get distinct epochs, and only the newer
one can save.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from ckpt.core.contract import RESTORE_ORDER
from ckpt.core.storage import DirectoryStore
from service.models import Layer, LayerBlob
from tests.service.conftest import create_pg_database
from tests.service.helpers import commit, make_layer, open_bundle, record, register, save

pytestmark = pytest.mark.slow

TOKEN = "x" * 20
WORLD = 8
RETRYING = {1, 4, 6}  # ranks that send every record and commit twice


@dataclass
class LiveServer:
    url: str
    database_url: str
    store: DirectoryStore
    log: Path
    process: subprocess.Popen[bytes]

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
        )

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def scalar(self, statement: Any) -> Any:
        engine = create_engine(self.database_url)
        try:
            with engine.connect() as connection:
                return connection.execute(statement).scalar()
        finally:
            engine.dispose()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def live(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    pg_databases: list[str],
) -> Iterator[LiveServer]:
    """``ckpt server`` in its own process, on a fresh catalog and store."""
    root = tmp_path_factory.mktemp("live")
    if request.param == "postgres":
        database_url = create_pg_database()
        pg_databases.append(database_url)
    else:
        database_url = f"sqlite:///{root / 'catalog.db'}"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(
        CKPT_DATABASE_URL=database_url,
        CKPT_STORE=str(root / "store"),
        CKPT_ADMIN_TOKEN=TOKEN,
        CKPT_AUTO_MIGRATE="1",
        CKPT_GC_INTERVAL_SECONDS="0",
    )
    ckpt = Path(sys.executable).with_name("ckpt")
    assert ckpt.exists(), ckpt
    log = root / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(ckpt), "server", "--port", str(port)],
            env=env,
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = LiveServer(
        url=f"http://127.0.0.1:{port}",
        database_url=database_url,
        store=DirectoryStore(root / "store"),
        log=log,
        process=process,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"ckpt server exited:\n{server.log_tail()}"
            try:
                if httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"not ready in 60 s:\n{server.log_tail()}"
            time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(15)
    assert "Traceback" not in log.read_text(errors="replace"), server.log_tail()


@pytest.fixture
def run_name() -> str:
    return f"race-{uuid.uuid4().hex[:8]}"


@dataclass
class Rank:
    """What one rank was answered, in order."""

    rank: int
    bundle_id: int | None = None
    answers: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    error: str | None = None

    def note(self, what: str, response: httpx.Response) -> httpx.Response:
        try:
            body = response.json()
        except ValueError:
            body = {"text": response.text}
        self.answers.append((what, response.status_code, body))
        return response


def in_threads(work: Callable[[int], None], count: int) -> None:
    threads = [threading.Thread(target=work, args=(i,), name=f"rank-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), f"{thread.name} hung"


def save_as_ranks(
    live: LiveServer, run: str, attempt: dict[str, Any], step: int
) -> tuple[int, list[Rank]]:
    """Eight ranks open, record and commit one bundle at once; returns its id and answers."""
    barrier = threading.Barrier(WORLD, timeout=60)
    ranks = [Rank(rank) for rank in range(WORLD)]
    epoch = attempt["epoch"]

    def work(rank: int) -> None:
        me = ranks[rank]
        try:
            with live.client() as client:
                layers = {
                    layer: make_layer(live.store, size=48 + rank)[0] for layer in RESTORE_ORDER
                }
                barrier.wait()  # open at once
                opened = me.note(
                    "open", open_bundle(client, run, attempt, step=step, world_size=WORLD)
                )
                assert opened.status_code == 201, opened.text
                me.bundle_id = opened.json()["id"]
                barrier.wait()  # record and commit at once
                times = 2 if rank in RETRYING else 1
                for layer, rec in layers.items():
                    for _ in range(times):
                        me.note("record", record(client, me.bundle_id, rank, layer, epoch, rec))
                committed = False
                for _ in range(times):
                    answer = me.note("commit", commit(client, me.bundle_id, epoch))
                    committed = committed or answer.status_code == 200
                barrier.wait()  # every rank has recorded everything
                for _ in range(times if not committed else times - 1):
                    me.note("commit-again", commit(client, me.bundle_id, epoch))
        except BaseException as err:
            me.error = f"{type(err).__name__}: {err}"
            barrier.abort()

    in_threads(work, WORLD)
    errors = [r.error for r in ranks if r.error]
    assert not errors, errors
    ids = {r.bundle_id for r in ranks}
    assert len(ids) == 1, f"the ranks opened different bundles: {ids}"
    bundle_id = ids.pop()
    assert bundle_id is not None
    return bundle_id, ranks


def register_and_open_at_once(
    live: LiveServer, run: str, step: int
) -> tuple[list[dict[str, Any]], list[tuple[int, dict[str, Any]]]]:
    """Two attempts register at once, then both open a bundle at ``step`` and commit it."""
    barrier = threading.Barrier(2, timeout=60)
    attempts: list[dict[str, Any]] = [{}, {}]
    outcomes: list[tuple[int, dict[str, Any]]] = [(0, {}), (0, {})]
    errors: list[str] = []

    def work(i: int) -> None:
        try:
            with live.client() as client:
                barrier.wait()
                attempts[i] = register(client, run)
                barrier.wait()  # both registered: now both try to save
                opened = open_bundle(client, run, attempts[i], step=step)
                if opened.status_code != 201:
                    outcomes[i] = (opened.status_code, opened.json())
                    return
                saved = commit(client, opened.json()["id"], attempts[i]["epoch"])
                outcomes[i] = (saved.status_code, saved.json())
        except BaseException as err:
            errors.append(f"{type(err).__name__}: {err}")
            barrier.abort()

    in_threads(work, 2)
    assert not errors, errors
    return attempts, outcomes


def commit_while_registering(
    live: LiveServer, run: str, bundle_id: int, attempt: dict[str, Any]
) -> tuple[httpx.Response, dict[str, Any]]:
    """``attempt`` commits ``bundle_id`` while a new attempt registers."""
    barrier = threading.Barrier(2, timeout=60)
    answers: dict[str, Any] = {}
    errors: list[str] = []

    def work(i: int) -> None:
        try:
            with live.client() as client:
                barrier.wait()
                if i == 0:
                    answers["commit"] = commit(client, bundle_id, attempt["epoch"])
                else:
                    answers["register"] = register(client, run)
        except BaseException as err:
            errors.append(f"{type(err).__name__}: {err}")
            barrier.abort()

    in_threads(work, 2)
    assert not errors, errors
    return answers["commit"], answers["register"]


def test_ranks_commit_one_bundle_at_once(live: LiveServer, run_name: str) -> None:
    incomplete = 0
    with live.client() as client:
        attempt = register(client, run_name)
        for step in range(1, 6):
            bundle_id, ranks = save_as_ranks(live, run_name, attempt, step)
            for rank in ranks:
                assert all(status < 500 for _, status, _ in rank.answers), rank.answers
                for what, status, body in rank.answers:
                    if what == "record":
                        assert status == 200, body
                        assert body["rank"] == rank.rank
                    elif what == "commit" and status != 200:
                        # Committed before every rank recorded: told what is missing.
                        assert status == 409 and body["error"] in ("incomplete", "conflict"), body
                        incomplete += 1
                last = rank.answers[-1]
                assert last[0].startswith("commit") and last[1] == 200, rank.answers
                assert last[2]["bundle"]["id"] == bundle_id
                assert last[2]["bundle"]["status"] == "complete"
                assert last[2]["head_id"] == bundle_id
                ok = [a for a in rank.answers if a[0].startswith("commit") and a[1] == 200]
                assert all(a[2]["bundle"]["id"] == bundle_id for a in ok)

            bundle = client.get(f"/v1/bundles/{bundle_id}").json()
            assert bundle["status"] == "complete"
            assert bundle["missing_layers"] == []
            recorded = [(r["rank"], r["layer"]) for r in bundle["recorded"]]
            assert len(recorded) == len(set(recorded)) == WORLD * len(RESTORE_ORDER)
            manifest = bundle["manifest"]
            assert [r["rank"] for r in manifest["ranks"]] == list(range(WORLD))
            assert all(len(r["layers"]) == len(RESTORE_ORDER) for r in manifest["ranks"])
            layers = live.scalar(
                select(func.count()).select_from(Layer).where(Layer.bundle_id == bundle_id)
            )
            assert layers == WORLD * len(RESTORE_ORDER)
            blob_refs = live.scalar(
                select(func.count())
                .select_from(LayerBlob)
                .join(Layer, Layer.id == LayerBlob.layer_id)
                .where(Layer.bundle_id == bundle_id)
            )
            assert blob_refs == 2 * WORLD * len(RESTORE_ORDER)  # a header and a data blob each

            lineage = client.get(f"/v1/runs/{run_name}/lineage").json()
            assert lineage["head_id"] == bundle_id
            assert [(b["step"], b["status"]) for b in lineage["bundles"]] == [
                (s, "complete") for s in range(1, step + 1)
            ]
            run = client.get(f"/v1/runs/{run_name}").json()
            assert run["head"]["id"] == bundle_id
            resumable = client.get(f"/v1/runs/{run_name}/resumable").json()
            assert resumable["bundle_id"] == bundle_id
    # The race this test is about did happen: some ranks committed too early.
    assert incomplete > 0


def test_attempts_registering_at_once(live: LiveServer, run_name: str) -> None:
    epoch = 0
    head: int | None = None
    for round_ in range(4):
        step = 10 * (round_ + 1)
        attempts, outcomes = register_and_open_at_once(live, run_name, step)
        epochs = sorted(a["epoch"] for a in attempts)
        assert epochs == [epoch + 1, epoch + 2]
        epoch = epochs[1]
        for registered in attempts:
            resumed = registered["resume_from"]
            assert (resumed["bundle_id"] if resumed else None) == head
        newer = 0 if attempts[0]["epoch"] > attempts[1]["epoch"] else 1
        older = 1 - newer
        # The older attempt is fenced; the newer one opens its bundle (its commit reports
        # the missing layers: nothing is recorded yet).
        assert outcomes[older][0] == 409 and outcomes[older][1]["error"] == "fenced", outcomes
        assert outcomes[newer][0] == 409 and outcomes[newer][1]["error"] == "incomplete"
        with live.client() as client:
            bundle = save(client, live.store, run_name, attempts[newer], step=step)
            assert bundle["status"] == "complete"
            again = open_bundle(client, run_name, attempts[older], step=step + 1)
            assert again.status_code == 409 and again.json()["error"] == "fenced"
            lineage = client.get(f"/v1/runs/{run_name}/lineage").json()
        head = bundle["id"]
        assert lineage["head_id"] == head and lineage["epoch"] == epoch
        fenced = {a["id"]: a["fenced"] for a in lineage["attempts"]}
        assert fenced[attempts[older]["attempt_id"]] is True
        assert fenced[attempts[newer]["attempt_id"]] is False
        assert [b["status"] for b in lineage["bundles"]] == ["complete"] * (round_ + 1)


def test_commit_racing_a_new_registration(live: LiveServer, run_name: str) -> None:
    """An attempt commits a whole bundle while a new one registers: either the commit wins,
    or the registration wins, rolls the whole bundle forward and the commit is fenced; the
    new attempt resumes from that bundle either way."""
    with live.client() as client:
        first = register(client, run_name)
        save(client, live.store, run_name, first, step=1)
    current = first
    for step in range(2, 8):
        with live.client() as client:
            opened = open_bundle(client, run_name, current, step=step)
            assert opened.status_code == 201, opened.text
            bundle_id = opened.json()["id"]
            for layer in RESTORE_ORDER:
                rec, _ = make_layer(live.store)
                answer = record(client, bundle_id, 0, layer, current["epoch"], rec)
                assert answer.status_code == 200, answer.text
        committed, registered = commit_while_registering(live, run_name, bundle_id, current)
        assert registered["epoch"] == current["epoch"] + 1
        if committed.status_code != 200:
            assert committed.status_code == 409 and committed.json()["error"] == "fenced"
        assert registered["resume_from"]["bundle_id"] == bundle_id
        with live.client() as client:
            lineage = client.get(f"/v1/runs/{run_name}/lineage").json()
            status = {b["id"]: b["status"] for b in lineage["bundles"]}[bundle_id]
            assert status == "complete"
            assert lineage["head_id"] == bundle_id
        current = registered
