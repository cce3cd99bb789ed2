"""A Hugging Face Trainer checkpoint imported into a run, then trained by ckpt's integration,
against the Trainer's own resume from the same ``checkpoint-N/`` folder.

The Trainer writes the folder itself (a tiny GPT-2, no dropout, untied embeddings, walked
in order). Both resumes must then train the same steps: the next losses, the final
weights, the optimizer state and the scheduler equal (``torch.equal``). The folder holds
no data position: the import accepts the data layer as missing, and ckpt's integration
then skips the batches of ``global_step`` as the Trainer's own resume does.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from agent.catalog.manifests import latest_manifest
from agent.interop.importing import import_checkpoint
from ckpt.core.contract import Layer
from ckpt.core.errors import ImportSourceError
from ckpt.core.storage import open_store
from ckpt.integrations.huggingface import CheckpointCallback, CheckpointMixin
from tests.integration.hf_trainer import Tokens
from tests.integration.test_import_dicts import assert_optimizer_equal, assert_tensors_equal

pytestmark = [
    pytest.mark.slow,
    # The Trainer and accelerate warn about CPU-only runs and deprecated defaults.
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

MAX_STEPS, SAVED_AT = 8, 4


class Recording:
    """Records the loss of every micro-batch trained."""

    losses: list[torch.Tensor]

    def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]
        self.losses.append(loss.detach().clone())
        return loss


class PlainTrainer(Recording, Trainer):
    pass


class CkptTrainer(Recording, CheckpointMixin, Trainer):
    pass


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,  # tied weights are saved once: see docs/interop.md
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def arguments(output_dir: Path, *, save: bool) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=3,
        lr_scheduler_type="cosine",
        logging_steps=1,
        save_strategy="steps" if save else "no",
        save_steps=SAVED_AT,
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        seed=7,
        disable_tqdm=True,
    )


def train(trainer: Recording, **kwargs: Any) -> dict[str, Any]:
    trainer.losses = []
    assert isinstance(trainer, Trainer)
    trainer.train(**kwargs)
    assert trainer.optimizer is not None and trainer.lr_scheduler is not None
    return {
        "losses": torch.stack(trainer.losses),
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},  # type: ignore[union-attr]
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "step": trainer.state.global_step,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoint-4/`` as the Trainer writes it, in a run of 8 steps."""
    root = tmp_path_factory.mktemp("hf")
    trainer = PlainTrainer(
        model=tiny_model(), args=arguments(root, save=True), train_dataset=Tokens()
    )
    train(trainer)
    return root / f"checkpoint-{SAVED_AT}"


def assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["step"] == theirs["step"] == MAX_STEPS
    assert torch.equal(ours["losses"], theirs["losses"])
    assert_tensors_equal(ours["model"], theirs["model"])
    assert_optimizer_equal(ours["optimizer"], theirs["optimizer"])
    assert ours["scheduler"] == theirs["scheduler"]


def test_a_trainer_checkpoint_resumes_under_ckpt_as_under_the_trainer(
    checkpoint: Path, tmp_path: Path
) -> None:
    theirs = train(
        PlainTrainer(
            model=tiny_model(), args=arguments(tmp_path / "a", save=False), train_dataset=Tokens()
        ),
        resume_from_checkpoint=str(checkpoint),
    )
    store = str(tmp_path / "store")
    result = import_checkpoint(checkpoint, run="hf", store=store, accept_missing=["data"])
    assert (result.step, result.format, result.partial) == (SAVED_AT, "hf", True)
    assert list(result.missing) == [Layer.DATA]
    callback = CheckpointCallback(run="hf", store=store, every_steps=100, quiet=True)
    ours = train(
        CkptTrainer(
            model=tiny_model(),
            args=arguments(tmp_path / "b", save=False),
            train_dataset=Tokens(),
            callbacks=[callback],
        )
    )
    # Steps 5 to 8 of 4 micro-batches of 2, but step 6 ends the epoch with one of 1.
    assert len(theirs["losses"]) == 7
    assert_same(ours, theirs)


def test_a_missing_layer_is_named_and_nothing_is_committed(
    checkpoint: Path, tmp_path: Path
) -> None:
    store = str(tmp_path / "store")
    with pytest.raises(ImportSourceError, match="--accept-missing data") as refused:
        import_checkpoint(checkpoint, run="hf", store=store)
    assert "data: the Trainer saves no data position" in str(refused.value)
    assert latest_manifest(open_store(store), "hf") is None
    copy = tmp_path / "no-rng"
    shutil.copytree(checkpoint, copy)
    (copy / "rng_state.pth").unlink()
    with pytest.raises(ImportSourceError, match=r"rng: no rng_state\.pth"):
        import_checkpoint(copy, run="hf", store=store, accept_missing=["data"])
    assert latest_manifest(open_store(store), "hf") is None


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_a_damaged_file_is_refused_by_name(checkpoint: Path, tmp_path: Path, damaged: str) -> None:
    copy = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, copy)
    data = (copy / damaged).read_bytes()
    (copy / damaged).write_bytes(data[: len(data) // 2])
    store = str(tmp_path / "store")
    with pytest.raises(ImportSourceError, match=f"{damaged}: cannot be read"):
        import_checkpoint(copy, run="hf", store=store, accept_missing=["data"])
    assert latest_manifest(open_store(store), "hf") is None
