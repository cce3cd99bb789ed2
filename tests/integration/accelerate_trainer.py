"""A bare ``accelerate.Accelerator`` loop for the bit-exactness test of
``ckpt.integrations.accelerate``: dropout, AdamW, a step LR schedule and gradient
accumulation 2 through ``accelerator.accumulate``, over 40 samples in batches of 4 (an
epoch every 5 steps). It records each micro-batch's loss and position and writes them with
the final state to ``--out``; ``--kill-at STEP`` SIGKILLs itself after that step.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt import ResumableSampler
from ckpt.integrations.accelerate import checkpointer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 8), torch.randint(0, 4, (40,)))
    loader = DataLoader(data, batch_size=4, sampler=ResumableSampler(data, seed=3))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    records: list[tuple[int, int, torch.Tensor]] = []
    with checkpointer(accelerator, run="acc", store=args.store, every_steps=2, quiet=True) as ckpt:
        resumed = ckpt.resume()
        counters = ckpt.counters
        while counters.step < args.steps:
            for inputs, labels in ckpt.batches():
                with accelerator.accumulate(model):
                    loss = nn.functional.cross_entropy(model(inputs), labels)
                    records.append((counters.step, counters.micro_step, loss.detach().clone()))
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                counters.micro_step += 1
                if accelerator.sync_gradients:
                    counters.step += 1
                    counters.micro_step = 0
                ckpt.maybe_save()
                if args.kill_at is not None and counters.step == args.kill_at:
                    ckpt.wait()  # the bundle before is durable: the resume starts there
                    os.kill(os.getpid(), signal.SIGKILL)
                if counters.step >= args.steps:
                    break
        ckpt.end()
    state = optimizer.optimizer.state_dict()
    torch.save(
        {
            "resumed_from": resumed.step,
            "model": model.state_dict(),
            "optimizer": {f"{i}/{k}": v for i, s in state["state"].items() for k, v in s.items()},
            "lr": [group["lr"] for group in state["param_groups"]],
            "positions": [(step, micro) for step, micro, _ in records],
            "losses": torch.stack([loss for _, _, loss in records]),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
