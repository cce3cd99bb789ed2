"""Shards of a tensor that several ranks hold: how to find and assemble any block of it.

A sharded tensor (a ``DTensor``: FSDP2's parameters and their optimizer state) is saved by
each rank as its local block with the block's place in the whole: the global ``shape`` and
the block's ``offset`` (one per dimension). Restoring to the same mesh, each rank reads its
own block back; restoring to another world size, each rank needs the block the new mesh
gives it, which may span several saved blocks: ``assemble`` cuts it out of them.

Pure: tensors in, tensors out; no I/O, no process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Block:
    """One rank's block of a tensor whose global shape is ``shape``."""

    shape: tuple[int, ...]  # of the whole tensor
    offset: tuple[int, ...]  # where the block starts, per dimension
    data: torch.Tensor  # the block itself

    def __post_init__(self) -> None:
        if not (len(self.shape) == len(self.offset) == self.data.dim()):
            raise ValueError(
                f"a block of a {len(self.shape)}-d tensor needs {len(self.shape)} offsets and a "
                f"{len(self.shape)}-d block, not {len(self.offset)} and {self.data.dim()}"
            )
        for size, start, length in zip(self.shape, self.offset, self.data.shape, strict=True):
            if start < 0 or start + length > size:
                raise ValueError(
                    f"a block at {self.offset} of shape {tuple(self.data.shape)} does not fit "
                    f"in a tensor of shape {self.shape}"
                )

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(start + n for start, n in zip(self.offset, self.data.shape, strict=True))


def assemble(
    blocks: Iterable[Block], *, shape: Sequence[int], offset: Sequence[int], size: Sequence[int]
) -> torch.Tensor:
    """The block of ``size`` at ``offset`` of the tensor of ``shape``, cut out of ``blocks``.

    Raises:
        ValueError: the blocks disagree on the tensor's shape or dtype, or leave part of the
            wanted block uncovered.
    """
    blocks = list(blocks)
    shape, offset, size = tuple(shape), tuple(offset), tuple(size)
    if not blocks:
        raise ValueError("no saved block to assemble from")
    if any(block.shape != shape for block in blocks):
        found = sorted({block.shape for block in blocks})
        raise ValueError(f"the saved blocks are of tensors of shapes {found}, not {shape}")
    if len({block.data.dtype for block in blocks}) != 1:
        raise ValueError("the saved blocks have different dtypes")
    wanted = Block(shape=shape, offset=offset, data=torch.empty(size, dtype=blocks[0].data.dtype))
    covered = torch.zeros(size, dtype=torch.bool)
    for block in blocks:
        overlap = _overlap(block, wanted)
        if overlap is None:
            continue
        source, target = overlap
        wanted.data[target] = block.data[source]
        covered[target] = True
    if not bool(covered.all()):
        raise ValueError(
            f"the saved blocks do not cover the block of size {size} at {offset} of a tensor "
            f"of shape {shape}: a rank's block is missing"
        )
    return wanted.data


def _overlap(block: Block, wanted: Block) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where ``block`` and ``wanted`` overlap: slices into each, or None."""
    source, target = [], []
    for start, end, want_start, want_end in zip(
        block.offset, block.end, wanted.offset, wanted.end, strict=True
    ):
        low, high = max(start, want_start), min(end, want_end)
        if low >= high:
            return None
        source.append(slice(low - start, high - start))
        target.append(slice(low - want_start, high - want_start))
    return tuple(source), tuple(target)
