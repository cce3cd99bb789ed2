"""The ``ckpt`` command, run as a user runs it (a process of its own), when something it
needs is missing or wrong: no credentials for the S3 store, a catalog database or a
control plane that does not answer, a refused token, a reader that closes the pipe. Each
ends with a line or two naming what to fix; the traceback only with --debug or
CKPT_DEBUG=1."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_process import ServerProcess, ckpt_server, free_port

HINT = "(the traceback: CKPT_DEBUG=1 or ckpt --debug)"


def ckpt(
    *args: str, cwd: Path, env: dict[str, str], stdout: int | None = subprocess.PIPE
) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"} | env
    return subprocess.run(
        [sys.executable, "-m", "ckpt", *args],
        cwd=cwd,
        env=environment,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def no_aws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """No credentials anywhere boto3 looks, and an endpoint on this machine."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    return {
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "CKPT_S3_ENDPOINT": f"http://127.0.0.1:{free_port()}",
    }


def short(done: subprocess.CompletedProcess[str], *, says: str) -> str:
    """The one line that says what failed, followed by the line on how to see more."""
    lines = done.stderr.splitlines()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert len(lines) <= 2 and lines[-1] == HINT, done.stderr
    assert says in lines[0], done.stderr
    return lines[0]


def test_no_credentials_for_the_store_is_one_line(tmp_path: Path, no_aws: dict[str, str]) -> None:
    env = no_aws | {
        "CKPT_STORE": "s3://ckpt-test/prefix",
        "CKPT_DATABASE_URL": f"sqlite:///{tmp_path / 'catalog.db'}",
    }
    line = short(ckpt("gc", cwd=tmp_path, env=env), says="credentials")
    assert line.startswith("ckpt gc: ")

    debug = ckpt("gc", cwd=tmp_path, env=env | {"CKPT_DEBUG": "1"})
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.splitlines()[-1] == line
    assert "Traceback" in ckpt("--debug", "gc", cwd=tmp_path, env=env).stderr


def test_a_catalog_database_that_does_not_answer_is_one_line(tmp_path: Path) -> None:
    env = {"CKPT_DATABASE_URL": f"postgresql+psycopg://ckpt@127.0.0.1:{free_port()}/ckpt"}
    line = short(ckpt("token", "list", cwd=tmp_path, env=env), says="catalog database")
    assert "CKPT_DATABASE_URL" in line


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    with ckpt_server(tmp_path) as running:
        yield running


def test_a_refused_token_and_a_dead_server_are_one_line(
    tmp_path: Path, server: ServerProcess
) -> None:
    refused = ckpt("runs", "--server", server.url, "--token", "not-a-token", cwd=tmp_path, env={})
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip() == "ckpt: 401: unknown or revoked token"
    dead = f"http://127.0.0.1:{free_port()}"
    gone = ckpt("runs", "--server", dead, "--token", server.token, cwd=tmp_path, env={})
    assert gone.returncode == 1 and len(gone.stderr.splitlines()) == 1, gone.stderr
    assert f"cannot reach the control plane at {dead}" in gone.stderr


def test_a_reader_that_closes_the_pipe_ends_the_listing_quietly(tmp_path: Path) -> None:
    env = {"CKPT_DATABASE_URL": f"sqlite:///{tmp_path / 'catalog.db'}"}
    assert ckpt("migrate", cwd=tmp_path, env=env).returncode == 0
    for name in ("one", "two"):
        made = ckpt("token", "create", "--name", name, "--role", "read", cwd=tmp_path, env=env)
        assert made.returncode == 0, made.stderr
    # A pipe whose reader is gone before the command writes (``| head -1`` that finished).
    read, write = os.pipe()
    os.close(read)
    try:
        done = ckpt("token", "list", "--json", cwd=tmp_path, env=env, stdout=write)
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == 141  # as a process that SIGPIPE ended
