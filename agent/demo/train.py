"""A small but complete training job, used by ``ckpt demo`` and by the bit-exactness tests.

It exercises every layer: dropout and batch-norm buffers (weights, rng), AdamW (optimizer),
warmup + cosine (scheduler), gradient accumulation (counters, grads mid-accumulation), a
GradScaler, and a shuffled DataLoader with worker processes whose samples draw from NumPy,
Python and torch randomness (data, rng).

Run ``python -m agent.demo.train --help``. It writes the final parameters, optimizer
state and per-micro-batch loss records to ``--out`` so that runs can be compared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.data import DataLoader, Dataset

from agent.checkpointer import Checkpointer
from agent.data.sampling import PerSampleRNG, ResumableSampler
from agent.demo.compare import save_final
from agent.demo.drills import (
    DrillStore,
    aim_drill,
    finish_drill,
    hold_for_signal,
    signal_self,
)
from ckpt.core.contract import Layer
from ckpt.core.storage import open_store

ACCUMULATION = 4
BATCH_SIZE = 8
NUM_SAMPLES = 256  # 32 batches, 8 optimizer steps per epoch
WARMUP_STEPS = 10


class NoisyBlobs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Four Gaussian blobs; every sample gets NumPy, Python and torch random augmentation."""

    def __init__(self, size: int = NUM_SAMPLES) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        centers = torch.randn(4, 16, generator=generator) * 2
        self.points = centers[self.labels] + torch.randn(size, 16, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.from_numpy(np.random.normal(0.0, 0.3, 16).astype(np.float32))
        scale = 1.0 + 0.1 * (random.random() - 0.5)
        mask = (torch.rand(16) > 0.1).float()
        return (self.points[index] + noise) * scale * mask, self.labels[index]


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64),
        nn.BatchNorm1d(64),
        nn.GELU(),
        nn.Dropout(0.2),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Dropout(0.2),
        nn.Linear(64, 4),
    )


def warmup_cosine(total_steps: int) -> Any:
    def factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def make_loader(args: argparse.Namespace) -> Any:
    dataset = PerSampleRNG(NoisyBlobs(), seed=7) if args.per_sample_rng else NoisyBlobs()
    options: dict[str, Any] = {
        "batch_size": BATCH_SIZE,
        "num_workers": args.workers,
        "persistent_workers": args.persistent_workers,
    }
    if args.loader == "sampler":
        return DataLoader(dataset, sampler=ResumableSampler(NUM_SAMPLES, seed=11), **options)
    from torchdata.stateful_dataloader import StatefulDataLoader

    generator = torch.Generator().manual_seed(11)
    return StatefulDataLoader(dataset, shuffle=True, generator=generator, **options)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--run", default="demo")
    add("--store", required=True)
    add("--out", required=True, help="where to write the final state and loss records")
    add("--steps", type=int, default=60, help="train until this optimizer step")
    add("--total-steps", type=int, default=60, help="the LR schedule's length")
    add("--every", type=int, default=None, help="save every N optimizer steps")
    add("--save-at", type=parse_position, default=None, help="STEP[.MICRO]: save exactly there")
    add("--save-at-epoch-end", type=int, default=None, help="save after the loop over EPOCH ends")
    add("--kill-after-save", action="store_true", help="SIGKILL itself right after that save")
    add(
        "--kill-at",
        type=parse_position,
        default=None,
        help="STEP[.MICRO]: SIGKILL itself there, once the saves before it are durable",
    )
    add("--loader", choices=["sampler", "stateful"], default="sampler")
    add("--workers", type=int, default=2)
    add("--persistent-workers", action="store_true")
    add(
        "--break-after-save",
        action="store_true",
        help="leave the batch loop after every policy save and re-enter it (an eval pattern)",
    )
    add(
        "--no-per-sample-rng",
        dest="per_sample_rng",
        action="store_false",
        help="do not wrap the dataset in PerSampleRNG (shows why it exists)",
    )
    add("--skip-layer", choices=[str(layer) for layer in Layer], action="append", default=[])
    # Preemption drills: a signal at a known position, a long step, a slow or dying upload.
    add("--signal-at", type=parse_position, default=None, help="STEP[.MICRO]: SIGTERM itself")
    add("--pause-at", type=parse_pause, default=None, help="STEP[.MICRO]:SECONDS: a long step")
    add("--hold-file", default=None, help="a file naming a STEP: wait there for a SIGTERM")
    add(
        "--durable-at",
        type=parse_position,
        default=None,
        help="STEP[.MICRO]: a step that lasts until the saves before it are durable",
    )
    add("--slow-store", type=float, default=0.0, help="seconds each blob upload takes extra")
    add(
        "--kill-during-upload",
        type=int,
        default=None,
        help="STEP: SIGKILL itself while uploading the bundle of that step (or of the next "
        "save, when that one is skipped or the process was told to stop)",
    )
    add(
        "--drill-marker",
        default=None,
        help="a file: --kill-during-upload fires only while it does not exist; it records "
        'what the drill did: {"outcome": "killed" | "nothing to upload", "step": STEP}',
    )
    return parser.parse_args(argv)


def parse_pause(text: str) -> tuple[tuple[int, int], float]:
    """``"30.2:5"`` -> ((30, 2), 5.0)."""
    where, _, seconds = text.partition(":")
    return parse_position(where), float(seconds)


@dataclass
class Job:
    """The objects of one training process."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    ckpt: Checkpointer
    store: DrillStore
    records: list[tuple[int, int, torch.Tensor, float]] = field(default_factory=list)


def build(args: argparse.Namespace) -> Job:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.total_steps))
    scaler = torch.amp.GradScaler("cpu", growth_interval=5)
    store = DrillStore(open_store(args.store), delay=args.slow_store, marker=args.drill_marker)
    ckpt = Checkpointer(
        run=args.run,
        store=store,
        models=model,
        optimizers=optimizer,
        schedulers=scheduler,
        data=make_loader(args),
        scaler=scaler,
        every_steps=args.every,
    )
    store.stopping = lambda: ckpt.stopping
    return Job(model, optimizer, scheduler, scaler, ckpt, store)


def train_micro_batch(job: Job, inputs: torch.Tensor, labels: torch.Tensor) -> None:
    """Forward, backward, and an optimizer step every ACCUMULATION micro-batches."""
    counters = job.ckpt.counters
    loss = F.cross_entropy(job.model(inputs), labels) / ACCUMULATION
    scaled: torch.Tensor = job.scaler.scale(loss)
    torch.autograd.backward(scaled)
    counters.micro_step += 1
    counters.samples += len(labels)
    lr = float(job.scheduler.get_last_lr()[0])
    job.records.append((counters.step, counters.micro_step, loss.detach(), lr))
    if counters.micro_step == ACCUMULATION:
        job.scaler.step(job.optimizer)
        job.scaler.update()
        job.optimizer.zero_grad(set_to_none=True)
        job.scheduler.step()
        counters.step += 1
        counters.micro_step = 0
    job.ckpt.step_done(loss.detach())  # the fingerprint a resume compares its replay with


def save_and_maybe_die(job: Job, *, kill: bool) -> None:
    job.ckpt.save().wait()
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)


def long_step(job: Job, args: argparse.Namespace, position: tuple[int, int]) -> None:
    """The drills' long steps: one of a given length, or one that lasts until the saves
    before it are durable (however slow the machine)."""
    if args.pause_at is not None and position == args.pause_at[0]:
        print(f"a long step at {position[0]}.{position[1]}", flush=True)
        time.sleep(args.pause_at[1])
    if position == args.durable_at:
        job.ckpt.wait()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    job = build(args)
    counters = job.ckpt.counters
    resumed = job.ckpt.resume(layers=[layer for layer in Layer if layer not in args.skip_layer])
    if resumed.resumed:
        where = f"step {counters.step}, micro step {counters.micro_step}"
        print(f"resumed from {resumed.bundle} at {where}", flush=True)
    job.model.train()
    while counters.step < args.steps:
        for inputs, labels in job.ckpt.batches():
            train_micro_batch(job, inputs, labels)
            position = (counters.step, counters.micro_step)
            if position == args.save_at:
                save_and_maybe_die(job, kill=args.kill_after_save)
            drill = aim_drill(
                job.store, at=args.kill_during_upload, every=args.every, position=position
            )
            if drill:
                job.ckpt.wait()  # the save before durable: the drill kills this bundle's upload
                job.store.kill_in_upload_of = counters.step
            long_step(job, args, position)
            hold_for_signal(job.ckpt, args.hold_file, position)
            saved = job.ckpt.maybe_save()
            if drill:
                finish_drill(job.store, saved)
            if position == args.signal_at:
                print(f"SIGTERM at step {position[0]}, micro step {position[1]}", flush=True)
                signal_self(job.ckpt)
            if position == args.kill_at:
                job.ckpt.wait()  # the saves before the kill durable however slow the machine
                print(f"killed at step {position[0]}, micro step {position[1]}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if counters.step >= args.steps or (saved and args.break_after_save):
                break
        else:
            if counters.epoch == args.save_at_epoch_end:
                save_and_maybe_die(job, kill=args.kill_after_save)
    save_final(final_state(job), args.out)
    job.ckpt.end("finished")
    job.ckpt.close()


def parse_position(text: str) -> tuple[int, int]:
    """``"30"`` -> (30, 0); ``"30.2"`` -> (30, 2)."""
    step, _, micro = text.partition(".")
    return int(step), int(micro or 0)


def final_state(job: Job) -> dict[str, Any]:
    """Everything two runs must agree on, in a form ``torch.load(weights_only=True)`` reads."""
    optim_state = job.optimizer.state_dict()
    records, verified = job.records, job.ckpt.verification
    return {
        "model": {name: t.clone() for name, t in job.model.state_dict().items()},
        "optimizer": {
            f"{index}/{key}": value.clone()
            for index, state in optim_state["state"].items()
            for key, value in state.items()
        },
        "lr": [group["lr"] for group in optim_state["param_groups"]],
        "scaler": job.scaler.state_dict(),
        "positions": [(step, micro) for step, micro, _, _ in records],
        "losses": torch.stack([loss for _, _, loss, _ in records]) if records else torch.empty(0),
        "record_lrs": [lr for _, _, _, lr in records],
        "verification": None if verified is None else json.dumps(verified.to_json()),
    }


if __name__ == "__main__":
    main()
