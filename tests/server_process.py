"""Run ``ckpt server`` as a real process for end-to-end tests."""

from __future__ import annotations

import os
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


@dataclass(frozen=True)
class ServerProcess:
    url: str
    token: str
    store: str
    log: Path

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
    port = free_port()
    store = store or str(root / "store")
    log = root / "server.log"
    environment = {
        **os.environ,
        **(env or {}),
        "CKPT_DATABASE_URL": database_url or f"sqlite:///{root / 'catalog.db'}",
        "CKPT_STORE": store,
        "CKPT_ADMIN_TOKEN": TOKEN,
        "CKPT_AUTO_MIGRATE": "1",
        "CKPT_GC_INTERVAL_SECONDS": "0",
    }
    command = [sys.executable, "-m", "ckpt", "server", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with serving(command, env=environment, cwd=root, log=log, url=url):
        yield ServerProcess(url=url, token=TOKEN, store=store, log=log)


@contextmanager
def serving(
    command: list[str], *, env: dict[str, str], cwd: Path, log: Path, url: str
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` as a process logging to ``log``, once ``url``'s ``/readyz`` answers 200;
    terminated (killed if need be) on exit."""
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, process, log, what=" ".join(command))
        yield process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, *, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not become ready in 60 s:\n{log.read_text()}")
