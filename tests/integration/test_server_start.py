"""``ckpt server`` starting as a new user starts it: the first start on a new catalog says
in one line that it upgraded the schema; a port another process holds fails at once, with
what to change, before anything is created."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.server_process import ckpt_server


def test_the_first_start_says_in_one_line_that_it_upgraded_the_catalog(tmp_path: Path) -> None:
    with ckpt_server(tmp_path) as server:
        log = server.log.read_text()
    migrations = [
        line
        for line in log.splitlines()
        if "alembic" in line or "upgrade" in line.lower() or "migration" in line.lower()
    ]
    assert len(migrations) == 1, log
    assert "catalog schema upgraded to " in migrations[0], log
    assert "Running upgrade" not in log


def test_a_busy_port_fails_at_once_and_creates_nothing(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
        done = subprocess.run(
            [sys.executable, "-m", "ckpt", "server", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout == ""  # no "control plane on http://..." for a server that never served
    assert done.stderr.splitlines() == [
        f"ckpt server: cannot listen on 127.0.0.1:{port}: Address already in use; stop what "
        "holds it or choose another port (--port or CKPT_PORT)"
    ]
    assert list(tmp_path.iterdir()) == []  # no .ckpt/: no catalog, no store, no token
