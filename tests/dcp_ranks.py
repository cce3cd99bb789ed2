"""Load an exported DCP folder in several gloo processes, each rank taking its ``Shard(0)``
block of every tensor, the way a job at another world size would; rank 0 writes what they
loaded, gathered whole, for the test to compare.

    python -m tests.dcp_ranks DCP_FOLDER TEMPLATE OUT   (RANK, WORLD_SIZE, MASTER_* set)

TEMPLATE is a ``torch.save`` of ``{key: tensor}`` with the DCP keys wanted (``model.w``,
``optimizer.state.0.exp_avg``) and tensors of the right shape and dtype.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.server_process import free_port


def main(folder: str, template: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    wanted = torch.load(template, weights_only=True)
    state = {
        key: distribute_tensor(torch.zeros_like(value), mesh, [Shard(0)])
        if value.dim()
        else torch.zeros_like(value)
        for key, value in wanted.items()
    }
    load(state, checkpoint_id=folder)
    loaded = {
        key: value.full_tensor() if hasattr(value, "full_tensor") else value
        for key, value in state.items()
    }
    if dist.get_rank() == 0:
        torch.save(loaded, out)
    # The DTensors and the work of their last collectives, freed while the interpreter is
    # whole: left to its exit, a gloo rank may abort ("terminate called without an active
    # exception", as one did on CI; pytorch/pytorch#179291, as in agent/demo/ranks.py).
    del state, loaded
    gc.collect()
    dist.destroy_process_group()


def load_in_ranks(world: int, folder: Path, template: Path, out: Path) -> list[str]:
    """Run ``main`` in ``world`` processes; their outputs, after checking each exited 0."""
    port = str(free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.dcp_ranks", str(folder), str(template), str(out)],
            env={
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    codes = [process.returncode for process in processes]
    assert codes == [0] * world, "\n".join(outputs)
    return outputs


if __name__ == "__main__":
    main(*sys.argv[1:4])
