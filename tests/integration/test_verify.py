"""Every resume proves itself: a job SIGKILLed mid-training and resumed compares the steps
it replays with what the killed attempt computed (agent.verify).

The job is the demo's (agent.demo.train), run through tests/integration/flawed_trainer.py:
as it is, it resumes bit-exactly and is reported verified over every replayed position
that both attempts fingerprinted (agent.verify.cadence); with one flaw (a random source
ckpt does not capture, a damaged data layer, a damaged optimizer layer) it is reported
diverged at the first replayed step, naming the part that differs and the likely layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_trainer
from tests.server_process import ckpt_server

pytestmark = pytest.mark.slow

STEPS = ("--steps", "12", "--total-steps", "20", "--every", "6", "--workers", "0")
KILL = ("--kill-at", "9.2")  # after the save at step 6: 3 steps and 2 micro steps to replay
REPLAYED = 3 * 4 + 2  # (6, 1) ... (9, 2)
# By default those of steps 6, 7 and 8 (the save's and the two after it: AFTER_ANCHOR) are
# fingerprinted, the loss at each, the parameters' sample after the steps to 7 and 8; not
# step 9 (no multiple of CKPT_VERIFY_EVERY_STEPS, 32 by default). With 1: every position,
# and 3 samples. (compared positions, of them with the sample), by CKPT_VERIFY_EVERY_STEPS:
FINGERPRINTED = {None: (REPLAYED - 3, 2), "1": (REPLAYED, 3)}


def interrupted(tmp_path: Path, flaw: str, *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Kill the job at 9.2, resume it with ``flaw`` (both attempts with ``env``); the resumed
    attempt's verdict."""
    store, module = tmp_path / "store", "tests.integration.flawed_trainer"
    # The killed attempt runs flawless: a flaw shows on resume.
    killed = ("--flaw", "none", *STEPS, *KILL)
    run_trainer(store, tmp_path / "a.pt", *killed, expect_rc=-9, module=module, env=env)
    resumed = run_trainer(store, tmp_path / "b.pt", "--flaw", flaw, *STEPS, module=module, env=env)
    assert resumed["positions"][0] == (6, 1)
    verification: dict[str, Any] = json.loads(resumed["verification"])
    return verification


@pytest.mark.parametrize("every", [None, "1"], ids=["default", "every-step"])
def test_a_resume_after_a_sigkill_is_verified_over_every_replayed_step(
    tmp_path: Path, every: str | None
) -> None:
    env = None if every is None else {"CKPT_VERIFY_EVERY_STEPS": every}
    verification = interrupted(tmp_path, "none", env=env)
    assert verification["verdict"] == "verified"
    compared, sampled = FINGERPRINTED[every]
    assert verification["steps_compared"] == compared
    assert verification["detail"] == (
        f"{sampled} of the {compared} compared positions carried the parameters' sample"
    )
    assert verification["mode"] == "exact" and verification["first_difference"] is None


@pytest.mark.parametrize(
    ("flaw", "first", "part", "layer"),
    [
        ("leaky-sampler", (6, 1), "loss", "data or rng layer"),
        ("data", (6, 1), "loss", "data or rng layer"),
        # The loss of 7.0 was computed before the damaged moment was used: the parameters'
        # sample after that step (the first after the resume, sampled by both attempts
        # whatever the period) shows it; the loss would only at 7.1.
        ("optimizer", (7, 0), "params", "optimizer layer"),
    ],
)
def test_a_flawed_resume_diverges_at_the_first_replayed_step(
    tmp_path: Path, flaw: str, first: tuple[int, int], part: str, layer: str
) -> None:
    verification = interrupted(tmp_path, flaw)
    assert verification["verdict"] == "diverged", verification
    difference = verification["first_difference"]
    assert (difference["step"], difference["micro_step"]) == first
    assert difference["part"] == part and difference["expected"] != difference["got"]
    assert layer in verification["detail"]


def test_the_tolerance_mode_reports_the_largest_relative_difference(tmp_path: Path) -> None:
    env = {"CKPT_VERIFY": "tolerance:1e-3"}
    verification = interrupted(tmp_path, "optimizer", env=env)
    assert verification["mode"] == "tolerance"
    assert verification["verdict"] == "verified", verification
    assert 0 < verification["max_relative_difference"] < 1e-3


def test_a_diverged_resume_stops_when_told_to(tmp_path: Path) -> None:
    store, module = tmp_path / "store", "tests.integration.flawed_trainer"
    run_trainer(
        store, tmp_path / "a.pt", "--flaw", "none", *STEPS, *KILL, expect_rc=-9, module=module
    )
    with pytest.raises(AssertionError, match="ResumeDivergedError"):
        run_trainer(
            store,
            tmp_path / "b.pt",
            "--flaw",
            "data",
            *STEPS,
            module=module,
            env={"CKPT_VERIFY_STOP": "1"},
        )


def test_through_the_control_plane_the_verdict_is_on_the_resumed_attempt(tmp_path: Path) -> None:
    # The killed attempt's fingerprints ride on its heartbeats; the resumed one reads them
    # back (GET .../replay) and records its verdict (PUT .../verification).
    module = "tests.integration.flawed_trainer"
    with ckpt_server(tmp_path) as server:
        env, store = server.env(), server.store
        job = ("--flaw", "none", *STEPS)
        run_trainer(store, tmp_path / "a.pt", *job, *KILL, expect_rc=-9, module=module, env=env)
        resumed = run_trainer(store, tmp_path / "b.pt", *job, module=module, env=env)
        with server.client() as client:
            attempts = client.get("/v1/runs/demo/lineage").json()["attempts"]
    verification = json.loads(resumed["verification"])
    compared, _ = FINGERPRINTED[None]
    assert (verification["verdict"], verification["steps_compared"]) == ("verified", compared)
    assert verification["from_attempt_id"] == attempts[0]["id"]
    assert attempts[0]["verification"] is None
    assert attempts[1]["verification"] == verification
