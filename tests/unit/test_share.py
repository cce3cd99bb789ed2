"""How a replicated (DDP) layer's blobs are split among the ranks: pure logic."""

from __future__ import annotations

from agent.save.upload import Share, blobs_alike


def test_blobs_alike_compares_position_by_position() -> None:
    assert blobs_alike([["a", "b", "c"], ["a", "x", "c"], ["a", "b", "c"]]) == [True, False, True]
    assert blobs_alike([["a"]]) == [True]


def test_layouts_of_different_lengths_share_nothing() -> None:
    assert blobs_alike([["a", "b"], ["a"]]) == [False, False]


def test_owners_balance_the_bytes_largest_first_and_every_rank_agrees() -> None:
    sizes = [10, 70, 30, 40, 20]
    splits = [Share(rank=r, world_size=2, alike=blobs_alike).owners(sizes) for r in range(2)]
    assert splits[0] == splits[1]  # each rank computes the same split
    loads = [
        sum(size for size, owner in zip(sizes, splits[0], strict=True) if owner == r)
        for r in (0, 1)
    ]
    assert sorted(loads) == [80, 90]
    assert splits[0][1] == 0  # the largest goes first, to rank 0


def test_loads_carry_over_between_layers_of_one_save() -> None:
    share = Share(rank=0, world_size=2, alike=blobs_alike)
    assert share.owners([100]) == [0]
    assert share.owners([10, 10]) == [1, 1]
