"""The ranks' meetings over torch.distributed (gloo), in real processes: what rank 0 decides
reaches every rank, a disagreement on the position of a save is an error on every rank, and a
rank that died makes the others fail at once instead of waiting for the deadline."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.server_process import free_port

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import os, threading, time
    import torch.distributed as dist
    from agent.ranks.base import job_ranks
    from ckpt.core.errors import RankError

    dist.init_process_group("gloo")
    ranks = job_ranks(timeout=60)
    rank = ranks.rank
    print("first", ranks.from_first(lambda: f"decided by {dist.get_rank()}", timeout=60))
    print("agree", ranks.agree(("step", 10), what="the step", timeout=60))
    try:
        ranks.agree(10 + rank, what="the position of a save", timeout=60)
    except RankError as err:
        print("disagree", err)
    print("any", ranks.any_rank(rank == 1, False, timeout=60))
    print("all", ranks.all_ok(rank == 0, timeout=60), ranks.all_ok(True, timeout=60))
    box = []
    worker = threading.Thread(target=lambda: box.append(ranks.gather(rank, timeout=60)))
    worker.start(); worker.join()
    print("persist thread", box[0])
    ranks.barrier(timeout=60)
    if rank == 1:
        os._exit(0)
    started = time.monotonic()
    try:
        ranks.agree(1, what="after a death", timeout=60)
    except RankError as err:
        print(f"dead peer noticed in {time.monotonic() - started:.1f} s:", type(err).__name__)
    """
)


def test_the_meetings_of_two_ranks() -> None:
    port = str(free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT],
            env={
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    started = time.monotonic()
    zero, one = (process.communicate(timeout=300)[0] for process in processes)
    assert "first decided by 0" in zero and "first decided by 0" in one, zero + one
    assert "agree ('step', 10)" in one
    for output in (zero, one):
        assert (
            "disagree the ranks disagree on the position of a save (rank 0: 10, rank 1: 11)"
            in output
        )
        assert "any (True, False)" in output
        assert "all False True" in output
        assert "persist thread [0, 1]" in output
    assert "dead peer noticed in" in zero and "RankError" in zero, zero
    assert time.monotonic() - started < 120  # not the 60 s deadline twice: the peer is gone


def test_many_ranks_named_by_the_environment_need_a_process_group() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from agent.ranks.base import job_ranks; job_ranks(timeout=1)"],
        env={**os.environ, "WORLD_SIZE": "4"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert "WORLD_SIZE=4, but torch.distributed is not initialized" in done.stderr
