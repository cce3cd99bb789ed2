"""What the ranks of one job must agree on, behind one small interface.

A job of many ranks (DDP or FSDP under torchrun) makes one attempt and one bundle per save:
rank 0 registers the attempt and every rank takes its registration; every rank saves the
same step; the bundle is committed once, after every rank has recorded its layers; and a
rank that does not arrive within a timeout fails the save rather than hanging it.

These are the only points where ranks meet, so they are the only calls here.
``SingleProcess`` is the one rank of a plain job; a ``torch.distributed`` implementation
plugs in beside it for many ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

T = TypeVar("T")

# How long a rank waits at a meeting for the others before the save fails.
MEET_SECONDS = 300.0


class Ranks(Protocol):
    """The meeting points of a job's ranks."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def from_first(self, make: Callable[[], T], *, timeout: float) -> T:
        """Rank 0 calls ``make``; every rank gets its result (the attempt's registration,
        a bundle's commit)."""
        ...

    def agree(self, value: T, *, what: str, timeout: float) -> T:
        """``value``, which every rank must pass equal (the step of a save).

        Raises:
            ValueError: the ranks passed different values; the message names ``what``.
        """
        ...

    def all_ok(self, ok: bool, *, timeout: float) -> bool:
        """Whether every rank passed True (every rank recorded its layers)."""
        ...

    def any_rank(self, *flags: bool, timeout: float) -> tuple[bool, ...]:
        """For each flag, whether some rank passed True (a stop signal reached it, a save is
        due by its clock): cheap enough for every step."""
        ...

    def gather(self, value: T, *, timeout: float) -> list[T]:
        """Every rank's ``value``, by rank (what failed where)."""
        ...

    def barrier(self, *, timeout: float) -> None:
        """Wait until every rank arrives.

        Raises:
            TimeoutError: some rank did not arrive within ``timeout`` seconds.
        """
        ...


def job_ranks(*, timeout: float) -> Ranks:
    """The ranks of this job: a ``torch.distributed`` job of many ranks, or this process.

    Raises:
        ValueError: the environment names many ranks (``WORLD_SIZE``, set by torchrun, a
            PyTorchJob or the manifests in ``deploy/``) but no process group is initialized.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from agent.ranks.distributed import TorchRanks

        return TorchRanks(timeout=timeout)
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        raise ValueError(
            f"WORLD_SIZE={world}, but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group(...) before creating the Checkpointer, so "
            "that every rank joins one attempt"
        )
    return SingleProcess()


@dataclass(frozen=True)
class SingleProcess:
    """The one rank of a job that runs in one process: every meeting is immediate."""

    rank: int = 0
    world_size: int = 1

    def from_first(self, make: Callable[[], T], *, timeout: float) -> T:
        return make()

    def agree(self, value: T, *, what: str, timeout: float) -> T:
        return value

    def all_ok(self, ok: bool, *, timeout: float) -> bool:
        return ok

    def any_rank(self, *flags: bool, timeout: float) -> tuple[bool, ...]:
        return flags

    def gather(self, value: T, *, timeout: float) -> list[T]:
        return [value]

    def barrier(self, *, timeout: float) -> None:
        return None
