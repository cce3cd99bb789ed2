"""Continuous run vs. a run killed after a save and resumed in a new process.

The job (agent/demo/train.py) has dropout, batch norm, AdamW, warmup + cosine, gradient
accumulation 4, a GradScaler and a shuffled DataLoader with 2 workers whose samples draw
NumPy, Python and torch randomness.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.demo.compare import differences
from ckpt import Layer
from tests.conftest import RunTrainer, run_trainer

pytestmark = pytest.mark.slow

STEPS = ("--steps", "60", "--total-steps", "80")


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("reference")
    return {
        loader: run_trainer(root / loader, root / f"{loader}.pt", *STEPS, "--loader", loader)
        for loader in ("sampler", "stateful")
    }


@pytest.mark.parametrize(
    ("loader", "save_at"),
    [("sampler", "30"), ("sampler", "30.2"), ("stateful", "30"), ("stateful", "29.3")],
    ids=[
        "sampler-step-boundary",
        "sampler-mid-accumulation",
        "stateful-step-boundary",
        "stateful-mid-accumulation",
    ],
)
def test_killed_and_resumed_run_is_bit_exact(
    trainer: RunTrainer, references: dict[str, dict[str, Any]], loader: str, save_at: str
) -> None:
    trainer(*STEPS, "--loader", loader, "--save-at", save_at, "--kill-after-save", expect_rc=-9)
    resumed = trainer(*STEPS, "--loader", loader)
    assert resumed["positions"][0] == _position_after(save_at)
    assert differences(references[loader], resumed) == []


def _position_after(save_at: str) -> tuple[int, int]:
    step, _, micro = save_at.partition(".")
    return (int(step), int(micro or 0) + 1)


@pytest.mark.parametrize(
    "loader_args",
    [
        ("--loader", "sampler"),
        ("--loader", "sampler", "--persistent-workers"),
        ("--loader", "stateful"),
    ],
    ids=["sampler", "sampler-persistent-workers", "stateful"],
)
def test_a_save_after_an_epoch_ends_resumes_bit_exactly(
    trainer: RunTrainer, tmp_path: Path, loader_args: tuple[str, ...]
) -> None:
    # Saved after the loop over epoch 3 finished (counters: epoch 4, batch 0): the resumed
    # run's first iterator is the one the uninterrupted run created for epoch 4 - or, with
    # persistent workers, one it never created again.
    reference = trainer(*STEPS, *loader_args, store=tmp_path / "reference")
    trainer(*STEPS, *loader_args, "--save-at-epoch-end", "4", "--kill-after-save", expect_rc=-9)
    resumed = trainer(*STEPS, *loader_args)
    assert resumed["positions"][0] == (32, 1)
    assert differences(reference, resumed) == []


@pytest.mark.parametrize("loader", ["sampler", "stateful"])
def test_two_kills_in_a_chain_with_loop_re_entry_stay_bit_exact(
    trainer: RunTrainer, tmp_path: Path, loader: str
) -> None:
    # The loop leaves batches() after every save and re-enters it mid-epoch (as an eval
    # would); bundle 25 sits exactly on such a break.
    job = (*STEPS, "--loader", loader, "--every", "5", "--break-after-save")
    reference = trainer(*job, store=tmp_path / "reference")
    trainer(*job, "--kill-at", "12.1", expect_rc=-9)
    trainer(*job, "--kill-at", "27.2", expect_rc=-9)
    resumed = trainer(*job)
    assert resumed["positions"][0] == (25, 1)
    assert differences(reference, resumed) == []


@pytest.fixture(scope="module")
def mid_accumulation_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("killed")
    run_trainer(
        root / "store",
        root / "unused.pt",
        *STEPS,
        "--save-at",
        "30.2",
        "--kill-after-save",
        expect_rc=-9,
    )
    return root / "store"


def test_resuming_the_shared_bundle_with_every_layer_is_bit_exact(
    trainer: RunTrainer, references: dict[str, dict[str, Any]], mid_accumulation_store: Path
) -> None:
    # The positive twin of the negative controls below, from the very same bundle.
    assert differences(references["sampler"], trainer(*STEPS, store=mid_accumulation_store)) == []


@pytest.mark.parametrize("skipped", [str(layer) for layer in Layer])
def test_skipping_any_one_layer_breaks_bit_exactness(
    trainer: RunTrainer,
    references: dict[str, dict[str, Any]],
    mid_accumulation_store: Path,
    skipped: str,
) -> None:
    resumed = trainer(*STEPS, "--skip-layer", skipped, store=mid_accumulation_store)
    found = differences(references["sampler"], resumed)
    assert any(item.startswith("parameter/buffer") for item in found), found


def test_worker_randomness_without_per_sample_seeding_is_not_resumable(
    trainer: RunTrainer, tmp_path: Path
) -> None:
    # Why PerSampleRNG exists: DataLoader workers restart their random streams from the seed
    # after a resume, so without it the augmentation of the resumed epoch differs.
    reference = trainer(*STEPS, "--no-per-sample-rng", store=tmp_path / "reference")
    trainer(*STEPS, "--no-per-sample-rng", "--save-at", "30", "--kill-after-save", expect_rc=-9)
    resumed = trainer(*STEPS, "--no-per-sample-rng")
    assert "the per-micro-batch loss sequence differs" in differences(reference, resumed)


def test_periodic_saves_resume_from_the_latest(
    trainer: RunTrainer, references: dict[str, dict[str, Any]]
) -> None:
    trainer("--steps", "45", "--total-steps", "80", "--every", "20")
    resumed = trainer(*STEPS)
    assert resumed["positions"][0] == (40, 1)
    assert differences(references["sampler"], resumed) == []


@pytest.mark.parametrize(
    "settings",
    [{"CKPT_STAGING_BYTES": "0"}, {"CKPT_STAGING_BYTES": "40000"}],
    ids=["budget-0", "budget-40kB"],
)
def test_a_staging_budget_keeps_periodic_saves_bit_exact(
    trainer: RunTrainer, references: dict[str, dict[str, Any]], settings: dict[str, str]
) -> None:
    # Saves every 10 steps while the loop goes on: forward and backward run beside the
    # overlapped copies (on by default), the optimizer step waits for the rest and for the
    # tensors the persist reads in place (all of them at 0, some at 40 kB); then a save
    # mid-accumulation and a SIGKILL.
    every = ("--every", "10", "--save-at", "42.2", "--kill-after-save")
    trainer(*STEPS, *every, expect_rc=-9, env=settings)
    resumed = trainer(*STEPS, env=settings)
    assert resumed["positions"][0] == (42, 3)
    assert differences(references["sampler"], resumed) == []


def test_an_extra_attempt_after_the_run_finished_leaves_the_verdict_alone(tmp_path: Path) -> None:
    # ckpt demo on a loaded machine: a SIGTERM reached the finished last attempt on its way
    # out, and another attempt resumed at the end with nothing to train. The run is the
    # same run: its verdict must be too.
    store, out = tmp_path / "store", tmp_path / "final.pt"
    finished = run_trainer(store, out, *STEPS, "--every", "30")
    again = run_trainer(store, out, *STEPS, "--every", "30")
    assert differences(finished, again) == []
    assert again["positions"] == finished["positions"]
