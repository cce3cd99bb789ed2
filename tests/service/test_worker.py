"""``ckpt worker``: the periodic tasks in a process of their own, beside servers started with
``CKPT_MAINTENANCE=worker`` that run none; and ``ckpt server`` as several processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from ckpt.core.storage import DirectoryStore
from service.models import MaintenancePass
from service.settings import Settings
from tests.server_process import ckpt_server
from tests.service.conftest import ADMIN_TOKEN, MakeServer, create_pg_database
from tests.service.helpers import open_bundle, register, save

DEADLINE = 60.0  # bounds the waits; a healthy worker takes well under a second


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_the_worker_collects_garbage_and_the_servers_do_not(
    make_server: MakeServer, backend: str, tmp_path: Path
) -> None:
    server = make_server(backend, maintenance="worker", gc_interval_seconds=0.2)
    settings = server.context.settings
    with server.client() as client:
        attempt = register(client, "worked")
        opened = open_bundle(client, "worked", attempt, step=1)
        assert opened.status_code == 201, opened.text
        bundle = opened.json()["id"]
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "ckpt", "worker"],
        env={
            **os.environ,
            "CKPT_DATABASE_URL": settings.database_url,
            "CKPT_STORE": settings.store,
            "CKPT_ADMIN_TOKEN": ADMIN_TOKEN,
            "CKPT_GC_INTERVAL_SECONDS": "0.2",
            "CKPT_PENDING_TTL_SECONDS": "0.5",
            "CKPT_SCRUB_INTERVAL_SECONDS": "0",
        },
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + DEADLINE
        with server.client() as client:
            while client.get(f"/v1/bundles/{bundle}").json()["status"] == "pending":
                assert worker.poll() is None, (tmp_path / "worker.log").read_text()
                assert time.monotonic() < deadline, "the worker never expired the bundle"
                time.sleep(0.1)
            assert client.get(f"/v1/bundles/{bundle}").json()["status"] == "failed"
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(DEADLINE) == 0, (tmp_path / "worker.log").read_text()
        log.close()
    with server.context.transaction() as session:
        holders = set(session.scalars(select(MaintenancePass.holder)))
    # Every pass ran in the worker; the server (in this test's process) ran none, though
    # its interval (0.2 s) passed many times meanwhile.
    assert holders == {next(iter(holders))} and holders.pop().endswith(f":{worker.pid}")
    assert "ckpt worker" in (tmp_path / "worker.log").read_text()


def test_maintenance_is_inline_or_worker() -> None:
    assert Settings.from_env({}).maintenance == "inline"
    assert Settings.from_env({"CKPT_MAINTENANCE": "worker"}).maintenance == "worker"
    with pytest.raises(ValueError, match="CKPT_MAINTENANCE must be inline"):
        Settings.from_env({"CKPT_MAINTENANCE": "elsewhere"})


def test_several_server_processes_serve_one_postgresql_catalog(
    pg_databases: list[str], tmp_path: Path
) -> None:
    url = create_pg_database()
    pg_databases.append(url)
    with (
        ckpt_server(tmp_path, database_url=url, env={"CKPT_WORKERS": "2"}) as server,
        server.client() as client,
    ):
        store = DirectoryStore(server.store)
        for index in range(6):  # spread over both processes by the kernel
            attempt = register(client, f"multi-{index}")
            save(client, store, f"multi-{index}", attempt, step=1)
        runs = client.get("/v1/runs", params={"limit": 50}).json()["runs"]
        assert [r["name"] for r in runs] == [f"multi-{i}" for i in range(6)]
    assert "workers: 2 processes" in server.log.read_text()


def test_several_server_processes_need_postgresql() -> None:
    assert (
        Settings.from_env({"CKPT_WORKERS": "3", "CKPT_DATABASE_URL": "postgresql://h/d"}).workers
        == 3
    )
    with pytest.raises(ValueError, match="CKPT_WORKERS must be 1 on SQLite"):
        Settings.from_env({"CKPT_WORKERS": "2"})
    with pytest.raises(ValueError, match="CKPT_WORKERS must be"):
        Settings.from_env({"CKPT_WORKERS": "0", "CKPT_DATABASE_URL": "postgresql://h/d"})
