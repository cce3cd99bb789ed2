"""The demo job on many ranks: DDP or FSDP2, one process per rank, gloo on the CPU.

    torchrun --nproc-per-node 2 -m agent.demo.ranks --store S --out OUT --parallel ddp

Any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` works
(torchrun, a PyTorchJob, an Indexed Job, or a test starting the processes itself). Each rank
trains on its shard of the data (a sharded ``ResumableSampler``), with dropout and AdamW, and
writes its final state and per-micro-batch losses to ``OUT.rank<R>`` for comparison with an
uninterrupted run (``agent.demo.compare``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from agent.checkpointer import Checkpointer
from agent.data.sampling import ResumableSampler
from agent.demo.compare import save_final
from agent.demo.drills import (
    DrillStore,
    aim_drill,
    drill_armed,
    finish_drill,
    hold_for_signal,
    signal_self,
)
from agent.demo.train import NUM_SAMPLES, NoisyBlobs, make_model, parse_position, warmup_cosine
from agent.save.result import PendingSave
from ckpt.core.storage import open_store

ACCUMULATION = 2
BATCH_SIZE = 8


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    # Under torchrun name the run with CKPT_RUN: torchrun takes a --run anywhere on its
    # command line, the script's arguments too, for an abbreviation of its own --run-path.
    add("--run", default=os.environ.get("CKPT_RUN", "ranks"), help="default: CKPT_RUN, or ranks")
    add("--store", required=True)
    add("--out", required=True, help="each rank writes OUT.rank<R>")
    add("--parallel", choices=["ddp", "fsdp"], default="ddp")
    add(
        "--sampler",
        choices=["ckpt", "torch"],
        default="ckpt",
        help="shard the data with ckpt's ResumableSampler or torch's DistributedSampler",
    )
    add(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP's gradient bucket size in MiB (default: DDP's own, 25)",
    )
    add("--steps", type=int, default=12, help="train until this optimizer step")
    add("--total-steps", type=int, default=24, help="the LR schedule's length")
    add("--every", type=int, default=None, help="save every N optimizer steps")
    add("--kill-at", type=parse_position, default=None, help="STEP[.MICRO]: SIGKILL ranks")
    add("--kill-rank", type=int, default=None, help="only this rank gets --kill-at")
    add("--signal-at", type=parse_position, default=None, help="STEP[.MICRO]: SIGTERM ranks")
    add("--signal-rank", type=int, default=None, help="only this rank gets --signal-at")
    add("--kill-during-upload", type=int, default=None, help="STEP: SIGKILL in its upload")
    add("--drill-rank", type=int, default=0, help="the rank --kill-during-upload kills")
    add(
        "--drill-marker",
        default=None,
        help="a file: the kill drills fire only while it is absent; --kill-during-upload "
        "records in it what it did (as agent.demo.train does)",
    )
    add("--hold-file", default=None, help="a file naming a STEP: wait there for a SIGTERM")
    add("--dump-resumed", default=None, help="PATH: rank 0 writes the whole state after resume")
    add("--dump-final", default=None, help="PATH: rank 0 writes the whole state at the end")
    return parser.parse_args(argv)


@dataclass
class Job:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ckpt: Checkpointer
    store: DrillStore
    records: list[tuple[int, int, torch.Tensor, float]] = field(default_factory=list)


def wrap(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    if args.parallel == "ddp":
        if args.bucket_cap_mb is None:
            return nn.parallel.DistributedDataParallel(model)
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    from torch.distributed.fsdp import fully_shard

    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def build(args: argparse.Namespace) -> Job:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = wrap(make_model(), args)
    random.seed(1000 + rank)  # each rank its own dropout and augmentation
    np.random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.total_steps))
    dataset = NoisyBlobs()
    sampler: Sampler[int] = (
        ResumableSampler(NUM_SAMPLES, seed=11, num_replicas=world, rank=rank)
        if args.sampler == "ckpt"
        else DistributedSampler(dataset, seed=11)
    )
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, num_workers=0)
    store = DrillStore(open_store(args.store), delay=0.0, marker=args.drill_marker)
    ckpt = Checkpointer(
        run=args.run,
        store=store,
        models=model,
        optimizers=optimizer,
        schedulers=scheduler,
        data=loader,
        every_steps=args.every,
    )
    store.stopping = lambda: ckpt.stopping
    return Job(model, optimizer, scheduler, ckpt, store)


def train_micro_batch(job: Job, inputs: torch.Tensor, labels: torch.Tensor) -> None:
    counters = job.ckpt.counters
    loss = F.cross_entropy(job.model(inputs), labels) / ACCUMULATION
    torch.autograd.backward(loss)
    counters.micro_step += 1
    lr = float(job.scheduler.get_last_lr()[0])
    job.records.append((counters.step, counters.micro_step, loss.detach(), lr))
    if counters.micro_step == ACCUMULATION:
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        job.scheduler.step()
        counters.step += 1
        counters.micro_step = 0
    job.ckpt.step_done(loss.detach())  # this rank's fingerprint, for a resume to compare


def arm_upload_drill(
    job: Job, args: argparse.Namespace, position: tuple[int, int], *, previous: PendingSave | None
) -> bool:
    """Whether the drill rank dies in the upload of the bundle about to be saved here.

    The previous save may still be uploading (a step of this model takes milliseconds): the
    drill waits for it to be durable first, so that it kills this bundle's upload alone.
    """
    aimed = dist.get_rank() == args.drill_rank and aim_drill(
        job.store,
        at=args.kill_during_upload,
        every=args.every,
        position=position,
    )
    if aimed:
        if previous is not None:
            previous.wait()
        job.store.kill_in_upload_of = position[0]
        return True
    return False


def drills(job: Job, args: argparse.Namespace, position: tuple[int, int]) -> None:
    rank = dist.get_rank()
    if position == args.signal_at and args.signal_rank in (None, rank):
        print(f"rank {rank}: SIGTERM at step {position[0]}.{position[1]}", flush=True)
        signal_self(job.ckpt)
    if position == args.kill_at and drill_armed(args.drill_marker):
        job.ckpt.wait()  # the saves before the kill durable however slow the machine
        print(f"rank {rank}: killed at step {position[0]}.{position[1]}", flush=True)
        dist.barrier()  # every rank reaches the drill before any dies
        if rank == 0 and args.drill_marker is not None:
            open(args.drill_marker, "w").close()
        dist.barrier()
        if args.kill_rank in (None, rank):
            os.kill(os.getpid(), signal.SIGKILL)


def train(job: Job, args: argparse.Namespace) -> None:
    counters = job.ckpt.counters
    previous: PendingSave | None = None
    while counters.step < args.steps:
        for inputs, labels in job.ckpt.batches():
            train_micro_batch(job, inputs, labels)
            position = (counters.step, counters.micro_step)
            armed = arm_upload_drill(job, args, position, previous=previous)
            hold_for_signal(job.ckpt, args.hold_file, position)
            saved = job.ckpt.maybe_save()
            previous = saved or previous
            if armed:
                finish_drill(job.store, saved)
            drills(job, args, position)
            if counters.step >= args.steps:
                break


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (the local shard of a DTensor)."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if callable(to_local) else tensor).detach().clone()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered from every rank's shard (a collective for a DTensor)."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else tensor).detach().clone()


def dump_whole(job: Job, path: str | None) -> None:
    """Rank 0 writes every parameter and optimizer tensor whole: a resharded resume must
    find them equal, element for element, to what the other world size saved."""
    if path is None:
        return
    state = {f"model/{name}": whole(t) for name, t in job.model.state_dict().items()}
    for index, values in job.optimizer.state_dict()["state"].items():
        state.update({f"optimizer/{index}/{key}": whole(value) for key, value in values.items()})
    if dist.get_rank() == 0:
        torch.save(state, path)


def final_state(job: Job) -> dict[str, Any]:
    """What two runs must agree on, per rank (``agent.demo.compare.differences``)."""
    optim_state = job.optimizer.state_dict()
    records, verified = job.records, job.ckpt.verification
    return {
        "model": {name: local(t) for name, t in job.model.state_dict().items()},
        "optimizer": {
            f"{index}/{key}": local(value)
            for index, state in optim_state["state"].items()
            for key, value in state.items()
        },
        "lr": [group["lr"] for group in optim_state["param_groups"]],
        "scaler": {},
        "positions": [(step, micro) for step, micro, _, _ in records],
        "losses": torch.stack([loss for _, _, loss, _ in records]) if records else torch.empty(0),
        "record_lrs": [lr for _, _, _, lr in records],
        "verification": None if verified is None else json.dumps(verified.to_json()),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    run(args)
    # FSDP keeps the work of its last collectives, tensors included, and the checkpointer its
    # own process groups: freed now, while the interpreter is whole. Left to its exit, a gloo
    # rank may abort (SIGABRT, "terminate called without an active exception"), as one did
    # in our suite: pytorch/pytorch#179291.
    gc.collect()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    """Build the job, resume, train and end the attempt."""
    job = build(args)
    result = job.ckpt.resume()
    if result.resumed:
        print(f"rank {dist.get_rank()}: resumed from {result.bundle}", flush=True)
        dump_whole(job, args.dump_resumed)
    job.model.train()
    train(job, args)
    dump_whole(job, args.dump_final)
    save_final(final_state(job), f"{args.out}.rank{dist.get_rank()}")
    job.ckpt.end()
    job.ckpt.close()


if __name__ == "__main__":
    main()
