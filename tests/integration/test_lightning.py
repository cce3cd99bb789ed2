"""Lightning's ``Trainer.fit`` with ckpt's callback, killed and resumed in a fresh process,
against a run that was never interrupted, bit for bit.

The job (tests/integration/lightning_trainer.py) trains a Linear-ReLU-Dropout-Linear module
with AdamW, a per-step cosine schedule and ``accumulate_grad_batches=2`` for 30 optimizer
steps: 6 epochs of 10 batches (5 steps). It kills or signals itself at a chosen position once
the bundle it aims at is durable, so nothing here waits on time.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ckpt.agent.demo.compare import differences
from ckpt.agent.signals import EXIT_PREEMPTED
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


def test_sigkill_mid_epoch_resumes_bit_exactly_without_replaying_batches(
    tmp_path: Path, reference: dict[str, Any], killed_mid_epoch: Path
) -> None:
    resumed = lightning(copy(killed_mid_epoch, tmp_path), tmp_path / "resumed.pt")
    assert resumed["positions"][0] == (12, 2, 4)  # (global step, epoch, batch index)
    assert_same_run(reference, resumed)
    # Each consumed batch loaded once: the 12 batches of epoch 2 before the kill are not.
    assert resumed["loaded"] == len(resumed["positions"]) * BATCH
    assert reference["loaded"] - resumed["loaded"] == (2 * 10 + 4) * BATCH


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


def test_sigkill_after_an_epochs_last_batch_resumes_with_the_next_epoch(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    # Saved every 5 steps, at the end of every epoch: the resumed run creates the next
    # epoch's iterator (the uninterrupted run had not) and runs its start hooks.
    store = tmp_path / "store"
    lightning(store, tmp_path / "a.pt", "--every", "5", "--kill-at", "15", expect_rc=-9)
    resumed = lightning(store, tmp_path / "resumed.pt", "--every", "5")
    assert resumed["positions"][0] == (15, 3, 0)
    assert_same_run(reference, resumed)


@pytest.mark.parametrize(
    "signal_at",
    ["17.1", "18.0"],
    ids=["next-boundary-completes-a-step", "next-boundary-mid-accumulation"],
)
def test_sigterm_saves_exits_143_and_resumes_bit_exactly(
    tmp_path: Path, reference: dict[str, Any], signal_at: str
) -> None:
    # The job signals itself at a batch end; ckpt saves at a later one (the next, unless its
    # watcher thread is slower than a batch), whether a step completed there or it sits
    # mid-accumulation with gradients to restore.
    store = tmp_path / "store"
    lightning(store, tmp_path / "a.pt", "--term-at", signal_at, expect_rc=EXIT_PREEMPTED)
    resumed = lightning(store, tmp_path / "resumed.pt")
    step, micro = (int(part) for part in signal_at.split("."))
    first_step, _, first_batch = resumed["positions"][0]
    assert first_step * 2 + first_batch % 2 > step * 2 + micro  # saved after the signal
    assert_same_run(reference, resumed)
