"""``bench/fleet.py`` still runs: a tiny fleet for a few seconds, against one server process
and the floor, every route answered without error, and the heartbeats and `/resumable` beside
the floor's SELECT at the same moments."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.conftest import PG_ADMIN

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fleet.py"

pytestmark = pytest.mark.slow


def test_the_fleet_benchmark_runs_and_reports_every_route() -> None:
    command = [sys.executable, str(BENCH), "--jobs", "2", "--ranks", "2", "--workers", "1"]
    command += ["--seconds", "4", "--heartbeat", "1", "--save-every", "2", "--wave", "0.5"]
    command += ["--postgres", PG_ADMIN]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "(0 errors)" in done.stdout, done.stdout
    for route in ("resumable", "heartbeat"):
        assert f"{route} beside the floor's SELECT" in done.stdout, done.stdout
    for route in ("register", "resumable", "heartbeat", "blobs/missing", "record", "commit"):
        row = re.search(rf"^  {re.escape(route)} +(\d+) +(\d+) ", done.stdout, re.MULTILINE)
        assert row, f"no row for {route}:\n{done.stdout}"
        assert int(row.group(1)) > 0 and int(row.group(2)) == 0, row.group(0)
