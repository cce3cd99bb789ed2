"""A trainer for the control-plane outage tests, run as its own process.

``python -m tests.integration.outage_trainer RUN DIR STEPS EVERY [PAUSE_AT ...]``: resume
``RUN`` through ``CKPT_SERVER`` (its store ``CKPT_STORE``), write the weights it resumed
with to ``DIR/resumed.pt`` (and its step to ``DIR/resumed``), train to step ``STEPS``
saving every ``EVERY`` steps, writing each saved step's weights to ``DIR/weights-<step>.pt``.
At each step in ``PAUSE_AT`` it touches ``DIR/at-<step>`` and waits for ``DIR/go-<step>``
(the test changes the network meanwhile); ``12!`` waits for every save to be durable
first. At the end it waits for every save and writes ``DIR/result.json``: the longest
``maybe_save()`` call, every call's (step, seconds), and the steps saved. Under torchrun (``WORLD_SIZE`` > 1) the model is a
DDP over gloo, every rank pauses alike, and rank 0 writes the files (``result-<rank>.json``
for the other ranks).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ckpt import Checkpointer, PendingSave

GO_SECONDS = 300.0  # how long a pause waits for the test


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + GO_SECONDS
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.02)


def main(run: str, folder: str, steps: str, every: str, *pauses: str) -> None:
    out = Path(folder)
    torch.manual_seed(0)
    rank = 0
    net = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    model: nn.Module = net
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(
        run=run,
        models=model,
        optimizers=optimizer,
        every_steps=int(every),
        heartbeat_seconds=0.5,
        handle_signals=False,
    )
    ckpt.resume()
    if rank == 0:
        (out / "resumed").write_text(str(ckpt.counters.step))
        torch.save(net.state_dict(), out / "resumed.pt")
    slowest, taken = 0.0, []
    stalls: list[tuple[int, float]] = []  # (step, seconds) of every maybe_save() call
    pending: list[PendingSave] = []
    while ckpt.counters.step < int(steps):
        loss = model(torch.randn(16, 32)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt.counters.step += 1
        before = time.perf_counter()
        save = ckpt.maybe_save()
        took = time.perf_counter() - before
        slowest = max(slowest, took)
        stalls.append((ckpt.counters.step, took))
        if save is not None:
            taken.append(save.step)
            pending.append(save)
            if rank == 0:
                torch.save(net.state_dict(), out / f"weights-{save.step}.pt")
        if f"{ckpt.counters.step}!" in pauses:
            ckpt.wait()  # every save so far durable before the test changes the network
        if str(ckpt.counters.step) in {p.rstrip("!") for p in pauses}:
            if rank == 0:
                (out / f"at-{ckpt.counters.step}").touch()
            wait_for(out / f"go-{ckpt.counters.step}")
    # ``nowait``: leave the commits to end() and close(), which wait for them a bounded time.
    durable = [] if "nowait" in pauses else [save.wait().step for save in pending]
    ckpt.end()
    ckpt.close()
    result = {"slowest_maybe_save": slowest, "stalls": stalls, "taken": taken, "durable": durable}
    (out / ("result.json" if rank == 0 else f"result-{rank}.json")).write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
