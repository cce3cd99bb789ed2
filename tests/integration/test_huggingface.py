"""A Hugging Face Trainer run killed (SIGKILL, SIGTERM) and resumed in a fresh process, bit
for bit against a run that was never interrupted.

The job (tests/integration/hf_trainer.py) trains a tiny GPT-2 with dropout through the real
Trainer and accelerate: gradient accumulation 2, 6 optimizer steps an epoch (the last of one
micro-batch), 15 steps in all, a bundle every 3 steps. It records every micro-batch's loss
and which samples its process fetched. The SIGKILL test evaluates at the start and every 4
steps; the SIGTERM test runs a data-loader worker over a dataset that draws random numbers,
wrapped in ``PerSampleRNG``.
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
from agent.restore.download import read_layer
from ckpt.core.contract import Layer, Manifest
from ckpt.core.storage import DirectoryStore
from tests.conftest import run_trainer
from tests.integration.test_preemption import bundle_steps

pytestmark = pytest.mark.slow

JOB = "tests.integration.hf_trainer"
SAMPLES_PER_STEP = 8  # 2 micro-batches of 4
SAMPLES_PER_EPOCH = 44
EVALUATES = ("--evaluate",)
WORKER_AUGMENTS = ("--workers", "1", "--augment", "--per-sample-rng")


def train(store: Path, out: Path, *args: str, expect_rc: int = 0) -> dict[str, Any]:
    return run_trainer(store, out, *args, expect_rc=expect_rc, module=JOB)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reference")
    return train(root / "store", root / "reference.pt", *EVALUATES)


@pytest.fixture(scope="module")
def augmented_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the augmented reference run keeps its bundles (every 3 steps)."""
    return tmp_path_factory.mktemp("augmented") / "store"


@pytest.fixture(scope="module")
def augmented_reference(augmented_store: Path) -> dict[str, Any]:
    return train(augmented_store, augmented_store.parent / "reference.pt", *WORKER_AUGMENTS)


@pytest.fixture(scope="module")
def killed_at_step_9(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store whose last bundle is step 9: epoch 1, 3 of its 6 steps done."""
    store = tmp_path_factory.mktemp("killed") / "store"
    train(store, store.parent / "unused.pt", *EVALUATES, "--kill-at", "9", expect_rc=-9)
    assert bundle_steps(store, run="hf") == [3, 6, 9]
    return store


def resume(store: Path, tmp_path: Path, *args: str) -> dict[str, Any]:
    """Resume a copy of ``store`` (each test's resume saves bundles of its own)."""
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    return train(copy, tmp_path / "resumed.pt", *args)


def logged(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The Trainer's per-step log (loss, grad norm, learning rate, epoch, step)."""
    return [entry for entry in run["log"] if "loss" in entry]


def evaluated(run: dict[str, Any]) -> dict[int, float]:
    """The evaluation loss by step."""
    return {entry["step"]: entry["eval_loss"] for entry in run["log"] if "eval_loss" in entry}


def assert_bit_exact(reference: dict[str, Any], resumed: dict[str, Any]) -> None:
    assert differences(reference, resumed) == []
    assert logged(resumed) == logged(reference)
    assert resumed["train_loss"] == reference["train_loss"]
    assert (resumed["global_step"], resumed["epoch"]) == (15, reference["epoch"])


def test_a_run_killed_mid_epoch_resumes_bit_exactly_without_loading_what_it_had_trained(
    reference: dict[str, Any], killed_at_step_9: Path, tmp_path: Path
) -> None:
    resumed = resume(killed_at_step_9, tmp_path, *EVALUATES)
    assert resumed["positions"][0] == (9, 0)  # the first micro-batch of step 10
    assert_bit_exact(reference, resumed)
    # eval_on_start evaluates once more at the resume (at step 9), and draws nothing.
    assert evaluated(resumed).keys() - evaluated(reference).keys() == {9}
    assert evaluated(reference).items() <= evaluated(resumed).items()
    # No batch skipping by loading: the resumed process fetched exactly the samples after
    # the bundle's (epoch 0, then 3 steps of epoch 1), and in the same order.
    consumed = SAMPLES_PER_EPOCH + 3 * SAMPLES_PER_STEP
    assert resumed["fetched"] == reference["fetched"][consumed:]


def bundle_at(store: Path, step: int) -> Manifest:
    for path in (store / "runs" / "hf").rglob("manifest.json"):
        manifest = Manifest.model_validate_json(path.read_text())
        if manifest.position == (step, 0):
            return manifest
    raise AssertionError(f"no bundle at step {step} in {store}")


def trained_alike(store: Path, reference: Path, step: int) -> list[str]:
    """How the weights and optimizer of two runs' bundles at ``step`` differ (none: []):
    the skeleton, or each tensor that differs and by how much (a last-bit difference is
    arithmetic that differs between processes, a large one a different draw or batch)."""
    found: list[str] = []
    ours, theirs = bundle_at(store, step), bundle_at(reference, step)
    for layer in (Layer.WEIGHTS, Layer.OPTIMIZER):
        ours_blobs = [blob.sha256 for blob in ours.ranks[0].layers[layer].blobs]
        if ours_blobs == [blob.sha256 for blob in theirs.ranks[0].layers[layer].blobs]:
            continue
        skeleton, tensors = read_layer(DirectoryStore(store), ours, rank=0, layer=layer)
        expected, wanted = read_layer(DirectoryStore(reference), theirs, rank=0, layer=layer)
        found += [f"step {step} {layer} {gap}" for gap in _differing(skeleton, expected)]
        for name, tensor in tensors.items():
            if not torch.equal(tensor, wanted[name]):
                gap = (tensor.double() - wanted[name].double()).abs().max().item()
                found.append(f"step {step} {layer} {name}: max |difference| {gap:.3g}")
    return found


def _differing(ours: Any, theirs: Any, path: str = "skeleton") -> list[str]:
    """Where two skeletons differ: each differing leaf, as ``path: ours != theirs``."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [
            gap
            for key in sorted(ours.keys() | theirs.keys())
            for gap in _differing(ours.get(key), theirs.get(key), f"{path}.{key}")
        ]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [
            gap
            for i, pair in enumerate(zip(ours, theirs, strict=True))
            for gap in _differing(*pair, f"{path}[{i}]")
        ]
    return [] if ours == theirs else [f"{path}: {ours!r} != {theirs!r}"]


def test_sigterm_saves_at_the_next_step_exits_and_the_resume_is_bit_exact(
    augmented_reference: dict[str, Any], augmented_store: Path, tmp_path: Path
) -> None:
    store = tmp_path / "first"
    signal = ("--signal-at", "10")
    train(store, tmp_path / "unused.pt", *WORKER_AUGMENTS, *signal, expect_rc=EXIT_PREEMPTED)
    # Step 11 is the last of epoch 1, of one micro-batch.
    assert bundle_steps(store, run="hf") == [3, 6, 9, 11]
    # Up to the signal both runs trained alike (else the resume below has no chance: the
    # training itself, not ckpt, differs between processes).
    found = [gap for step in (3, 6, 9) for gap in trained_alike(store, augmented_store, step)]
    assert found == [], "\n".join(found[:20])
    resumed = resume(store, tmp_path, *WORKER_AUGMENTS)
    assert resumed["positions"][0] == (11, 0)
    assert_bit_exact(augmented_reference, resumed)


def test_a_resume_without_the_rng_layer_is_not_bit_exact(
    reference: dict[str, Any], killed_at_step_9: Path, tmp_path: Path
) -> None:
    # The negative control of the first test, from the same bundle: dropout then draws
    # other masks, so the comparison above can fail.
    resumed = resume(killed_at_step_9, tmp_path, *EVALUATES, "--skip-layer", "rng")
    assert resumed["positions"][0] == (9, 0)
    found = differences(reference, resumed)
    assert "the per-micro-batch loss sequence differs" in found, found
    assert any(item.startswith("parameter/buffer") for item in found), found


def test_the_callback_and_the_mixin_refuse_to_train_without_each_other(tmp_path: Path) -> None:
    # In this process (imported here: collecting the suite loads no transformers).
    from transformers import Trainer, TrainerCallback

    from ckpt.integrations.huggingface import CheckpointCallback, CheckpointTrainer
    from tests.integration.hf_trainer import Tokens, tiny_model, training_arguments

    def trainer(kind: type[Trainer], callbacks: list[TrainerCallback]) -> Trainer:
        return kind(
            model=tiny_model(),
            args=training_arguments(str(tmp_path), max_steps=1),
            train_dataset=Tokens(),
            callbacks=callbacks,
        )

    callback = CheckpointCallback(run="hf", store=str(tmp_path / "store"))
    with pytest.raises(ValueError, match="needs a Trainer with CheckpointMixin"):
        trainer(Trainer, [callback]).train()
    with pytest.raises(ValueError, match="needs a CheckpointCallback"):
        trainer(CheckpointTrainer, []).train()
    with pytest.raises(ValueError, match="without resume_from_checkpoint"):
        trainer(CheckpointTrainer, [callback]).train(resume_from_checkpoint=True)
    skipping = trainer(CheckpointTrainer, [callback])
    skipping.args.ignore_data_skip = True
    with pytest.raises(ValueError, match="ignore_data_skip=True would start"):
        skipping.train()
    with pytest.raises(ValueError, match="takes the training objects from the Trainer"):
        CheckpointCallback(run="hf", optimizers=[])


def test_a_resume_proves_the_steps_it_replays_without_user_code(tmp_path: Path) -> None:
    # Killed after step 10, one step past the bundle of step 9: the resume replays step 10
    # and compares it (the loss the callback reported, the parameters) with the dead one's.
    store = tmp_path / "store"
    train(store, tmp_path / "unused.pt", "--kill-at", "10", expect_rc=-9)
    resumed = train(store, tmp_path / "resumed.pt")
    verification = json.loads(resumed["verification"])
    assert (verification["verdict"], verification["steps_compared"]) == ("verified", 1)
