"""A new run started from another run's bundle (``CKPT_FROM_RUN`` / ``CKPT_FROM_STEP``, or
``resume(from_run=..., from_step=...)``), store-only and through the control plane."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt import Checkpointer
from tests.service.conftest import Server

Make = Callable[[str], "Job"]


@dataclass
class Job:
    ckpt: Checkpointer
    model: nn.Module
    optimizer: torch.optim.Optimizer


@pytest.fixture(params=["store-only", "control plane"])
def make(request: pytest.FixtureRequest, server: Server, tmp_path: Path) -> Make:
    """A checkpointer of a run, on a fresh model, store-only or through the server."""

    def build(run: str) -> Job:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        if request.param == "store-only":
            ckpt = Checkpointer(run=run, models=model, optimizers=optimizer, store=str(tmp_path))
        else:
            ckpt = Checkpointer(
                run=run,
                models=model,
                optimizers=optimizer,
                store=server.store,
                server=server.url,
                token=server.admin_token,
            )
        return Job(ckpt, model, optimizer)

    return build


def train_to(job: Job, step: int, *, save_every: int = 0) -> None:
    ckpt, model, optimizer = job.ckpt, job.model, job.optimizer
    while ckpt.counters.step < step:
        generator = torch.Generator().manual_seed(ckpt.counters.step)
        model(torch.randn(8, 4, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt.counters.step += 1
        if save_every and ckpt.counters.step % save_every == 0:
            ckpt.save().wait()


def weights(job: Job) -> list[torch.Tensor]:
    return [tensor.clone() for tensor in job.model.state_dict().values()]


def test_a_new_run_starts_from_a_step_of_another_and_then_continues_its_own(
    make: Make, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make(f"{run_name}-base")
    base.ckpt.resume()
    train_to(base, 6, save_every=2)
    at_six = weights(base)
    base.ckpt.close()
    monkeypatch.setenv("CKPT_FROM_RUN", f"{run_name}-base")
    monkeypatch.setenv("CKPT_FROM_STEP", "4")
    fork = make(run_name)
    assert fork.ckpt.resume().step == 4  # the fork point, not the base's latest (6)
    train_to(fork, 6)
    assert all(map(torch.equal, at_six, weights(fork)))  # the same steps as the base's
    fork.ckpt.save().wait()
    fork.ckpt.close()
    again = make(run_name)  # a restarted attempt of the new run: its own bundle, not step 4
    assert again.ckpt.resume().step == 6
    again.ckpt.close()


def test_a_step_that_has_no_bundle_is_refused(make: Make, run_name: str) -> None:
    base = make(f"{run_name}-base")
    base.ckpt.resume()
    train_to(base, 4, save_every=2)
    base.ckpt.close()
    fork = make(run_name).ckpt
    with pytest.raises(ValueError, match="no resumable bundle at step 3"):
        fork.resume(from_run=f"{run_name}-base", from_step=3)
    with pytest.raises(ValueError, match="from_step names a bundle of another run"):
        fork.resume(from_step=2)
    assert fork.resume(from_run=f"{run_name}-base", from_step=2).step == 2
    fork.close()


def test_from_step_needs_from_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CKPT_FROM_STEP", "4")
    with pytest.raises(ValueError, match="needs from_run"):
        Checkpointer(run="r", models=nn.Linear(1, 1), store=str(tmp_path))
