"""Assembling any block of a tensor from the blocks ranks saved (resharding's arithmetic)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.format.sharding import Block, assemble


def row_blocks(tensor: torch.Tensor, parts: int) -> list[Block]:
    """The blocks FSDP2 gives ``parts`` ranks: ``torch.chunk`` along dimension 0."""
    blocks, start = [], 0
    for chunk in torch.chunk(tensor, parts, dim=0):
        offset = (start,) + (0,) * (tensor.dim() - 1)
        blocks.append(Block(shape=tuple(tensor.shape), offset=offset, data=chunk.clone()))
        start += chunk.shape[0]
    return blocks


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 23),
    cols=st.integers(1, 5),
    saved=st.integers(1, 6),
    wanted=st.integers(1, 6),
)
def test_any_world_size_reads_back_what_any_other_saved(
    rows: int, cols: int, saved: int, wanted: int
) -> None:
    whole = torch.randn(rows, cols)
    blocks = row_blocks(whole, saved)
    for target in row_blocks(whole, wanted):
        got = assemble(blocks, shape=whole.shape, offset=target.offset, size=target.data.shape)
        assert torch.equal(got, target.data)


def test_a_block_in_two_dimensions() -> None:
    whole = torch.arange(48.0).reshape(6, 8)
    blocks = [
        Block(shape=(6, 8), offset=(r, c), data=whole[r : r + 3, c : c + 4].clone())
        for r in (0, 3)
        for c in (0, 4)
    ]
    got = assemble(blocks, shape=(6, 8), offset=(2, 3), size=(3, 3))
    assert torch.equal(got, whole[2:5, 3:6])


def test_a_scalar_is_its_own_block() -> None:
    got = assemble(
        [Block(shape=(), offset=(), data=torch.tensor(7.0))], shape=(), offset=(), size=()
    )
    assert got.item() == 7.0


def test_a_missing_rank_is_named_not_filled_with_garbage() -> None:
    whole = torch.randn(8, 2)
    blocks = row_blocks(whole, 4)
    with pytest.raises(ValueError, match="do not cover"):
        assemble(blocks[:3], shape=(8, 2), offset=(0, 0), size=(8, 2))


def test_blocks_of_another_tensor_are_refused() -> None:
    blocks = row_blocks(torch.randn(8, 2), 2)
    with pytest.raises(ValueError, match=r"shapes \[\(8, 2\)\], not \(8, 3\)"):
        assemble(blocks, shape=(8, 3), offset=(0, 0), size=(8, 3))


def test_a_block_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        Block(shape=(4,), offset=(3,), data=torch.zeros(2))
