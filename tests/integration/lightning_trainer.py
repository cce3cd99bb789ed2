"""A tiny Lightning job that checkpoints through ckpt, run in a fresh process by the tests.

``python -m tests.integration.lightning_trainer --store DIR --out FILE [...]`` trains a
Linear-ReLU-Dropout-Linear module built from ``CONFIG`` (no download) on a synthetic
dataset, with AdamW, a per-step cosine schedule and gradient accumulation 2, for several
epochs, validating every 4 batches; it resumes from the run's latest bundle in ``--store`` if there is one. At the end it
writes what the tests compare (``agent.demo.compare.differences``'s keys, plus the
fit loop's counters and how many samples the process loaded).

Drills: ``--kill-at STEP`` SIGKILLs the process once the bundle of STEP is durable (having
written what it ran until then);
``--term-at STEP.MICRO`` sends SIGTERM to itself there (ckpt saves at the next batch end and
exits 143); ``--scramble-rng`` reseeds the global generators after the resume (a negative
control: a resume without the rng layer).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ckpt import ResumableSampler
from ckpt.integrations.lightning import CheckpointCallback


@dataclass(frozen=True)
class Config:
    """The model and data, tiny: 10 batches an epoch, 5 optimizer steps."""

    features: int = 8
    hidden: int = 16
    classes: int = 3
    dropout: float = 0.2
    samples: int = 40
    batch: int = 4


CONFIG = Config()
ACCUMULATION = 2
VALIDATE_EVERY = 4  # batches: validation runs inside the epochs, right after some saves


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A fixed synthetic dataset that counts the samples it loads."""

    def __init__(self, count: int, features: int, classes: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.inputs = torch.randn(count, features, generator=generator)
        self.labels = torch.randint(0, classes, (count,), generator=generator)
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded += 1
        return self.inputs[index], self.labels[index]


class Tiny(pl.LightningModule):
    def __init__(self, config: Config, *, max_steps: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(config.features, config.hidden),
            nn.ReLU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.hidden, config.classes),
        )
        self.max_steps = max_steps
        self.losses: list[torch.Tensor] = []

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        inputs, labels = batch
        loss = nn.functional.cross_entropy(self.net(inputs), labels)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, labels = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(inputs), labels))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.max_steps)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Drills(pl.Callback):
    """Records every micro-batch and fires the drills (after ckpt's callback, in list order)."""

    def __init__(
        self, args: argparse.Namespace, checkpoint: CheckpointCallback, dataset: Samples
    ) -> None:
        self.args, self.checkpoint, self.dataset = args, checkpoint, dataset
        self.positions: list[tuple[int, int, int]] = []
        self.lrs: list[float] = []
        self.verification: str | None = None  # the resume's verdict, as JSON, once known

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.args.scramble_rng:
            torch.manual_seed(1234)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.positions.append((trainer.global_step, trainer.current_epoch, batch_idx))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        ckpt = self.checkpoint.checkpointer
        assert ckpt is not None
        position = (ckpt.counters.step, ckpt.counters.micro_step)
        if ckpt.verification is not None:
            self.verification = json.dumps(ckpt.verification.to_json())
        if position == (self.args.kill_at, 0):
            ckpt.wait()  # the bundle of this step is durable
            assert isinstance(pl_module, Tiny)
            write(self.args.out, trainer, pl_module, self, self.dataset)  # what ran until here
            print(f"killed at step {position[0]}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.args.term_at is not None and position == self.args.term_at:
            print(f"SIGTERM at step {position[0]}, micro step {position[1]}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            while not ckpt.stopping:  # the watcher thread notes it (a busy machine's could
                time.sleep(0.001)  # miss the last batch end: nothing left to resume)


def make_loader(kind: str, dataset: Samples) -> DataLoader[Any]:
    """ckpt's ResumableSampler in a plain DataLoader, or torchdata's StatefulDataLoader
    (which ckpt takes with at least one worker and its own generator)."""
    if kind == "sampler":
        return DataLoader(
            dataset, batch_size=CONFIG.batch, sampler=ResumableSampler(dataset, seed=0)
        )
    from torchdata.stateful_dataloader import StatefulDataLoader

    generator = torch.Generator().manual_seed(11)
    stateful: DataLoader[Any] = StatefulDataLoader(
        dataset, batch_size=CONFIG.batch, shuffle=True, generator=generator, num_workers=1
    )
    return stateful


def position(text: str) -> tuple[int, int]:
    step, _, micro = text.partition(".")
    return int(step), int(micro or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--run", default="lightning")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--term-at", type=position, default=None)
    parser.add_argument("--scramble-rng", action="store_true")
    parser.add_argument("--loader", choices=["sampler", "stateful"], default="sampler")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    dataset = Samples(CONFIG.samples, CONFIG.features, CONFIG.classes)
    loader = make_loader(args.loader, dataset)
    model = Tiny(CONFIG, max_steps=args.max_steps)
    checkpoint = CheckpointCallback(run=args.run, store=args.store, every_steps=args.every)
    drills = Drills(args, checkpoint, dataset)
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accumulate_grad_batches=ACCUMULATION,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=VALIDATE_EVERY,
        callbacks=[checkpoint, drills],
    )
    validation = DataLoader(Samples(8, CONFIG.features, CONFIG.classes), batch_size=CONFIG.batch)
    trainer.fit(model, loader, validation)
    write(args.out, trainer, model, drills, dataset)


def write(out: Path, trainer: pl.Trainer, model: Tiny, drills: Drills, dataset: Samples) -> None:
    optimizer = trainer.optimizers[0]
    tensors = {
        f"{index}.{name}": value
        for index, state in optimizer.state_dict()["state"].items()
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    }
    epoch_loop = trainer.fit_loop.epoch_loop
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": tensors,
            "lr": [group["lr"] for group in optimizer.param_groups],
            "scaler": None,
            "positions": drills.positions,
            "losses": torch.stack(model.losses),
            "record_lrs": drills.lrs,
            "global_step": trainer.global_step,
            "current_epoch": trainer.current_epoch,
            "batch_progress": epoch_loop.batch_progress.state_dict(),
            "epoch_progress": trainer.fit_loop.epoch_progress.state_dict(),
            "optimizer_steps": epoch_loop.automatic_optimization.optim_progress.optimizer_steps,
            "loaded": dataset.loaded,
            "verification": drills.verification,
        },
        out,
    )


if __name__ == "__main__":
    main()
