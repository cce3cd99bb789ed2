"""A cloud's notice of a coming preemption, end to end: a training loop with a real
``ckpt server`` process and a metadata server on 127.0.0.1 in each cloud's shapes. The
notice is read within one poll, the next step boundary saves (no SIGTERM needed), the
bundle commits, and the attempt shows the notice."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from ckpt import Checkpointer
from tests.metadata_server import metadata_server
from tests.server_process import ckpt_server

pytestmark = pytest.mark.slow


def _attempt(client: httpx.Client, run: str) -> dict[str, object]:
    attempts = client.get(f"/v1/runs/{run}/lineage").raise_for_status().json()["attempts"]
    assert len(attempts) == 1
    found: dict[str, object] = attempts[0]
    return found


@pytest.mark.parametrize(
    ("cloud", "kind", "shown"),
    [
        ("aws", "instance-action", "aws instance-action: terminate at 2026-12-01T03:30:00Z"),
        ("gcp", "preempted", "gcp preempted: instance/preempted is TRUE"),
        ("azure", "preempt", "azure preempt: 602d9444-d2cd-49c7-8624-8643e7171297 not before"),
    ],
)
def test_a_notice_saves_at_the_next_step_and_the_attempt_shows_it(
    tmp_path: Path, cloud: str, kind: str, shown: str
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        ckpt_server(tmp_path) as server,
        server.client() as client,
        metadata_server(cloud) as (metadata, url),
        Checkpointer(
            run="noticed",
            models=model,
            optimizers=optimizer,
            store=server.store,
            server=server.url,
            token=server.token,
            every_steps=10_000,  # only the notice saves
            notices=cloud,
            notice_poll_seconds=0.05,
            metadata_url=url,
            handle_signals=False,
            quiet=True,
        ) as ckpt,
    ):
        ckpt.resume()
        saved = None
        for step in range(1, 6):
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.counters.step = step
            if step == 3:
                metadata.announce(kind)
                # Wait for the state the watcher reaches: the attempt shows the notice.
                with metadata.lock:
                    metadata.lock.wait_for(lambda: metadata.first_notice_request is not None, 30)
                _wait_for_notice(client)
            pending = ckpt.maybe_save()
            if pending is not None:
                saved = (step, pending.wait())
                break
        assert saved is not None, "no save after the notice"
        assert saved[0] == 3  # the first step boundary after the notice was read
        assert client.get("/v1/runs/noticed/resumable").json()["step"] == 3
        attempt = _attempt(client, "noticed")
        assert str(attempt["notice"]).startswith(shown)
        assert attempt["notice_at"] is not None
        assert attempt["last_step"] is not None
        # Read within one poll: each poll asks at most two questions.
        assert metadata.announced_at_request is not None
        assert metadata.first_notice_request is not None
        assert metadata.first_notice_request <= metadata.announced_at_request + 2
        metrics = client.get("/metrics").text
        assert f'ckpt_preemption_notices_total{{cloud="{cloud}",kind="{kind}"}} 1.0' in metrics
        ckpt.end()


def _wait_for_notice(client: httpx.Client) -> None:
    deadline = time.monotonic() + 60
    while _attempt(client, "noticed")["notice_at"] is None:
        assert time.monotonic() < deadline, "the notice never reached the control plane"
        time.sleep(0.02)
