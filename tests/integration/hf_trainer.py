"""A Hugging Face Trainer job for the bit-exactness tests of ckpt.integrations.huggingface.

A tiny GPT-2 built from a config (dropout on, no download) learns random token sequences
with AdamW, warmup + cosine and gradient accumulation 2 over 44 samples: 11 batches of 4,
so each epoch ends on a step of one micro-batch. It records every micro-batch's loss and
position, the Trainer's log, and which samples this process fetched, then writes them
with the final state to ``--out`` in the form ``agent.demo.compare.differences`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from agent.checkpointer import Checkpointer
from ckpt import Layer, PerSampleRNG, ResumeResult
from ckpt.integrations.huggingface import CheckpointCallback, CheckpointMixin

NUM_SAMPLES, LENGTH, VOCAB = 44, 16, 64


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, fixed by a seed; remembers which indices it served."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(0, VOCAB, (NUM_SAMPLES, LENGTH), generator=generator)
        self.fetched: list[int] = []
        self.augment = False

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.fetched.append(int(index))
        tokens = self.tokens[index]
        if self.augment:  # replace a random token: randomness in the data pipeline
            tokens = tokens.clone()
            tokens[torch.randint(0, LENGTH, ())] = torch.randint(0, VOCAB, ())
        return {"input_ids": tokens, "labels": tokens}


class RecordingTrainer(CheckpointMixin, Trainer):
    """Records the loss, position and learning rate of every micro-batch it trains."""

    records: list[tuple[int, int, float, float]]

    def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if not model.training:  # an evaluation
            return loss
        assert isinstance(loss, torch.Tensor) and self.optimizer is not None
        step = self.state.global_step
        micro = sum(1 for record in self.records if record[0] == step)
        lr = self.optimizer.param_groups[0]["lr"]
        self.records.append((step, micro, float(loss.detach()), lr))
        return loss


class Layers(CheckpointCallback):
    """A resume of only some layers (the negative controls)."""

    def __init__(self, *, layers: list[Layer], **config: Any) -> None:
        super().__init__(**config)
        self.layers = layers

    def _resume(self, checkpointer: Checkpointer) -> ResumeResult:
        return checkpointer.resume(layers=self.layers)


class Drills(TrainerCallback):
    """SIGKILL once the bundle of a step is durable, or SIGTERM after a step."""

    def __init__(self, ckpt: CheckpointCallback, args: argparse.Namespace) -> None:
        self.ckpt, self.args = ckpt, args
        self.verification: str | None = None  # the resume's verdict, as JSON, once known

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        # Step ``global_step`` is over here: logged, evaluated and (maybe) saved.
        checkpointer = self.ckpt.checkpointer
        assert checkpointer is not None
        if checkpointer.verification is not None:
            self.verification = json.dumps(checkpointer.verification.to_json())
        if state.global_step == self.args.kill_at:
            checkpointer.wait()
            print(f"killed after step {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if state.global_step == self.args.signal_at:
            print(f"SIGTERM after step {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            while not checkpointer.stopping:  # the watcher thread notes it
                time.sleep(0.001)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--store", required=True)
    add("--out", required=True, help="where to write the final state and the records")
    add("--max-steps", type=int, default=15)
    add("--every", type=int, default=3, help="save every N optimizer steps")
    add("--kill-at", type=int, help="STEP: SIGKILL itself once that step's bundle is durable")
    add("--signal-at", type=int, help="STEP: SIGTERM itself after that step")
    add("--skip-layer", action="append", default=[], help="resume without this layer")
    add("--workers", type=int, default=0, help="data-loader workers")
    add("--augment", action="store_true", help="the dataset draws random numbers")
    add("--per-sample-rng", action="store_true", help="wrap the dataset in PerSampleRNG")
    add("--evaluate", action="store_true", help="evaluate at the start and every 4 steps")
    return parser.parse_args(argv)


def tiny_model() -> GPT2LMHeadModel:
    """A 2-layer GPT-2 with dropout, the same weights in every process."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def training_arguments(
    output_dir: str, *, max_steps: int, workers: int = 0, evaluate: bool = False
) -> TrainingArguments:
    evaluation: dict[str, Any] = (
        {"eval_strategy": "steps", "eval_steps": 4, "eval_on_start": True} if evaluate else {}
    )
    return TrainingArguments(
        **evaluation,
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=3,
        lr_scheduler_type="cosine",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=7,
        dataloader_num_workers=workers,
        disable_tqdm=True,
    )


def build(args: argparse.Namespace, output_dir: str) -> RecordingTrainer:
    settings = {"run": "hf", "store": args.store, "every_steps": args.every, "quiet": True}
    if args.skip_layer:
        layers = [layer for layer in Layer if layer not in args.skip_layer]
        ckpt: CheckpointCallback = Layers(layers=layers, **settings)
    else:
        ckpt = CheckpointCallback(**settings)
    dataset = Tokens()
    dataset.augment = args.augment
    trainer = RecordingTrainer(
        model=tiny_model(),
        args=training_arguments(
            output_dir, max_steps=args.max_steps, workers=args.workers, evaluate=args.evaluate
        ),
        eval_dataset=Tokens() if args.evaluate else None,
        train_dataset=PerSampleRNG(dataset) if args.per_sample_rng else dataset,
        callbacks=[ckpt],
    )
    trainer.records = []
    trainer.add_callback(Drills(ckpt, args))
    return trainer


def final_state(trainer: RecordingTrainer, train_loss: float) -> dict[str, Any]:
    """What two runs must agree on, readable by ``torch.load(weights_only=True)``."""
    assert trainer.optimizer is not None and trainer.model is not None
    optimizer = trainer.optimizer.state_dict()
    records = trainer.records
    dataset = trainer.train_dataset
    if isinstance(dataset, PerSampleRNG):
        dataset = dataset.dataset
    assert isinstance(dataset, Tokens)
    return {
        "model": {name: t.clone() for name, t in trainer.model.state_dict().items()},
        "optimizer": {
            f"{index}/{key}": value.clone()
            for index, state in optimizer["state"].items()
            for key, value in state.items()
        },
        "lr": [group["lr"] for group in optimizer["param_groups"]],
        "scaler": {},
        "positions": [(step, micro) for step, micro, _, _ in records],
        "losses": torch.tensor([loss for _, _, loss, _ in records], dtype=torch.float64),
        "record_lrs": [lr for _, _, _, lr in records],
        "log": trainer.state.log_history,
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "train_loss": train_loss,
        "fetched": dataset.fetched,
        "verification": next(
            each.verification
            for each in trainer.callback_handler.callbacks
            if isinstance(each, Drills)
        ),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build(args, output_dir)
        result = trainer.train()
        torch.save(final_state(trainer, result.training_loss), args.out)


if __name__ == "__main__":
    main()
