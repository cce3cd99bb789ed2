"""No token and no session cookie in a log line, an error or an exception's text: a trainer
given a bad token (one httpx refuses to send, one the control plane does not know) fails
saying so, and neither its output nor the control plane's log holds the secret; only a
prefix such as ``ckpt_2uQW…``."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt.core.redact import redact, shown
from tests.server_process import ServerProcess, ckpt_server
from tests.ui.signin import signed_in_client

WINDOW = 8  # no run of this many characters of a secret, past what ``shown`` keeps


def leaks(secret: str, text: str) -> list[str]:
    """The pieces of ``secret`` (beyond its shown prefix) that ``text`` holds."""
    value = secret.strip()
    hidden = value[len(shown(value)) - 1 :]
    pieces = {hidden[i : i + WINDOW] for i in range(len(hidden) - WINDOW + 1)}
    return sorted(piece for piece in pieces if piece in text)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ckpt_server(tmp_path_factory.mktemp("server")) as running:
        yield running


def train(server: ServerProcess, tmp_path: Path, *, token: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | server.env()
    env |= {"CKPT_TOKEN": token, "CKPT_SERVER_RETRY_SECONDS": "2"}
    command = [
        sys.executable,
        "-m",
        "agent.demo.train",
        "--steps",
        "4",
        "--every",
        "2",
        "--run",
        "secret-run",
    ]
    command += ["--store", server.store, "--out", str(tmp_path / "out.pt")]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.fixture(scope="module")
def tokens() -> dict[str, str]:
    return {
        # Ours, with the newline a file or a Kubernetes secret often ends with.
        "a token of ours with a trailing newline": f"ckpt_{secrets.token_urlsafe(32)}\n",
        # An admin token is any string; a line break inside makes the header illegal.
        "an admin token with a line break": f"s3cret-{secrets.token_hex(12)}\nmore-{secrets.token_hex(8)}",
        "a token the control plane does not know": f"ckpt_{secrets.token_urlsafe(32)}",
    }


@pytest.mark.parametrize(
    "case",
    [
        "a token of ours with a trailing newline",
        "an admin token with a line break",
        "a token the control plane does not know",
    ],
)
def test_a_trainer_with_a_bad_token_prints_no_secret(
    server: ServerProcess, tmp_path: Path, tokens: dict[str, str], case: str
) -> None:
    secret = tokens[case]
    done = train(server, tmp_path, token=secret)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert leaks(secret, output) == [], output
    assert leaks(secret, server.log.read_text()) == []
    assert "Error: " in output, output  # it raised, saying what failed


def test_the_command_prints_no_secret_of_a_token_it_cannot_send(
    server: ServerProcess, tmp_path: Path, tokens: dict[str, str]
) -> None:
    secret = tokens["an admin token with a line break"]
    done = subprocess.run(
        [sys.executable, "-m", "ckpt", "runs", "--server", server.url, "--token", secret],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode != 0
    assert leaks(secret, done.stdout + done.stderr) == [], done.stderr


def test_a_dashboard_session_leaves_no_cookie_in_the_servers_log(server: ServerProcess) -> None:
    with signed_in_client(server.url, server.token) as browser:
        cookie = browser.cookies["ckpt_session"]
        assert browser.get("/ui/").status_code == 200
        assert browser.get("/ui/runs/no-such-run").status_code == 404
    assert leaks(cookie, server.log.read_text()) == []
    assert leaks(server.token, server.log.read_text()) == []


def test_redact_keeps_a_prefix_of_every_secret_it_finds() -> None:
    token = "ckpt_2uQWx8vKq3LrT0yZbN5mFhJc1pAeSgDi7oUw4tXlE9"
    assert redact(f"Illegal header value b'Bearer {token}\\n'") == (
        "Illegal header value b'Bearer ckpt_2uQW…\\n'"
    )
    assert redact("Authorization: Bearer hunter2-hunter2") == "Authorization: Bearer hunt…"
    assert redact("Cookie: ckpt_session=AbCdEfGh12345678; x=1") == "Cookie: ckpt_session=AbCd…; x=1"
    assert redact("admin is s3cret-value!", secrets=["s3cret-value\n"]) == "admin is s3cr…!"
    # Metric and cookie names are not tokens.
    assert (
        redact("ckpt_http_requests_total ckpt_session") == "ckpt_http_requests_total ckpt_session"
    )
