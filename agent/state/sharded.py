"""Sharded tensors (FSDP2's ``DTensor`` parameters and optimizer state) back into the live
objects, at the world size that saved them or at another.

A saved DTensor decodes as a ``sharding.Block``: the block one rank held, with its place in
the whole tensor. Restoring to the world size that saved it, each rank reads its own blocks
back. Restoring to another world size, each rank reads every saved rank's layer and
``merge`` gathers the blocks of each tensor (``Shards``); ``place`` then cuts out the block
the live tensor's mesh gives this rank. Values that are not sharded (replicated state,
buffers, ``step``) come from one saved rank (``source``): rank ``r`` of the new job reads
saved rank ``r mod old world size``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agent.format.sharding import Block, assemble


@dataclass(frozen=True)
class Shards:
    """Every saved rank's block of one tensor."""

    blocks: tuple[Block, ...]


Saved = Block | Shards


def is_sharded(value: object) -> bool:
    return isinstance(value, Block | Shards)


def place(saved: Saved, like: torch.Tensor) -> torch.Tensor:
    """The tensor to load where ``like`` lives: a DTensor laid out like it (this rank's
    block of the saved whole), or the whole tensor when ``like`` is not sharded."""
    blocks = saved.blocks if isinstance(saved, Shards) else (saved,)
    shape = blocks[0].shape
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(like, DTensor):
        return assemble(blocks, shape=shape, offset=(0,) * len(shape), size=shape)
    size, offset = compute_local_shape_and_global_offset(
        like.shape, like.device_mesh, like.placements
    )
    first = blocks[0]
    if len(blocks) == 1 and first.offset == tuple(offset) and tuple(first.data.shape) == size:
        data = first.data  # this rank's own block: read in place
    else:
        data = assemble(blocks, shape=tuple(like.shape), offset=offset, size=size)
    local = data.to(device=like.to_local().device)
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def place_all(saved: Mapping[Any, Any], live: Callable[[Any], torch.Tensor]) -> dict[Any, Any]:
    """``saved`` with each sharded value placed like ``live(key)``."""
    return {
        key: place(value, live(key)) if is_sharded(value) else value for key, value in saved.items()
    }


def merge(states: Sequence[Any], *, source: int) -> Any:
    """One state from the states every saved rank holds: each sharded tensor gathers every
    rank's block; everything else is ``states[source]``'s."""
    chosen = states[source]
    if isinstance(chosen, Block):
        blocks = tuple(state for state in states if isinstance(state, Block))
        return Shards(blocks) if len(blocks) == len(states) else chosen
    if isinstance(chosen, dict) and all(isinstance(state, dict) for state in states):
        return {
            key: merge([state[key] for state in states], source=source)
            if all(key in state for state in states)
            else value
            for key, value in chosen.items()
        }
    if isinstance(chosen, list | tuple) and all(
        type(state) is type(chosen) and len(state) == len(chosen) for state in states
    ):
        items = [merge([state[i] for state in states], source=source) for i in range(len(chosen))]
        return type(chosen)(items)
    return chosen
