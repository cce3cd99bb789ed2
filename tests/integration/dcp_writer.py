"""Writes a DCP checkpoint from two ranks (gloo, CPU), the weights sharded between them.

``python -m tests.integration.dcp_writer DIR`` spawns the ranks; each holds half of every
weight's rows as a DTensor, and the optimizer state keyed by parameter name, as
``get_optimizer_state_dict`` gives it, so the checkpoint can only be read whole by
merging both ranks' files.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.multiprocessing.spawn import spawn


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same model, trained the same 3 steps, in every process."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def state(mesh: object | None) -> dict[str, object]:
    """What the ranks save: each tensor sharded by rows across ``mesh`` (or whole)."""
    model, optimizer = model_and_optimizer()

    def shard(tensor: torch.Tensor) -> torch.Tensor:
        if mesh is None or tensor.dim() == 0:
            return tensor
        return distribute_tensor(tensor, mesh, [Shard(0)])  # type: ignore[arg-type]

    saved = optimizer.state_dict()
    names = [name for name, _ in model.named_parameters()]
    return {
        "model": {name: shard(t) for name, t in model.state_dict().items()},
        "optimizer": {
            "state": {
                names[i]: {k: shard(v) for k, v in values.items()}
                for i, values in saved["state"].items()
            },
            "param_groups": [
                {**group, "params": [names[i] for i in group["params"]]}
                for group in saved["param_groups"]
            ],
        },
        "step": 3,
    }


def rank_main(rank: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["DCP_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        dcp_save(state(mesh), checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    spawn(rank_main, args=(sys.argv[1],), nprocs=2)  # type: ignore[no-untyped-call]
