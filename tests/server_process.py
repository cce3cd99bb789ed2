"""Run ``ckpt server`` as a real process for end-to-end tests."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

TOKEN = "e2e-admin-token-0123456789"
# A server starting on a busy machine (imports, migrations) is waited for while it lives: it
# either answers ready or exits. This only stops one that hangs; a slow answer is an answer.
STARTUP_HANG_GUARD = 300.0
ANSWER_HANG_GUARD = 60.0
# A training process a test runs to its end: minutes on a busy machine, so this only stops a
# hung one (pytest's own timeout, 900 s, is the last resort).
TRAINER_HANG_GUARD = 600.0


@dataclass(frozen=True)
class ServerProcess:
    url: str
    token: str
    store: str
    log: Path
    pid: int = 0  # of ``ckpt server`` (with workers: their supervisor)

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=60
        )

    def env(self) -> dict[str, str]:
        """What a trainer needs to use this control plane."""
        return {"CKPT_SERVER": self.url, "CKPT_TOKEN": self.token, "CKPT_STORE": self.store}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def ckpt_server(
    root: Path,
    *,
    database_url: str | None = None,
    store: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[ServerProcess]:
    """``ckpt server`` on a free port, with its store under ``root`` unless ``store`` names
    one; stopped on exit."""
    store = store or str(root / "store")
    log = root / "server.log"
    token = f"{TOKEN}-{secrets.token_hex(4)}"  # tells this server from any other
    environment = {
        **os.environ,
        **(env or {}),
        "CKPT_DATABASE_URL": database_url or f"sqlite:///{root / 'catalog.db'}",
        "CKPT_STORE": store,
        "CKPT_ADMIN_TOKEN": token,
        "CKPT_AUTO_MIGRATE": "1",
        "CKPT_GC_INTERVAL_SECONDS": "0",
    }
    for tries_left in reversed(range(3)):
        port = free_port()
        command = [sys.executable, "-m", "ckpt", "server", "--port", str(port)]
        url = f"http://127.0.0.1:{port}"
        try:
            with serving(command, env=environment, cwd=root, log=log, url=url) as process:
                yield ServerProcess(url=url, token=token, store=store, log=log, pid=process.pid)
                return
        except PortTakenError:
            if not tries_left:
                raise


@contextmanager
def serving(
    command: list[str], *, env: dict[str, str], cwd: Path, log: Path, url: str
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` as a process logging to ``log``, once ``url``'s ``/readyz`` answers 200;
    terminated (killed if need be) on exit."""
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, process, log, what=" ".join(command), token=env.get("CKPT_ADMIN_TOKEN"))
        try:
            yield process
        except BaseException:
            # pytest shows a failed test's stderr: what the server said is the first clue.
            print(f"--- {log} (the server's log) ---\n{log.read_text()[-20000:]}", file=sys.stderr)
            raise
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class PortTakenError(RuntimeError):
    """Another process took the free port first (two test workers picked the same one)."""


def _wait_ready(
    url: str, process: subprocess.Popen[bytes], log: Path, *, what: str, token: str | None
) -> None:
    """Until the server answers ready, and, when it has an admin ``token``, accepts it: a
    server on a port another one took first must not pass for ours."""
    deadline = time.monotonic() + STARTUP_HANG_GUARD
    while time.monotonic() < deadline:
        if process.poll() is not None:
            text = log.read_text()
            if "address already in use" in text.lower():
                raise PortTakenError(f"{what}: {url} was taken")
            raise RuntimeError(f"{what} exited {process.returncode}:\n{text}")
        try:
            ready = httpx.get(f"{url}/readyz", timeout=ANSWER_HANG_GUARD)
            if ready.status_code == 200 and (token is None or _accepts(url, token)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(
        f"{what} did not become ready in {STARTUP_HANG_GUARD:.0f} s:\n{log.read_text()}"
    )


def _accepts(url: str, token: str) -> bool:
    headers = {"Authorization": f"Bearer {token}"}
    answer = httpx.get(f"{url}/v1/runs", headers=headers, timeout=ANSWER_HANG_GUARD)
    return answer.status_code == 200
