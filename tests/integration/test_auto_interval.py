"""``every="auto"`` end to end against a real ``ckpt server`` process: the agent saves once
early to measure a save, sizes its interval by the control plane's estimate of the time
between preemptions (with ``CKPT_MTBF_PRIOR_SECONDS`` set on the server), and its
heartbeats show the interval and the expected waste on the attempt, with where the
attempt's time went (goodput)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt import Checkpointer
from ckpt.core.interval import waste_per_hour
from tests.server_process import ckpt_server

pytestmark = pytest.mark.slow

PRIOR = 7200.0


def test_auto_sizes_the_interval_by_the_servers_estimate_and_reports_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    env = {"CKPT_MTBF_PRIOR_SECONDS": str(PRIOR), "CKPT_POOL": "test/pool-a"}
    with (
        ckpt_server(tmp_path, env=env) as server,
        server.client() as client,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setenv("CKPT_POOL", "test/pool-a")
        with Checkpointer(
            run="auto",
            models=model,
            optimizers=optimizer,
            store=server.store,
            server=server.url,
            token=server.token,
            every="auto",
            auto_min_seconds=0.05,  # the first save, to measure one
            auto_max_seconds=3600,
            heartbeat_seconds=0.1,
            handle_signals=False,
            quiet=True,
        ) as ckpt:
            ckpt.resume()
            saved = None
            step = 0
            while saved is None:  # until the first auto save (due 0.05 s after the resume)
                step += 1
                model(torch.randn(8, 4)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                ckpt.counters.step = step
                saved = ckpt.maybe_save()
            saved.wait()
            auto = ckpt._schedule.auto
            assert auto is not None and auto.cost_seconds is not None
            # The server's estimate: no history yet, so its prior.
            assert auto.mtbf_seconds == pytest.approx(PRIOR, rel=0.01)
            expected = min(max(math.sqrt(2 * auto.cost_seconds * auto.mtbf_seconds), 0.05), 3600)
            assert auto.seconds == pytest.approx(expected)
            # The next save is not due until that interval has passed.
            ckpt.counters.step = step + 1
            if auto.seconds > 1:
                assert ckpt.maybe_save() is None
            # The heartbeats carry the interval to the attempt.
            deadline = time.monotonic() + 60
            while True:
                attempt = client.get("/v1/runs/auto/lineage").json()["attempts"][-1]
                if attempt["interval_seconds"] is not None:
                    break
                assert time.monotonic() < deadline, "no heartbeat carried the interval"
                time.sleep(0.05)
            assert attempt["pool"] == "test/pool-a"
            assert attempt["interval_seconds"] == pytest.approx(auto.seconds)
            assert attempt["waste_seconds_per_hour"] == pytest.approx(
                waste_per_hour(
                    interval_seconds=auto.seconds,
                    cost_seconds=auto.cost_seconds,
                    mtbf_seconds=auto.mtbf_seconds,
                )
            )
            # And where the attempt's time went, with the same heartbeats.
            spent = attempt["time"]
            assert spent["restart_seconds"] > 0  # this process's start to its resume
            assert spent["stall_seconds"] > 0  # the auto save
            assert spent["train_seconds"] > 0
            assert 0 < spent["goodput"] < 1
            ckpt.end()
        rate = client.get("/v1/runs/auto/preemption-rate").json()
        assert rate["pool"]["name"] == "test/pool-a"
        goodput = client.get("/v1/runs/auto/goodput").json()
        assert goodput["attempts"] == 1
        assert goodput["time"]["redo_seconds"] == 0  # it finished: nothing lost
        assert goodput["time"]["train_seconds"] >= spent["train_seconds"]  # the end reported too
