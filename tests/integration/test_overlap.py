"""Overlapped staging and the staging budget: what a save holds when training runs on
before its copies are made, and what the next optimizer step waits for.

The persist thread is held at a gate (a task queued ahead of the save's persist), so the
order of "training steps" and "the save copies" is fixed by the test, not by the machine's
speed. The bit-exact resume matrix with both settings is in ``test_bit_exact.py``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt import Checkpointer, StateChangedError

RUN = "overlap"
TIMEOUT = 30.0  # bounds every wait; never reached when all is well


class Job:
    """A tiny model with batch norm and AdamW, one optimizer step in."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.first, self.norm = nn.Linear(32, 64), nn.BatchNorm1d(64)
        self.model = nn.Sequential(self.first, self.norm, nn.Linear(64, 8))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.step()

    def backward(self) -> None:
        self.model(torch.randn(16, 32)).square().mean().backward()

    def step(self) -> None:
        self.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, torch.Tensor]:
        found = {f"model/{k}": v.clone() for k, v in self.model.state_dict().items()}
        for index, state in self.optimizer.state_dict()["state"].items():
            found.update({f"optim/{index}/{k}": v.clone() for k, v in state.items()})
        return found


def checkpointer(store: Path, job: Job, **settings: object) -> Checkpointer:
    return Checkpointer(
        run=RUN,
        store=str(store),
        models=job.model,
        optimizers=job.optimizer,
        handle_signals=False,
        quiet=True,
        **settings,  # type: ignore[arg-type]
    )


def restored(store: Path) -> dict[str, torch.Tensor]:
    """The state of the run's latest bundle, resumed into fresh objects."""
    job = Job(seed=1)
    with checkpointer(store, job) as ckpt:
        assert ckpt.resume().resumed
    return job.state()


def assert_same(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(found[k], expected[k])] == []


@contextmanager
def persist_held(ckpt: Checkpointer) -> Iterator[threading.Event]:
    """Hold the persist thread until the returned event is set (or the block ends)."""
    gate = threading.Event()
    ckpt._persister._thread.submit(gate.wait, TIMEOUT)
    try:
        yield gate
    finally:
        gate.set()


def test_a_step_before_the_background_copy_waits_and_the_bundle_holds_the_state_at_save(
    tmp_path: Path,
) -> None:
    job = Job()
    with checkpointer(tmp_path, job) as ckpt:
        with persist_held(ckpt):
            expected = job.state()
            pending = ckpt.save()
            job.backward()  # forward and backward run while nothing is copied yet
            job.optimizer.step()  # the pre-hook copies what the persist has not
            assert not torch.equal(job.state()["model/0.weight"], expected["model/0.weight"])
        result = pending.wait(TIMEOUT)
    assert result.copied_bytes > 0
    assert_same(restored(tmp_path), expected)


def test_without_the_step_hook_the_step_tears_the_copy_and_the_save_fails(tmp_path: Path) -> None:
    # The negative control: the hook is what keeps the step off the tensors being copied;
    # without it the version counters catch the step, and the save is refused, not kept torn.
    job = Job()
    with checkpointer(tmp_path, job) as ckpt:
        for hook in ckpt._step_hooks:
            hook.remove()
        with persist_held(ckpt):
            pending = ckpt.save()
            job.step()
        with pytest.raises(StateChangedError, match=r"weights/models/0/0\.weight"):
            pending.wait(TIMEOUT)
    with checkpointer(tmp_path, Job(seed=1)) as fresh:
        assert not fresh.resume().resumed


def test_buffers_are_copied_at_save_since_forward_changes_them(tmp_path: Path) -> None:
    job = Job()
    with checkpointer(tmp_path, job) as ckpt:
        with persist_held(ckpt):
            expected = job.state()
            pending = ckpt.save()
            job.backward()  # batch norm's running statistics move in the forward pass
            moved = job.state()["model/1.running_mean"]
            assert not torch.equal(moved, expected["model/1.running_mean"])
        pending.wait(TIMEOUT)
    assert_same(restored(tmp_path), expected)


def test_an_in_place_write_before_the_step_fails_that_save_and_not_the_training(
    tmp_path: Path,
) -> None:
    job = Job()
    with checkpointer(tmp_path, job) as ckpt:
        with persist_held(ckpt):
            pending = ckpt.save()
            with torch.no_grad():
                job.first.weight.mul_(0.5)  # outside the optimizer's step
        with pytest.raises(StateChangedError, match=r"0\.weight.*overlap=False"):
            pending.wait(TIMEOUT)
        job.step()  # the failed save holds nothing up
        ckpt.counters.step = 2
        expected = job.state()
        ckpt.save().wait(TIMEOUT)  # the next save copies everything again
    assert_same(restored(tmp_path), expected)


def test_without_overlap_everything_is_copied_at_save(tmp_path: Path) -> None:
    job = Job()
    with checkpointer(tmp_path, job, overlap=False) as ckpt:
        with persist_held(ckpt):
            expected = job.state()
            pending = ckpt.save()
            with torch.no_grad():
                job.first.weight.mul_(0.5)  # harmless: the copy was made
        pending.wait(TIMEOUT)
    assert_same(restored(tmp_path), expected)


@pytest.mark.parametrize("budget", [0, 20_000])
def test_over_the_staging_budget_tensors_are_read_in_place_and_the_step_waits(
    tmp_path: Path, budget: int, caplog: pytest.LogCaptureFixture
) -> None:
    job = Job()
    total = sum(t.nbytes for t in job.state().values())
    with checkpointer(tmp_path, job, staging_bytes=budget) as ckpt:
        with persist_held(ckpt) as gate, caplog.at_level(logging.WARNING, "ckpt"):
            expected = job.state()
            pending = ckpt.save()
            job.backward()
            stepping = threading.Thread(target=job.optimizer.step)
            stepping.start()
            stepping.join(0.5)
            assert stepping.is_alive()  # waits for the persist to write the held tensors
            gate.set()
            stepping.join(TIMEOUT)
            assert not stepping.is_alive()
        result = pending.wait(TIMEOUT)
        staged = ckpt._staging
        # At save, within the budget or not: the RNG states and batch norm's buffers (8 KB).
        assert staged.nbytes <= max(budget, 10_000)
        assert result.step_wait_seconds > 0
        assert result.copied_bytes < total
    assert ("over the staging budget" in caplog.text) == (budget == 0)
    assert_same(restored(tmp_path), expected)


def test_release_staging_frees_the_buffers_and_the_next_save_works(tmp_path: Path) -> None:
    job = Job()
    with checkpointer(tmp_path, job) as ckpt:
        ckpt.save()
        freed = ckpt.release_staging()
        assert freed >= sum(t.nbytes for t in job.state().values()) - 64
        assert ckpt._staging.nbytes == 0
        job.step()
        ckpt.counters.step = 2
        expected = job.state()
        ckpt.save().wait(TIMEOUT)
    assert_same(restored(tmp_path), expected)


def test_configuration_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.config import Config

    monkeypatch.setenv("CKPT_OVERLAP", "0")
    monkeypatch.setenv("CKPT_STAGING_BYTES", "1048576")
    config = Config.resolve({"run": RUN})
    assert (config.overlap, config.staging_bytes) == (False, 1 << 20)
    assert Config.resolve({"run": RUN}, env={}).overlap is True
    with pytest.raises(ValueError, match="CKPT_STAGING_BYTES='lots' is not a number"):
        Config.resolve({"run": RUN}, env={"CKPT_STAGING_BYTES": "lots"})
    with pytest.raises(ValueError, match="staging_bytes must be 0 or more"):
        Config.resolve({"run": RUN, "staging_bytes": -1})
