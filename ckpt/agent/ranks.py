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

    def barrier(self, *, timeout: float) -> None:
        """Wait until every rank arrives.

        Raises:
            TimeoutError: some rank did not arrive within ``timeout`` seconds.
        """
        ...


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

    def barrier(self, *, timeout: float) -> None:
        return None
