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
import math
import os
import random
import signal
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.data import DataLoader, Dataset

from agent import Checkpointer, Layer, PerSampleRNG, ResumableSampler

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


def make_loader(kind: str, workers: int, *, per_sample_rng: bool = True) -> Any:
    dataset: Dataset[Any] = PerSampleRNG(NoisyBlobs(), seed=7) if per_sample_rng else NoisyBlobs()
    if kind == "sampler":
        sampler = ResumableSampler(NUM_SAMPLES, seed=11)
        return DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, num_workers=workers)
    from torchdata.stateful_dataloader import StatefulDataLoader

    generator = torch.Generator().manual_seed(11)
    return StatefulDataLoader(
        dataset, batch_size=BATCH_SIZE, shuffle=True, generator=generator, num_workers=workers
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="demo")
    parser.add_argument("--store", required=True)
    parser.add_argument("--steps", type=int, default=60, help="train until this optimizer step")
    parser.add_argument("--total-steps", type=int, default=60, help="the LR schedule's length")
    parser.add_argument("--every", type=int, default=None, help="save every N optimizer steps")
    parser.add_argument(
        "--save-at", type=str, default=None, help="STEP[.MICRO]: save exactly there"
    )
    parser.add_argument(
        "--kill-after-save", action="store_true", help="SIGKILL itself right after --save-at"
    )
    parser.add_argument(
        "--kill-at", type=str, default=None, help="STEP[.MICRO]: SIGKILL itself there"
    )
    parser.add_argument("--loader", choices=["sampler", "stateful"], default="sampler")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--no-per-sample-rng",
        dest="per_sample_rng",
        action="store_false",
        help="do not wrap the dataset in PerSampleRNG (shows why it exists)",
    )
    parser.add_argument(
        "--skip-layer", choices=[str(layer) for layer in Layer], action="append", default=[]
    )
    parser.add_argument(
        "--out", required=True, help="where to write the final state and loss records"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.total_steps))
    scaler = torch.amp.GradScaler("cpu", growth_interval=5)
    ckpt = Checkpointer(
        run=args.run,
        store=args.store,
        models=model,
        optimizers=optimizer,
        schedulers=scheduler,
        data=make_loader(args.loader, args.workers, per_sample_rng=args.per_sample_rng),
        scaler=scaler,
        every_steps=args.every,
    )
    resumed = ckpt.resume(layers=[layer for layer in Layer if layer not in args.skip_layer])
    if resumed.resumed:
        print(
            f"resumed from {resumed.bundle} at step {ckpt.counters.step}, micro step {ckpt.counters.micro_step}",
            flush=True,
        )
    save_at, kill_at = parse_position(args.save_at), parse_position(args.kill_at)
    records: list[tuple[int, int, torch.Tensor, float]] = []
    counters = ckpt.counters
    model.train()
    while counters.step < args.steps:
        for inputs, labels in ckpt.batches():
            loss = F.cross_entropy(model(inputs), labels) / ACCUMULATION
            scaled: torch.Tensor = scaler.scale(loss)
            torch.autograd.backward(scaled)
            counters.micro_step += 1
            counters.samples += len(labels)
            records.append(
                (
                    counters.step,
                    counters.micro_step,
                    loss.detach(),
                    float(scheduler.get_last_lr()[0]),
                )
            )
            if counters.micro_step == ACCUMULATION:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                counters.step += 1
                counters.micro_step = 0
            position = (counters.step, counters.micro_step)
            if position == save_at:
                ckpt.save()
                if args.kill_after_save:
                    os.kill(os.getpid(), signal.SIGKILL)
            ckpt.maybe_save()
            if position == kill_at:
                print(f"killed at step {position[0]}, micro step {position[1]}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if counters.step >= args.steps:
                break
    torch.save(final_state(model, optimizer, scaler, records), args.out)


def parse_position(text: str | None) -> tuple[int, int] | None:
    """``"30"`` -> (30, 0); ``"30.2"`` -> (30, 2)."""
    if text is None:
        return None
    step, _, micro = text.partition(".")
    return int(step), int(micro or 0)


def final_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    records: list[tuple[int, int, torch.Tensor, float]],
) -> dict[str, Any]:
    """Everything two runs must agree on, in a form ``torch.load(weights_only=True)`` reads."""
    optim_state = optimizer.state_dict()
    return {
        "model": {name: t.clone() for name, t in model.state_dict().items()},
        "optimizer": {
            f"{index}/{key}": value.clone()
            for index, state in optim_state["state"].items()
            for key, value in state.items()
        },
        "lr": [group["lr"] for group in optim_state["param_groups"]],
        "scaler": scaler.state_dict(),
        "positions": [(step, micro) for step, micro, _, _ in records],
        "losses": torch.stack([loss for _, _, loss, _ in records]) if records else torch.empty(0),
        "record_lrs": [lr for _, _, _, lr in records],
    }


if __name__ == "__main__":
    main()
