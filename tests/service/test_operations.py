"""Running the control plane: probes, metrics, the periodic collector, the CLI, and
rebuilding the catalog from the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import delete, update

from service.models import Attempt as AttemptRow
from service.models import Blob, Bundle, Layer, LayerBlob, Rollback, Run, Token
from tests.service.conftest import MakeServer, Server, create_pg_database, serve
from tests.service.helpers import open_bundle, register, save


def ckpt(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckpt", *args],
        env={**os.environ, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def server_env(server: Server) -> dict[str, str]:
    settings = server.context.settings
    return {
        "CKPT_DATABASE_URL": settings.database_url,
        "CKPT_STORE": settings.store,
        "CKPT_SERVER": server.url,
        "CKPT_TOKEN": server.admin_token,
    }


def test_probes_and_metrics(server: Server, run_name: str) -> None:
    with httpx.Client(timeout=60, base_url=server.url) as anonymous:
        assert anonymous.get("/healthz").json() == {"status": "ok"}
        ready = anonymous.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["checks"] == {"database": "ok", "schema": "ok", "store": "ok"}
    with server.client() as client:
        attempt = register(client, run_name)
        save(client, server.store, run_name, attempt, step=5)
        metrics = client.get("/metrics").text
    assert "ckpt_bundles_committed_total 1.0" in metrics
    assert "ckpt_attempts_registered_total 1.0" in metrics
    assert 'route="/v1/bundles/{bundle}/commit"' in metrics


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_readyz_reports_a_schema_behind_the_migrations(
    backend: str, make_server: MakeServer, tmp_path: Path
) -> None:
    from service.app import create_app
    from service.settings import Settings

    url = create_pg_database() if backend == "postgres" else f"sqlite:///{tmp_path / 'c.db'}"
    settings = Settings(
        database_url=url, store=str(tmp_path / "store"), admin_token="x" * 20, auto_migrate=False
    )
    app = create_app(settings)
    address, stop = serve(app)
    try:
        answer = httpx.get(f"{address}/readyz", timeout=60)
    finally:
        stop()
        app.state.context.close()
        if backend == "postgres":
            from tests.service.conftest import drop_pg_database

            drop_pg_database(url)
    assert answer.status_code == 503
    assert "run 'ckpt migrate'" in answer.json()["checks"]["schema"]


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_the_server_collects_garbage_periodically(
    backend: str, make_server: MakeServer, run_name: str
) -> None:
    server = make_server(backend, gc_interval_seconds=0.2, pending_ttl_seconds=0)
    with server.client() as client:
        attempt = register(client, run_name)
        bundle_id = open_bundle(client, run_name, attempt, step=1).json()["id"]
        deadline = time.monotonic() + 300  # a hang guard: passes come every 0.2 s, if slowly
        while client.get(f"/v1/bundles/{bundle_id}").json()["status"] == "pending":
            assert time.monotonic() < deadline, "the periodic collector never ran"
            time.sleep(0.1)
        assert client.get(f"/v1/bundles/{bundle_id}").json()["status"] == "failed"


def test_cli_reads_runs_resumable_and_bundles(
    server: Server, run_name: str, tmp_path: Path
) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        bundle = save(client, server.store, run_name, attempt, step=42)
    env = server_env(server)
    runs = ckpt("runs", "--prefix", run_name, env=env, cwd=tmp_path)
    assert runs.returncode == 0, runs.stderr
    assert run_name in runs.stdout and f"{bundle['id']}@42" in runs.stdout
    found = ckpt("resumable", run_name, env=env, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert f"bundle {bundle['id']} at step 42" in found.stdout
    shown = ckpt("bundle", str(bundle["id"]), "--json", env=env, cwd=tmp_path)
    assert json.loads(shown.stdout)["manifest"]["step"] == 42
    missing = ckpt("resumable", "no-such-run", env=env, cwd=tmp_path)
    assert missing.returncode == 1
    assert "no run named 'no-such-run'" in missing.stderr
    refused = ckpt("runs", env={**env, "CKPT_TOKEN": "wrong"}, cwd=tmp_path)
    assert refused.returncode == 1 and "401" in refused.stderr


def test_cli_creates_tokens_that_work(server: Server, run_name: str, tmp_path: Path) -> None:
    env = server_env(server)
    created = ckpt("token", "create", "--role", "run", "--run", run_name, env=env, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("ckpt_")
    with server.client(token) as client:
        assert client.post(f"/v1/runs/{run_name}/attempts", json={}).status_code == 201
        assert client.post("/v1/runs/other/attempts", json={}).status_code == 403
    bad = ckpt("token", "create", "--role", "read", "--run", run_name, env=env, cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.startswith("ckpt token create: --run is only for a 'run' token")
    missing = ckpt("token", "create", "--role", "run", env=env, cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.startswith("ckpt token create: --run is required for a 'run' token")
    invalid = ckpt("token", "create", "--role", "run", "--run", "no/slash", env=env, cwd=tmp_path)
    assert invalid.returncode == 2
    assert invalid.stderr.startswith("ckpt token create: --run: invalid run name 'no/slash'")


def test_cli_lists_and_revokes_tokens(server: Server, run_name: str, tmp_path: Path) -> None:
    env = server_env(server)
    with server.client() as admin:
        register(admin, run_name)
    secrets = [
        ckpt("token", "create", *args, env=env, cwd=tmp_path).stdout.strip()
        for args in (["--role", "run", "--run", run_name, "--name", "trainer"], ["--role", "read"])
    ]
    assert all(secret.startswith("ckpt_") for secret in secrets)

    table = ckpt("token", "list", env=env, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert [line.split()[1:4] for line in table.stdout.splitlines()] == [
        ["NAME", "ROLE", "RUN"],
        ["trainer", "run", run_name],
        ["cli", "read", "-"],
    ]
    listed = json.loads(ckpt("token", "list", "--json", env=env, cwd=tmp_path).stdout)
    assert [(t["name"], t["role"], t["run"], t["revoked_at"]) for t in listed] == [
        ("trainer", "run", run_name, None),
        ("cli", "read", None, None),
    ]
    assert {key for t in listed for key in t} == {
        "id",
        "name",
        "role",
        "run",
        "created_at",
        "revoked_at",
        "expires_at",  # null: never (test_token_expiry.py)
    }
    for secret in secrets:  # the catalog holds only hashes: nothing to leak, and none leaks
        assert secret not in table.stdout + json.dumps(listed)

    trainer = listed[0]["id"]
    with server.client(secrets[0]) as client:
        assert client.get(f"/v1/runs/{run_name}").status_code == 200
    revoked = ckpt("token", "revoke", str(trainer), env=env, cwd=tmp_path)
    assert revoked.returncode == 0, revoked.stderr
    assert revoked.stdout.startswith(
        f"revoked run token {trainer} (trainer) for run {run_name} at "
    )
    # The CLI writes the catalog: the server refuses the token once it no longer keeps it
    # (CKPT_TOKEN_CACHE_SECONDS: test_token_cache.py).
    deadline = time.monotonic() + server.context.settings.token_cache_seconds + 10
    with server.client(secrets[0]) as client:
        while (answer := client.get(f"/v1/runs/{run_name}")).status_code == 200:
            assert time.monotonic() < deadline, "the revoked token is still served"
            time.sleep(0.05)
        assert answer.status_code == 401, answer.text
    with server.client(secrets[1]) as client:
        assert client.get(f"/v1/runs/{run_name}").status_code == 200
    after = json.loads(ckpt("token", "list", "--json", env=env, cwd=tmp_path).stdout)
    assert [t["revoked_at"] is not None for t in after] == [True, False]
    again = ckpt("token", "revoke", str(trainer), env=env, cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == revoked.stdout  # unchanged

    unknown = ckpt("token", "revoke", "987654", env=env, cwd=tmp_path)
    assert unknown.returncode == 1
    assert (
        unknown.stderr.strip()
        == "ckpt token revoke: no token has id 987654 (see 'ckpt token list')"
    )


def test_cli_migrate_and_gc(tmp_path: Path) -> None:
    env = {"CKPT_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}", "CKPT_STORE": str(tmp_path)}
    migrated = ckpt("migrate", env=env, cwd=tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    assert "is at head" in migrated.stdout
    collected = ckpt("gc", "--dry-run", env=env, cwd=tmp_path)
    assert collected.returncode == 0, collected.stderr
    assert json.loads(collected.stdout)["dry_run"] is True


def _wipe_catalog(server: Server) -> None:
    with server.context.transaction() as session:
        session.execute(delete(Rollback))
        for table in (LayerBlob, Layer, Blob, Token):
            session.execute(delete(table))
        session.execute(update(Run).values(head_bundle_id=None))
        session.execute(update(AttemptRow).values(resumed_from_id=None))
        session.execute(delete(Bundle))
        session.execute(delete(AttemptRow))
        session.execute(delete(Run))


def test_catalog_rebuild_recreates_runs_bundles_and_lineage(
    server: Server, run_name: str, tmp_path: Path
) -> None:
    with server.client() as client:
        first = register(client, run_name)
        save(client, server.store, run_name, first, step=10)
        save(client, server.store, run_name, first, step=20)
        second = register(client, run_name)
        save(client, server.store, run_name, second, step=30)
        before = client.get(f"/v1/runs/{run_name}/resumable").json()
    _wipe_catalog(server)
    env = server_env(server)
    rebuilt = ckpt("catalog", "rebuild", env=env, cwd=tmp_path)
    assert rebuilt.returncode == 0, rebuilt.stderr
    report = json.loads(rebuilt.stdout)
    assert sorted(report["added"]) == [f"{run_name}@10", f"{run_name}@20", f"{run_name}@30"]
    with server.client() as client:
        after = client.get(f"/v1/runs/{run_name}/resumable").json()
        lineage = client.get(f"/v1/runs/{run_name}/lineage").json()
        # The rebuilt catalog serves the next attempt like the old one did.
        third = register(client, run_name)
    assert after["step"] == 30
    assert after["manifest"]["ranks"] == before["manifest"]["ranks"]
    steps = {b["id"]: b["step"] for b in lineage["bundles"]}
    assert sorted((steps[e["parent"]], steps[e["child"]]) for e in lineage["parent_edges"]) == [
        (10, 20),
        (20, 30),
    ]
    assert third["resume_from"]["step"] == 30
    again = ckpt("catalog", "rebuild", env=env, cwd=tmp_path)
    assert json.loads(again.stdout)["added"] == []


def test_catalog_rebuild_marks_bundles_with_missing_blobs_failed(
    server: Server, run_name: str, tmp_path: Path
) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        save(client, server.store, run_name, attempt, step=1)
        bundle = save(client, server.store, run_name, attempt, step=2)
    lost = bundle["manifest"]["ranks"][0]["layers"]["rng"]["blobs"][1]["sha256"]
    server.store.delete(f"blobs/sha256/{lost[:2]}/{lost}")
    _wipe_catalog(server)
    report = json.loads(ckpt("catalog", "rebuild", env=server_env(server), cwd=tmp_path).stdout)
    assert report["added"] == [f"{run_name}@1"]
    assert report["failed"] == [f"{run_name}@2"]
    with server.client() as client:
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["step"] == 1
