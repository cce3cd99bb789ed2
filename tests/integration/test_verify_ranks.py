"""Every resume proves itself on many ranks: two ranks (gloo on the CPU, real processes, DDP)
SIGKILLed mid-training and resumed compare, each its own, the steps they replay with what
the killed attempt computed, and the ranks' answers reduce to one verdict (agent.verify).

The job is tests/integration/flawed_ranks.py (the many-rank demo job): as it is, the resume
is verified; with one flaw on rank 1 alone (a random source ckpt does not capture, a damaged
optimizer layer) it is diverged at the first replayed step where the flaw can show, on
rank 1, naming the part that differs and the likely layer. Each fails if the comparison is
removed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.ranks_job import load_ranks, run_ranks
from tests.server_process import ckpt_server

pytestmark = pytest.mark.slow

WORLD = 2
MODULE = "tests.integration.flawed_ranks"
JOB = ("--steps", "8", "--every", "2", "--parallel", "ddp")
KILL = ("--kill-at", "5.1")  # after the save at step 4: 4.1, 5.0 and 5.1 replayed


def interrupted(
    tmp_path: Path,
    flaw: str,
    *,
    killed_flaw: str,
    store: Path | None = None,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Kill both ranks at 5.1 (the job with ``killed_flaw``), resume them with ``flaw`` on
    rank 1 (both with ``env``, on ``store``); each rank's verdict."""
    store, out = store or tmp_path / "store", tmp_path / "out"
    marker = ("--drill-marker", str(tmp_path / "killed"))
    killing = (*JOB, *KILL, *marker, *flawed(killed_flaw))
    killed = run_ranks(WORLD, store, out, *killing, env=env, module=MODULE)
    assert killed.codes == [-9] * WORLD, killed.text()
    done = run_ranks(WORLD, store, out, *JOB, *flawed(flaw), env=env, module=MODULE)
    assert done.codes == [0] * WORLD, done.text()
    assert "resumed from" in done.outputs[0], done.text()
    return [json.loads(state["verification"]) for state in load_ranks(out, WORLD)]


def flawed(flaw: str) -> tuple[str, ...]:
    return ("--flaw", flaw, "--flaw-rank", "1")


def test_two_ranks_killed_then_resumed_are_verified(tmp_path: Path) -> None:
    verifications = interrupted(tmp_path, "none", killed_flaw="none")
    for rank, verification in enumerate(verifications):
        assert verification["verdict"] == "verified", (rank, verification)
        assert verification["steps_compared"] == 3  # 4.1, 5.0, 5.1: every rank's, once
        assert (
            verification["detail"] == "1 of the 3 compared positions carried the parameters' sample"
        )


@pytest.mark.parametrize(
    ("flaw", "killed_flaw", "first", "part", "layer"),
    [
        # Both attempts draw from the leak: the resumed one from its seed again.
        ("leaky-rng", "leaky-rng", (4, 1), "loss", "data or rng layer"),
        # The loss of 5.0 came before the damaged moment was used; the parameters' sample
        # after that step (the first after the resume) shows it.
        ("optimizer", "none", (5, 0), "params", "optimizer layer"),
    ],
)
def test_a_flaw_on_one_rank_diverges_at_the_first_replayed_step(
    tmp_path: Path,
    *,
    flaw: str,
    killed_flaw: str,
    first: tuple[int, int],
    part: str,
    layer: str,
) -> None:
    verifications = interrupted(tmp_path, flaw, killed_flaw=killed_flaw)
    assert verifications[0] == verifications[1]  # one verdict, reduced over both ranks
    verification = verifications[0]
    assert verification["verdict"] == "diverged", verification
    difference = verification["first_difference"]
    assert (difference["step"], difference["micro_step"], difference["rank"]) == (*first, 1)
    assert difference["part"] == part and difference["expected"] != difference["got"]
    assert layer in verification["detail"]


def test_through_the_control_plane_a_flaw_on_one_rank_diverges_on_the_attempt(
    tmp_path: Path,
) -> None:
    # Each rank's fingerprints ride on its own heartbeats; each resumed rank reads its own
    # back (GET .../replay?rank=R); rank 0 records the one verdict on the attempt.
    with ckpt_server(tmp_path) as server:
        env = {**server.env(), "CKPT_RUN": "ranks"}
        verifications = interrupted(
            tmp_path, "leaky-rng", killed_flaw="leaky-rng", store=Path(server.store), env=env
        )
        with server.client() as client:
            attempts = client.get("/v1/runs/ranks/lineage").json()["attempts"]
    verification = verifications[0]
    assert verification["verdict"] == "diverged", verification
    difference = verification["first_difference"]
    assert (difference["step"], difference["micro_step"], difference["rank"]) == (4, 1, 1)
    assert verification["from_attempt_id"] == attempts[0]["id"]
    assert attempts[1]["verification"] == verification
