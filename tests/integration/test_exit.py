"""A closed checkpointer holds nothing, so a job ends when its training ends.

DataLoader workers are forked children of the rank: they hold copies of its file
descriptors, the signal watcher's pipe among them, and when shielded from SIGTERM
(docs/ranks.md) nothing but their iterator can stop them. Whatever the checkpointer keeps
after ``close()`` keeps the workers too, and the interpreter's exit then waits for them
forever.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt import Checkpointer, ResumableSampler

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def train_and_close(root: Path) -> tuple[weakref.ref[Checkpointer], weakref.ref[nn.Module]]:
    """Train a few steps with forked DataLoader workers, end and close; weak references to
    the checkpointer and the model."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = TensorDataset(torch.randn(64, 2))
    loader = DataLoader(
        dataset, sampler=ResumableSampler(dataset, seed=0), batch_size=4, num_workers=2
    )
    checkpointer = Checkpointer(
        run="closed",
        store=str(root),
        models={"model": model},
        optimizers={"optimizer": optimizer},
        data=loader,
    )
    checkpointer.resume()
    for (batch,) in checkpointer.batches():
        model(batch).sum().backward()
        optimizer.step()
        checkpointer.counters.step += 1
        if checkpointer.counters.step == 3:
            break  # mid-epoch: the checkpointer holds the live iterator and its workers
    checkpointer.save().wait()
    checkpointer.end()
    checkpointer.close()
    return weakref.ref(checkpointer), weakref.ref(model)


def test_a_closed_checkpointer_keeps_no_thread_and_nothing_it_was_given(tmp_path: Path) -> None:
    before = set(threading.enumerate())  # other tests in this worker may have left theirs
    checkpointer, model = train_and_close(tmp_path)
    gc.collect()
    left = [t.name for t in threading.enumerate() if t not in before]
    assert [name for name in left if name.startswith("ckpt-")] == []
    assert checkpointer() is None
    assert model() is None


# The shield of docs/ranks.md, under torchrun, in a script that keeps its checkpointer in a
# global (as a script does) and leaves the batch loop mid-epoch.
SHIELDED_JOB = """
import os, signal, sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from ckpt import Checkpointer, ResumableSampler


def shield(worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(2, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
dataset = TensorDataset(torch.randn(64, 2))
sampler = ResumableSampler(dataset, seed=0, num_replicas=world, rank=rank)
loader = DataLoader(dataset, sampler=sampler, batch_size=4, num_workers=2, worker_init_fn=shield)
checkpointer = Checkpointer(
    run="shielded", store=sys.argv[1], models={"model": model}, optimizers={"optimizer": optimizer},
    data=loader,
)
checkpointer.resume()
for (batch,) in checkpointer.batches():
    model(batch).sum().backward()
    optimizer.step()
    checkpointer.counters.step += 1
    checkpointer.maybe_save()
    if checkpointer.counters.step == 3:
        break
checkpointer.save().wait()
checkpointer.end()
checkpointer.close()
dist.destroy_process_group()
print(f"rank {rank}: done", flush=True)
"""


def processes_running(script: Path) -> list[int]:
    """The live processes started from ``script``: the ranks and their forked workers."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue  # it ended meanwhile
        if str(script).encode() in command and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_the_shielded_job_of_ranks_md_exits_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "shielded_job.py"
    script.write_text(SHIELDED_JOB)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    torchrun = subprocess.Popen(
        [TORCHRUN, "--nproc-per-node", "2", str(script), str(tmp_path / "store")],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = torchrun.communicate(timeout=120)  # about 10 s when it exits
    except subprocess.TimeoutExpired:
        torchrun.kill()
        output = ""
    left = processes_running(script)
    for pid in left:  # the ranks and workers of this test, which torchrun did not end
        os.kill(pid, signal.SIGKILL)
    output = output or torchrun.communicate()[0]  # they held its output open
    assert left == [], f"left running after the job: {left}\n{output[-3000:]}"
    assert torchrun.returncode == 0, output[-3000:]
    assert "rank 0: done" in output and "rank 1: done" in output
