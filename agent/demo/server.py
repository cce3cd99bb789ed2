"""The control plane ``ckpt demo`` talks to: the one ``--server`` names, or ``ckpt server``
started in the background on a free port (the embedded default: SQLite and the directory
store under ``./.ckpt``), until the demo is done (or, with ``--serve``, until Ctrl-C)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from urllib.parse import quote

import httpx

from ckpt.core.tokens import default_token


@contextmanager
def control_plane(args: argparse.Namespace, work: Path) -> Iterator[tuple[str, str | None]]:
    """The given control plane, or ``ckpt server`` started here on a free port."""
    if args.server:
        yield args.server.rstrip("/"), default_token()
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "CKPT_STORE": args.store,
        "CKPT_PORT": str(port),
        "CKPT_LOST_AFTER_SECONDS": "5",  # so that the SIGKILLed attempt shows as lost
    }
    with (work / "server.log").open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "ckpt", "server"], env=env, stdout=log, stderr=log
        )
    try:
        _wait_healthy(url, server, work / "server.log")
        yield url, default_token()
    finally:
        server.terminate()
        server.wait(15)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_healthy(url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"ckpt server exited:\n{log.read_text()[-2000:]}")
        with suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"ckpt server did not become ready:\n{log.read_text()[-2000:]}")


def dashboard_url(server: str, run: str) -> str:
    """The run's page on the control plane's dashboard."""
    return f"{server}/ui/runs/{quote(run, safe='')}"


def serve_until_interrupted(url: str, run: str) -> None:
    """Keep the control plane up (the caller's ``control_plane`` block) until Ctrl-C."""
    print()
    print(f"The control plane stays up at {url} until Ctrl-C (--serve).")
    print(f"  dashboard: {dashboard_url(url, run)}")
    print("  sign in with the admin token in .ckpt/admin-token (or a read token)")
    with suppress(KeyboardInterrupt):
        threading.Event().wait()
