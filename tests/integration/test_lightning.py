"""Lightning's ``Trainer.fit`` with ckpt's callback, killed and resumed in a fresh process,
against a run that was never interrupted, bit for bit.

The job (tests/integration/lightning_trainer.py) trains a Linear-ReLU-Dropout-Linear module
with AdamW, a per-step cosine schedule and ``accumulate_grad_batches=2`` for 20 optimizer
steps: 4 epochs of 10 batches (5 steps each). It kills or signals itself at a chosen position once
the bundle it aims at is durable, so nothing here waits on time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.attempt.signals import EXIT_PREEMPTED
from agent.demo.compare import differences
from tests.conftest import run_trainer

pytestmark = pytest.mark.slow

JOB = "tests.integration.lightning_trainer"
BATCH = 4  # samples per batch (lightning_trainer.CONFIG)
COUNTERS = ("global_step", "current_epoch", "batch_progress", "epoch_progress", "optimizer_steps")


def lightning(store: Path, out: Path, *args: str, expect_rc: int = 0) -> dict[str, Any]:
    return run_trainer(store, out, *args, expect_rc=expect_rc, module=JOB)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reference")
    return lightning(root / "store", root / "reference.pt")


@pytest.fixture(scope="module")
def stateful_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("stateful-reference")
    return lightning(root / "store", root / "reference.pt", "--loader", "stateful")


@pytest.fixture(scope="module")
def killed_mid_epoch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store whose latest bundle is step 12 (epoch 2, batch 4 of 10), its job SIGKILLed."""
    root = tmp_path_factory.mktemp("killed")
    lightning(root / "store", root / "unused.pt", "--kill-at", "12", expect_rc=-9)
    return root / "store"


def copy(store: Path, tmp_path: Path) -> Path:
    """A private copy of a shared store: a resumed run adds bundles to it."""
    return Path(shutil.copytree(store, tmp_path / "store"))


def assert_same_run(reference: dict[str, Any], resumed: dict[str, Any]) -> None:
    """Parameters, every optimizer tensor, the learning rates and the loss of every
    micro-batch after the resume equal the reference's; so do the loop's counters."""
    assert differences(reference, resumed) == []
    assert {name: resumed[name] for name in COUNTERS} == {
        name: reference[name] for name in COUNTERS
    }


def test_sigkill_mid_epoch_then_after_an_epochs_last_batch_resumes_bit_exactly(
    tmp_path: Path, reference: dict[str, Any], killed_mid_epoch: Path
) -> None:
    # Resumed from step 12 (mid-epoch) and saving every 5 steps, the job is killed again
    # right after epoch 2's last batch (step 15): the third process starts epoch 3, whose
    # iterator the uninterrupted run had not created at that save.
    store = copy(killed_mid_epoch, tmp_path)
    every = ("--every", "5")
    lightning(store, tmp_path / "a.pt", *every, "--kill-at", "15", expect_rc=-9)
    middle: dict[str, Any] = torch.load(tmp_path / "a.pt", weights_only=True)
    resumed = lightning(store, tmp_path / "resumed.pt", *every)
    assert middle["positions"][0] == (12, 2, 4)  # (global step, epoch, batch index)
    assert resumed["positions"][0] == (15, 3, 0)
    assert_same_run(reference, resumed)
    # Every consumed batch was loaded once: none of those before a kill again.
    for run in (middle, resumed):
        assert run["loaded"] == len(run["positions"]) * BATCH
    assert reference["loaded"] - resumed["loaded"] == 15 * 2 * BATCH


def test_resuming_without_the_rng_layer_differs(
    tmp_path: Path, reference: dict[str, Any], killed_mid_epoch: Path
) -> None:
    # The negative control of the test above, from the very same bundle: reseeding the
    # global generator after the resume changes the dropout masks.
    store = copy(killed_mid_epoch, tmp_path)
    resumed = lightning(store, tmp_path / "resumed.pt", "--scramble-rng")
    found = differences(reference, resumed)
    assert "the per-micro-batch loss sequence differs" in found, found
    assert any(item.startswith("parameter/buffer") for item in found), found


def test_a_stateful_dataloader_killed_twice_in_a_chain_resumes_bit_exactly(
    tmp_path: Path, stateful_reference: dict[str, Any]
) -> None:
    # torchdata's StatefulDataLoader (one worker) keeps its own position: killed mid-epoch
    # at step 12, then, resumed and saving every 5 steps, right after epoch 2's last batch
    # at step 15, where the loader's state still holds the epoch it finished.
    store, job = tmp_path / "store", ("--loader", "stateful")
    lightning(store, tmp_path / "a.pt", *job, "--kill-at", "12", expect_rc=-9)
    lightning(store, tmp_path / "b.pt", *job, "--every", "5", "--kill-at", "15", expect_rc=-9)
    resumed = lightning(store, tmp_path / "resumed.pt", *job)
    assert resumed["positions"][0] == (15, 3, 0)
    assert_same_run(stateful_reference, resumed)


def test_sigterm_saves_exits_143_and_resumes_bit_exactly(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    # The job signals itself at the batch end of step 18 (after 4 periodic saves measured
    # what a save costs) and waits until ckpt's watcher notes it; ckpt saves at the next
    # batch end, mid-accumulation, with the gradients to restore, and exits 143
    # (Lightning's own handler would stop the loop first and exit 0).
    store = tmp_path / "store"
    lightning(store, tmp_path / "a.pt", "--term-at", "18.0", expect_rc=EXIT_PREEMPTED)
    resumed = lightning(store, tmp_path / "resumed.pt")
    step, _, batch = resumed["positions"][0]
    assert (step, batch % 2) > (18, 0)  # saved after the signal
    assert_same_run(reference, resumed)


def test_a_resume_proves_the_steps_it_replays_without_user_code(tmp_path: Path) -> None:
    # Saving every 5 steps and killed at step 12: the resume from step 10 replays the
    # micro-batches up to step 12 and compares each (loss, parameters) with the dead one's.
    every = ("--every", "5")
    lightning(tmp_path / "store", tmp_path / "unused.pt", *every, "--kill-at", "12", expect_rc=-9)
    resumed = lightning(tmp_path / "store", tmp_path / "resumed.pt", *every)
    verification = json.loads(resumed["verification"])
    assert verification["verdict"] == "verified", verification
    assert verification["steps_compared"] == 4  # 10.1, 11.0, 11.1, 12.0
