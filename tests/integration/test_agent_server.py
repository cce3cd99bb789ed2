"""End to end: the agent against a real ``ckpt server`` process and the directory store.

Train, save, get killed, resume in a new process through ``POST /v1/runs/{run}/attempts``,
and compare bit for bit with a run that was never interrupted.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from agent.demo.compare import differences
from agent.demo.report import format_attempt
from tests.conftest import run_trainer
from tests.server_process import ckpt_server

pytestmark = pytest.mark.slow

STEPS = ("--steps", "24", "--total-steps", "32")
EVERY = ("--every", "8")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reference")
    return run_trainer(root / "store", root / "reference.pt", *STEPS)


def test_killed_run_resumes_through_the_control_plane_bit_exactly(
    tmp_path: Path, reference: dict[str, Any], database_url: str | None
) -> None:
    with ckpt_server(tmp_path, database_url=database_url) as server:
        env = {**server.env(), "CKPT_RUN": "e2e"}
        run_trainer(
            server.store,
            tmp_path / "killed.pt",
            *STEPS,
            *EVERY,
            "--run",
            "e2e",
            "--save-at",
            "12.2",
            "--kill-after-save",
            expect_rc=-9,
            env=env,
        )
        with server.client() as client:
            first = client.get("/v1/runs/e2e/resumable").json()
            assert first["step"] == 12
        resumed = run_trainer(
            server.store, tmp_path / "resumed.pt", *STEPS, *EVERY, "--run", "e2e", env=env
        )
        assert resumed["positions"][0] == (12, 3)
        assert differences(reference, resumed) == []
        with server.client() as client:
            lineage = client.get("/v1/runs/e2e/lineage").json()
    attempts = lineage["attempts"]
    assert [a["epoch"] for a in attempts] == [1, 2]
    # Killed: it never said goodbye (the server marks it lost once its heartbeats lapse).
    assert attempts[0]["end_reason"] in (None, "lost")
    assert attempts[1]["end_reason"] == "finished"
    assert attempts[1]["resumed_from_id"] == first["bundle_id"]
    assert lineage["resume_edges"] == [{"bundle": first["bundle_id"], "attempt": attempts[1]["id"]}]
    bundles = {b["step"]: b for b in lineage["bundles"]}
    assert sorted(bundles) == [8, 12, 16, 24]
    assert {b["status"] for b in bundles.values()} == {"complete"}
    # Each bundle's parent is the previous one, across the restart (the resume edge).
    assert bundles[8]["parent_id"] is None
    for before, after in ((8, 12), (12, 16), (16, 24)):
        assert bundles[after]["parent_id"] == bundles[before]["id"]
    assert lineage["head_id"] == lineage["resumable_id"] == bundles[24]["id"]
    assert lineage["live_branch"] == [bundles[s]["id"] for s in (24, 16, 12, 8)]


def test_steps_lost_to_a_sigkill_are_a_lower_bound_and_say_so(tmp_path: Path) -> None:
    """Killed, an attempt says nothing after its last heartbeat: the steps it loses are
    counted to the step that heartbeat carried, at most the steps re-run, and marked as a
    lower bound; a finished attempt's figures stay exact."""
    with ckpt_server(tmp_path, env={"CKPT_LOST_AFTER_SECONDS": "2"}) as server:
        env = {**server.env(), "CKPT_RUN": "kill", "CKPT_HEARTBEAT_SECONDS": "0.1"}
        run_trainer(
            server.store,
            tmp_path / "killed.pt",
            *STEPS,
            *EVERY,
            "--run",
            "kill",
            "--pause-at",
            "14.1:1",  # a heartbeat or more while at step 14
            "--kill-at",
            "14.1",  # 14 steps done, the bundle at 8 the newest
            expect_rc=-9,
            env=env,
        )
        resumed = run_trainer(
            server.store, tmp_path / "resumed.pt", *STEPS, *EVERY, "--run", "kill", env=env
        )
        assert resumed["positions"][0][0] == 8
        rerun = 14 - 8  # the steps the killed attempt had trained past the bundle at 8
        with server.client() as client:
            deadline = time.monotonic() + 120
            while (attempts := client.get("/v1/runs/kill/lineage").json()["attempts"])[0][
                "end_reason"
            ] != "lost":  # the server marks it once its heartbeats lapse
                assert time.monotonic() < deadline, attempts
                time.sleep(0.1)
            run = client.get("/v1/runs/kill").json()
    killed, finished = attempts
    assert killed["steps_lost"] is not None and 0 <= killed["steps_lost"] <= rerun
    assert killed["steps_lost"] == rerun - (14 - killed["last_step"])  # to its last heartbeat
    assert killed["steps_lost_exact"] is False
    assert (finished["end_reason"], finished["steps_lost"]) == ("finished", None)
    assert finished["steps_lost_exact"] is None
    assert run["steps_lost_total"] == killed["steps_lost"]
    assert run["steps_lost_total_exact"] is False
    assert format_attempt(killed).endswith(f"steps lost: at least {killed['steps_lost']}")
