"""The ranks of a ``torch.distributed`` job: the ``Ranks`` meetings over gloo.

The meetings run on process groups of their own, on the gloo backend, so they work beside
any training backend (NCCL on GPUs) and never interleave with the training's collectives.
The training thread and the persist thread each have a group: the persist thread's commit
meetings run while the loop meets on its own (the step of the next save), and a group must
see its collectives in the same order on every rank.

Each meeting has a deadline (``timeout``): a rank that died or hangs makes the others fail
with ``RankError`` instead of waiting forever (gloo notices a dead peer's closed connection
at once; a hung one at the deadline).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ckpt.core.errors import CkptError, RankError

T = TypeVar("T")


@dataclass(frozen=True)
class _Answer:
    """What rank 0 sends the others: its result, or what went wrong."""

    value: Any = None
    error: str | None = None


class TorchRanks:
    """The ranks of the default process group, which the training initialized."""

    def __init__(self, *, timeout: float) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("TorchRanks needs torch.distributed initialized (init_process_group)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._timeout = timeout
        deadline = timedelta(seconds=timeout)
        # Every rank creates both groups, in this order, at construction.
        self._groups = {
            "main": dist.new_group(backend="gloo", timeout=deadline),
            "persist": dist.new_group(backend="gloo", timeout=deadline),
        }

    def _group(self) -> Any:
        main = threading.current_thread() is threading.main_thread()
        return self._groups["main" if main else "persist"]

    def from_first(self, make: Callable[[], T], *, timeout: float) -> T:
        box: list[object] = [None]
        failure: CkptError | None = None
        if self.rank == 0:
            try:
                box[0] = _Answer(value=make())
            except CkptError as err:
                failure, box[0] = err, _Answer(error=f"{type(err).__name__}: {err}")
        self._broadcast(box, what="an answer of rank 0")
        answer = box[0]
        assert isinstance(answer, _Answer)
        if failure is not None:
            raise failure
        if answer.error is not None:
            raise RankError(f"rank 0 failed: {answer.error}")
        result: T = answer.value
        return result

    def agree(self, value: T, *, what: str, timeout: float) -> T:
        values: list[object] = [None] * self.world_size
        self._collect(values, value, what=what)
        if any(other != value for other in values):
            listed = ", ".join(f"rank {rank}: {other}" for rank, other in enumerate(values))
            raise RankError(f"the ranks disagree on {what} ({listed})")
        return value

    def all_ok(self, ok: bool, *, timeout: float) -> bool:
        return all(self.gather(ok, timeout=timeout))

    def any_rank(self, *flags: bool, timeout: float) -> tuple[bool, ...]:
        values = torch.tensor([int(flag) for flag in flags])
        try:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._group())
        except RuntimeError as err:
            raise RankError(f"the ranks could not meet at a step boundary: {err}") from err
        return tuple(bool(value) for value in values.tolist())

    def gather(self, value: T, *, timeout: float) -> list[T]:
        values: list[object] = [None] * self.world_size
        self._collect(values, value, what="what each rank has")
        return values  # type: ignore[return-value]  # each rank's T

    def barrier(self, *, timeout: float) -> None:
        try:
            dist.monitored_barrier(
                group=self._group(),
                timeout=timedelta(seconds=min(timeout, self._timeout)),
                wait_all_ranks=True,
            )
        except RuntimeError as err:
            raise RankError(f"not every rank arrived in time: {err}") from err

    def _broadcast(self, box: list[object], *, what: str) -> None:
        try:
            dist.broadcast_object_list(box, src=0, group=self._group())
        except RuntimeError as err:
            raise RankError(f"waiting for {what}: {err}") from err

    def _collect(self, values: list[object], value: object, *, what: str) -> None:
        try:
            dist.all_gather_object(values, value, group=self._group())
        except RuntimeError as err:
            raise RankError(f"the ranks could not meet on {what}: {err}") from err
