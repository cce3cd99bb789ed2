"""SIGTERM and SIGKILL at chosen moments of a real training process, then a resume that
must be bit-exact with a run that was never interrupted.

The demo job (agent/demo/train.py) signals itself at a known position (``--signal-at``),
stalls in a long step (``--pause-at``), uploads slowly (``--slow-store``) or is killed in
the middle of an upload (``--kill-during-upload``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.attempt.grace import deadline_seconds
from agent.attempt.signals import EXIT_PREEMPTED
from agent.demo.compare import differences
from ckpt.core.storage import keys
from tests.conftest import run_trainer
from tests.server_process import ckpt_server

pytestmark = pytest.mark.slow

STEPS = ("--steps", "24", "--total-steps", "32")
EVERY = ("--every", "5")
# With a grace period this short the agent stops one second before it ends, which leaves
# the interpreter time to exit (about 0.9 s here).


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reference")
    return run_trainer(root / "store", root / "reference.pt", *STEPS)


@dataclass
class Drill:
    rc: int
    after_signal: float  # seconds from the signal to the exit
    stdout: str
    stderr: str
    heard: list[tuple[float, str]]  # when each line of either stream came, in order

    def said(self, text: str) -> float:
        """Seconds from the signal to the first line that contains ``text``: when the agent
        decided, which a busy machine delays far less than the interpreter's exit after it."""
        signal = next(at for at, line in self.heard if line.startswith("SIGTERM at"))
        return next(at for at, line in self.heard if text in line) - signal


def drill(store: Path, out: Path, *args: str, env: dict[str, str] | None = None) -> Drill:
    """Run the job until it ends; time from its "SIGTERM at" line to its exit."""
    command = [
        sys.executable,
        "-m",
        "agent.demo.train",
        "--store",
        str(store),
        "--out",
        str(out),
    ]
    with subprocess.Popen(
        [*command, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        heard: list[tuple[float, str]] = []
        streams: dict[Any, list[str]] = {process.stdout: [], process.stderr: []}

        def read(stream: Any) -> None:
            for line in stream:
                heard.append((time.monotonic(), line))
                streams[stream].append(line)

        readers = [threading.Thread(target=read, args=(stream,)) for stream in streams]
        for reader in readers:
            reader.start()
        rc = process.wait()  # pytest's timeout is the hang guard: a slow machine is no hang
        ended = time.monotonic()  # the process, not its data-loader workers, has exited
        for reader in readers:
            reader.join()
    signal = next((at for at, line in heard if line.startswith("SIGTERM at")), ended)
    stdout, stderr = ("".join(lines) for lines in streams.values())
    return Drill(rc, ended - signal, stdout, stderr, sorted(heard, key=lambda h: h[0]))


def bundle_steps(store: Path, run: str = "demo") -> list[int]:
    return [step for step, _ in bundle_positions(store, run)]


def bundle_positions(store: Path, run: str = "demo") -> list[tuple[int, int]]:
    found = (keys.manifest_position(key) for key in _keys(store / "runs" / run))
    return sorted(position for position in found if position is not None)


def _keys(root: Path) -> list[str]:
    base = root.parents[1]
    return [p.relative_to(base).as_posix() for p in root.rglob("manifest.json")]


@pytest.mark.parametrize(
    ("signal_at", "saved_at"),
    [
        ("3.1", None),  # before any save: nothing measured, nothing to keep; starts over
        ("12.1", 12),  # between saves: the emergency save lands at the next boundary
        ("10.0", 10),  # right after a periodic save: it is in flight, then saved again
        ("14.3", 15),  # the last micro-batch of a step
    ],
)
def test_sigterm_saves_at_the_next_boundary_and_the_resume_is_bit_exact(
    tmp_path: Path, reference: dict[str, Any], signal_at: str, saved_at: int | None
) -> None:
    store = tmp_path / "store"
    first = drill(store, tmp_path / "first.pt", *STEPS, *EVERY, "--signal-at", signal_at)
    assert first.rc == EXIT_PREEMPTED, first.stderr[-3000:]
    assert first.after_signal < 30
    assert "preempted by SIGTERM" in first.stderr
    steps = bundle_steps(store)
    assert (steps[-1] if steps else None) == saved_at
    resumed = run_trainer(store, tmp_path / "resumed.pt", *STEPS, *EVERY)
    assert differences(reference, resumed) == []


def test_sigterm_during_a_slow_upload_waits_for_it_and_keeps_it(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """The save of step 10 is in flight at the signal; the next boundary is 10.1, in the same
    step: the agent waits for step 10's and keeps it, then saves 10.1 as a bundle of its own
    if a save fits what is left of the grace period."""
    store = tmp_path / "store"
    first = drill(
        store, tmp_path / "a.pt", *STEPS, *EVERY, "--slow-store", "0.2", "--signal-at", "10.0"
    )
    assert first.rc == EXIT_PREEMPTED, first.stderr[-3000:]
    assert "BundleExistsError" not in first.stderr
    newest = bundle_positions(store)[-1]
    assert newest in ((10, 0), (10, 1))
    assert bundle_positions(store)[-2:-1] == ([(5, 0)] if newest == (10, 0) else [(10, 0)])
    resumed = run_trainer(store, tmp_path / "resumed.pt", *STEPS, *EVERY)
    assert resumed["positions"][0] == (10, newest[1] + 1)
    assert differences(reference, resumed) == []


def test_a_save_that_does_not_fit_the_grace_period_keeps_the_last_bundle(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Uploads are slow (8 s a blob: a save, which writes its blobs in parallel, takes 8 s or
    more), the grace period 6 s: step 13 lasts until the save at step 10 is durable, and the
    measured save time does not fit what is left after the signal at 14.1. The next step
    boundary must come before the deadline (5 s), which it does even on a machine so busy
    that one micro-batch takes seconds (a 3 s grace period left 2 s)."""
    store = tmp_path / "store"
    grace = 6.0
    first = drill(
        store,
        tmp_path / "a.pt",
        *STEPS,
        *EVERY,
        "--slow-store",
        "8.0",
        "--durable-at",
        "13.0",
        "--signal-at",
        "14.1",
        env={"CKPT_GRACE_SECONDS": str(grace)},
    )
    assert first.rc == EXIT_PREEMPTED, first.stderr[-3000:]
    assert "the last bundle stays" in first.stderr
    assert "a save takes" in first.stderr  # the save at 10 was measured: it did not fit
    # It decided at the boundary, within the grace period's deadline, and did not save: the
    # interpreter's exit after that is no longer the agent's (it leaves the heap frozen to
    # the OS, test_signals.py; still seconds at a load of 20).
    assert first.said("preempted by SIGTERM") < deadline_seconds(grace)
    assert bundle_steps(store)[-1] == 10
    resumed = run_trainer(store, tmp_path / "resumed.pt", *STEPS, *EVERY)
    assert resumed["positions"][0] == (10, 1)
    assert differences(reference, resumed) == []


def test_a_signal_far_from_a_step_boundary_still_ends_the_process_in_time(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """The loop sits in a 60 s step; the deadline, not the loop, ends the process."""
    store = tmp_path / "store"
    first = drill(
        store,
        tmp_path / "a.pt",
        *STEPS,
        *EVERY,
        "--signal-at",
        "12.1",
        "--pause-at",
        "12.2:60",
        env={"CKPT_GRACE_SECONDS": "6"},
    )
    assert first.rc == EXIT_PREEMPTED, first.stderr[-3000:]
    assert "no step boundary within the grace period" in first.stderr
    assert first.said("no step boundary within the grace period") < 6
    assert bundle_steps(store)[-1] == 10
    resumed = run_trainer(store, tmp_path / "resumed.pt", *STEPS, *EVERY)
    assert differences(reference, resumed) == []


def test_sigkill_in_the_middle_of_an_upload_leaves_that_bundle_unresumable(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    store = tmp_path / "store"
    killed = drill(store, tmp_path / "a.pt", *STEPS, *EVERY, "--kill-during-upload", "15")
    assert killed.rc == -9
    assert "killed during an upload" in killed.stdout
    assert bundle_steps(store)[-1] == 10
    resumed = run_trainer(store, tmp_path / "resumed.pt", *STEPS, *EVERY)
    assert resumed["positions"][0] == (10, 1)
    assert differences(reference, resumed) == []


@pytest.mark.parametrize(
    ("extra", "committed"),
    [(("--signal-at", "12.1"), True), (("--signal-at", "12.1", "--pause-at", "12.2:60"), False)],
    ids=["at-a-boundary", "far-from-a-boundary"],
)
def test_the_attempt_ends_as_preempted_with_its_final_save_flag(
    tmp_path: Path, reference: dict[str, Any], extra: tuple[str, ...], committed: bool
) -> None:
    with ckpt_server(tmp_path) as server:
        env = {**server.env(), "CKPT_RUN": "preempted", "CKPT_GRACE_SECONDS": "6"}
        first = drill(
            Path(server.store),
            tmp_path / "a.pt",
            "--run",
            "preempted",
            *STEPS,
            *EVERY,
            *extra,
            env=env,
        )
        assert first.rc == EXIT_PREEMPTED, first.stderr[-3000:]
        with server.client() as client:
            lineage = client.get("/v1/runs/preempted/lineage").json()
        (attempt,) = lineage["attempts"]
        assert attempt["end_reason"] == "preempted"
        assert attempt["final_save_committed"] is committed
        resumed = run_trainer(
            server.store, tmp_path / "resumed.pt", "--run", "preempted", *STEPS, *EVERY, env=env
        )
    assert differences(reference, resumed) == []
