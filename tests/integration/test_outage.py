"""A control plane that is down costs no save and no wait: a real trainer keeps training and
saving through an outage, every save reaches the store and is committed once the control
plane answers again; and a bundle whose commit never came is rolled forward by the next
attempt rather than lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from agent.catalog.client import TRY_SECONDS
from tests.fault_proxy import FaultProxy, Faults
from tests.server_process import TOKEN, free_port, serving

pytestmark = pytest.mark.slow

OUTAGE_SECONDS = 10.0
DEADLINE = 300.0  # generous: a busy 2-core machine


@contextmanager
def control_plane(root: Path, port: int) -> Iterator[str]:
    """``ckpt server`` on ``port`` over the catalog and store under ``root`` (the same ones
    at every start, as a restarted replica sees them)."""
    env = {
        **os.environ,
        "CKPT_DATABASE_URL": f"sqlite:///{root / 'catalog.db'}",
        "CKPT_STORE": str(root / "store"),
        "CKPT_ADMIN_TOKEN": TOKEN,
        "CKPT_AUTO_MIGRATE": "1",
        "CKPT_GC_INTERVAL_SECONDS": "0",
    }
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "ckpt", "server", "--port", str(port)]
    with serving(command, env=env, cwd=root, log=root / "server.log", url=url):
        yield url


@contextmanager
def proxied(url: str, faults: Faults) -> Iterator[FaultProxy]:
    proxy = FaultProxy(url, faults)
    try:
        yield proxy
    finally:
        proxy.close()


def start_trainer(
    root: Path,
    url: str,
    folder: Path,
    *args: str,
    ranks: int = 1,
    settings: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """The outage trainer in its own process (``ranks`` > 1: that many, under torchrun)."""
    folder.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "CKPT_SERVER": url,
        "CKPT_TOKEN": TOKEN,
        "CKPT_STORE": str(root / "store"),
        "PYTHONPATH": str(Path(__file__).parents[2]),
        "OMP_NUM_THREADS": "1",
        **(settings or {}),
    }
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    trainer = ["-m", "tests.integration.outage_trainer", "run", str(folder)]
    command = [sys.executable, *(launch if ranks > 1 else []), *trainer]
    with (folder / "trainer.log").open("wb") as log:
        return subprocess.Popen([*command, *args], env=env, cwd=root, stdout=log, stderr=log)


def wait_until(done: Any, what: str, trainer: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + DEADLINE
    while not done():
        assert trainer is None or trainer.poll() is None, f"the trainer exited: {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def finish(trainer: subprocess.Popen[bytes], folder: Path) -> dict[str, Any]:
    code = trainer.wait(timeout=DEADLINE)
    log = (folder / "trainer.log").read_text()
    assert code == 0, log
    result: dict[str, Any] = json.loads((folder / "result.json").read_text())
    return result | {"log": log}


def lineage(url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        body: dict[str, Any] = client.get("/v1/runs/run/lineage").raise_for_status().json()
        for bundle in body["bundles"]:
            events = client.get(f"/v1/bundles/{bundle['id']}/events").raise_for_status().json()
            bundle["events"] = events["events"]
        return body


def same_weights(first: Path, second: Path) -> bool:
    a, b = torch.load(first), torch.load(second)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def through_an_outage(
    trainer: subprocess.Popen[bytes],
    folder: Path,
    faults: Faults,
    *,
    down: int,
    up: int,
    fault: str = "reset",
) -> None:
    """Drop every connection (``fault``: or hold it unanswered, ``stall``) from step ``down``
    until the trainer, paused at step ``up``, has trained through at least
    ``OUTAGE_SECONDS`` of it; then let it go on."""
    wait_until((folder / f"at-{down}").exists, f"step {down}", trainer)
    faults.rates[fault] = 1.0  # down: every connection dropped, or held
    down_at = time.monotonic()
    (folder / f"go-{down}").touch()
    wait_until((folder / f"at-{up}").exists, f"step {up}, in the outage", trainer)
    wait_until(lambda: time.monotonic() - down_at >= OUTAGE_SECONDS, "the outage's end")
    faults.rates.clear()
    (folder / f"go-{up}").touch()


def test_an_outage_skips_no_save_and_never_holds_training(tmp_path: Path) -> None:
    """The control plane drops every connection for 10 s while the trainer trains and saves
    (every 2 steps, 5 of them in the outage): every save is committed once it answers."""
    faults = Faults()
    with control_plane(tmp_path, free_port()) as url, proxied(url, faults) as proxy:
        first = tmp_path / "first"
        trainer = start_trainer(tmp_path, proxy.url, first, "20", "2", "6", "16")
        through_an_outage(trainer, first, faults, down=6, up=16)
        result = finish(trainer, first)
        committed = sorted(b["step"] for b in lineage(url)["bundles"] if b["status"] == "complete")
        second = tmp_path / "second"
        finish(start_trainer(tmp_path, proxy.url, second, "20", "2"), second)
    print(f"longest maybe_save() call: {result['slowest_maybe_save'] * 1000:.1f} ms")
    assert faults.seen["reset"] > 0
    assert result["taken"] == list(range(2, 21, 2)), result["log"]
    assert result["durable"] == result["taken"]
    assert committed == result["taken"]
    assert "skipping" not in result["log"] and "heartbeat failed" not in result["log"]
    # At most the save before's bytes, with half a second for the control plane to answer
    # (then the store answers instead); staging this model takes milliseconds.
    assert result["slowest_maybe_save"] < 2.0
    assert (second / "resumed").read_text() == "20"
    assert same_weights(second / "resumed.pt", first / "weights-20.pt")


def test_a_black_holed_control_plane_holds_no_save_longer_than_a_calm_one(
    tmp_path: Path,
) -> None:
    """The control plane holds every connection without answering (a black hole: a replica
    hung, a network partition) for 10 s while the trainer saves every 2 steps: no
    ``maybe_save()`` waits longer than twice the longest one before the outage, or that plus
    half of ``TRY_SECONDS`` (a save's calls wait a second for an answer, then defer their
    commit; before, the first waited ``TRY_SECONDS`` whatever its patience), and the run
    resumes bit-exactly from the last save."""
    faults = Faults(stall_seconds=OUTAGE_SECONDS)
    with control_plane(tmp_path, free_port()) as url, proxied(url, faults) as proxy:
        first = tmp_path / "first"
        trainer = start_trainer(tmp_path, proxy.url, first, "24", "2", "8", "18")
        through_an_outage(trainer, first, faults, down=8, up=18, fault="stall")
        result = finish(trainer, first)
        committed = sorted(b["step"] for b in lineage(url)["bundles"] if b["status"] == "complete")
        second = tmp_path / "second"
        finish(start_trainer(tmp_path, proxy.url, second, "24", "2"), second)
    calm = max(seconds for step, seconds in result["stalls"] if step <= 8)
    held = max(seconds for step, seconds in result["stalls"] if 8 < step <= 18)
    print(f"longest maybe_save(): {calm * 1000:.1f} ms calm, {held * 1000:.1f} ms black-holed")
    assert faults.seen["stall"] > 0
    assert held <= max(2 * calm, calm + TRY_SECONDS / 2), result["log"]
    assert result["taken"] == result["durable"] == committed == list(range(2, 25, 2))
    assert (second / "resumed").read_text() == "24"
    assert same_weights(second / "resumed.pt", first / "weights-24.pt")


def test_a_bundle_whose_commit_never_came_is_rolled_forward(tmp_path: Path) -> None:
    """The trainer is SIGKILLed after step 16's bytes are in the store and its layers are
    recorded, while the proxy drops its commit: the next attempt resumes from 16."""
    faults = Faults(paths=r"^/v1/bundles/\d+/commit$")
    with control_plane(tmp_path, free_port()) as url, proxied(url, faults) as proxy:
        first = tmp_path / "first"
        trainer = start_trainer(tmp_path, proxy.url, first, "24", "4", "12!")
        wait_until((first / "at-12").exists, "step 12", trainer)
        faults.rates["reset"] = 1.0
        (first / "go-12").touch()
        wait_until(lambda: faults.seen["reset"] > 0, "step 16's commit", trainer)
        wait_until((first / "weights-16.pt").exists, "step 16's weights", trainer)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=DEADLINE)
        faults.rates.clear()
        second = tmp_path / "second"
        finish(start_trainer(tmp_path, proxy.url, second, "24", "4"), second)
        bundles = {b["step"]: b for b in lineage(url)["bundles"]}
    assert (second / "resumed").read_text() == "16", (first / "trainer.log").read_text()
    assert same_weights(second / "resumed.pt", first / "weights-16.pt")
    rolled = bundles[16]
    assert rolled["status"] == "complete" and rolled["attempt_id"] == bundles[12]["attempt_id"]
    reasons = [e["reason"] or "" for e in rolled["events"] if e["action"] == "committed"]
    assert any("rolled forward" in reason for reason in reasons), rolled["events"]


def test_an_outage_skips_no_save_of_a_job_of_two_ranks(tmp_path: Path) -> None:
    """Two DDP ranks under torchrun save every 2 steps through 10 s of dropped connections:
    every save reaches the store, rank 0 commits each once the control plane answers, both
    ranks see each durable, and a fresh 2-rank attempt resumes bit-exactly from the last."""
    faults = Faults()
    with control_plane(tmp_path, free_port()) as url, proxied(url, faults) as proxy:
        first = tmp_path / "first"
        trainer = start_trainer(tmp_path, proxy.url, first, "16", "2", "4", "12", ranks=2)
        through_an_outage(trainer, first, faults, down=4, up=12)
        result = finish(trainer, first)
        other = json.loads((first / "result-1.json").read_text())
        committed = sorted(b["step"] for b in lineage(url)["bundles"] if b["status"] == "complete")
        second = tmp_path / "second"
        finish(start_trainer(tmp_path, proxy.url, second, "16", "2", ranks=2), second)
    slowest = max(result["slowest_maybe_save"], other["slowest_maybe_save"])
    print(f"longest maybe_save() call of either rank: {slowest * 1000:.1f} ms")
    assert faults.seen["reset"] > 0
    assert result["taken"] == other["taken"] == list(range(2, 17, 2)), result["log"]
    assert result["durable"] == other["durable"] == result["taken"]
    assert committed == result["taken"]
    assert "skipping" not in result["log"] and "heartbeat failed" not in result["log"]
    assert slowest < 2.0  # as for one process: the bytes before, and half a second
    assert (second / "resumed").read_text() == "16"
    assert same_weights(second / "resumed.pt", first / "weights-16.pt")


def test_a_trainer_ending_in_an_outage_exits_within_the_retry_window(tmp_path: Path) -> None:
    """The control plane goes down before the last save: end() and close() wait for its
    commit for the client's retry window (4 s here), say what is left uncommitted, and the
    process exits. The bundle was never opened (no layer recorded): the next attempt resumes
    from the one before."""
    faults = Faults()
    window = {"CKPT_SERVER_RETRY_SECONDS": "4"}
    with control_plane(tmp_path, free_port()) as url, proxied(url, faults) as proxy:
        first = tmp_path / "first"
        trainer = start_trainer(
            tmp_path, proxy.url, first, "8", "2", "6!", "nowait", settings=window
        )
        wait_until((first / "at-6").exists, "step 6", trainer)
        faults.rates["reset"] = 1.0
        went_at = time.monotonic()
        (first / "go-6").touch()
        result = finish(trainer, first)
        took = time.monotonic() - went_at
        faults.rates.clear()
        second = tmp_path / "second"
        finish(start_trainer(tmp_path, proxy.url, second, "8", "2"), second)
    print(f"the trainer exited {took:.1f} s after the control plane went down")
    assert "stay uncommitted in the store" in result["log"], result["log"]
    # The window for the commit and the end together, and the process's own exit.
    assert took < 4 + 5 + 20
    assert (second / "resumed").read_text() == "6", (first / "trainer.log").read_text()
    assert same_weights(second / "resumed.pt", first / "weights-6.pt")
