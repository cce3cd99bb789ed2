"""Blob planning: a pure function from a payload's spans to blob ranges."""

from __future__ import annotations

import hashlib
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.format import payload
from agent.format.chunking import plan_blobs


def spans_of(header: int, sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive spans: a header of ``header`` bytes, then tensors of ``sizes`` bytes."""
    spans = [(0, header)]
    for size in sizes:
        begin = spans[-1][1]
        spans.append((begin, begin + size))
    return spans


def test_small_tensors_are_grouped_and_large_ones_cut_from_their_start() -> None:
    spans = [(0, 16), (16, 20), (20, 30), (30, 100), (100, 104)]

    assert plan_blobs(spans, blob_bytes=32) == [
        (0, 16),
        (16, 30),
        (30, 62),
        (62, 94),
        (94, 100),
        (100, 104),
    ]


def test_a_group_closes_when_the_next_tensor_does_not_fit() -> None:
    assert plan_blobs(spans_of(8, [10, 10, 10, 3]), blob_bytes=20) == [
        (0, 8),
        (8, 28),
        (28, 41),
    ]


def test_a_tensor_of_exactly_blob_bytes_is_one_blob() -> None:
    assert plan_blobs(spans_of(8, [5, 10]), blob_bytes=10) == [(0, 8), (8, 13), (13, 23)]


def test_tensors_of_group_bytes_or_more_get_blobs_of_their_own() -> None:
    # A frozen tensor between two that change keeps its own blob, hence its hash.
    assert plan_blobs(spans_of(8, [2, 4, 2, 3, 1]), blob_bytes=100, group_bytes=4) == [
        (0, 8),
        (8, 10),
        (10, 14),
        (14, 20),
    ]


def test_the_header_is_alone_even_when_everything_would_fit() -> None:
    assert plan_blobs(spans_of(8, [1, 1]), blob_bytes=1 << 20) == [(0, 8), (8, 10)]


def test_an_oversized_header_stays_whole() -> None:
    assert plan_blobs(spans_of(100, [5, 5]), blob_bytes=10) == [(0, 100), (100, 110)]


def test_a_header_only_payload_is_one_blob() -> None:
    assert plan_blobs([(0, 64)], blob_bytes=8) == [(0, 64)]
    assert plan_blobs(spans_of(64, [0, 0]), blob_bytes=8) == [(0, 64)]


def test_no_spans_no_blobs() -> None:
    assert plan_blobs([], blob_bytes=1) == []


@pytest.mark.parametrize("blob_bytes", [0, -1])
def test_blob_bytes_must_be_positive(blob_bytes: int) -> None:
    with pytest.raises(ValueError, match="blob_bytes"):
        plan_blobs(spans_of(8, [1]), blob_bytes=blob_bytes)


headers = st.integers(8, 200)
sizes = st.lists(st.integers(0, 300), max_size=12)
limits = st.integers(1, 128)


@settings(database=None, deadline=None, max_examples=300)
@given(headers, sizes, limits)
def test_blobs_cover_the_payload_contiguously(header: int, tensors: list[int], limit: int) -> None:
    spans = spans_of(header, tensors)

    blobs = plan_blobs(spans, blob_bytes=limit)

    assert blobs[0] == (0, header)
    assert blobs[-1][1] == spans[-1][1]
    assert all(end > begin for begin, end in blobs)
    assert all(left[1] == right[0] for left, right in itertools.pairwise(blobs))
    assert all(end - begin <= limit for begin, end in blobs[1:])


@settings(database=None, deadline=None, max_examples=300)
@given(headers, sizes, limits)
def test_tensors_split_only_when_they_must(header: int, tensors: list[int], limit: int) -> None:
    spans = spans_of(header, tensors)
    blobs = plan_blobs(spans, blob_bytes=limit)
    starts = {begin for begin, _ in blobs}

    for begin, end in spans[1:]:
        if end - begin > limit:
            inside = [blob for blob in blobs if begin <= blob[0] < end]
            expected = [(lo, min(lo + limit, end)) for lo in range(begin, end, limit)]
            assert inside == expected
            assert end in starts or end == spans[-1][1]
        elif end > begin:
            assert any(lo <= begin and end <= hi for lo, hi in blobs), (begin, end)


@settings(database=None, deadline=None, max_examples=200)
@given(headers, sizes, st.integers(2, 300), st.integers(0, 50), st.data())
def test_a_large_tensor_is_cut_the_same_wherever_it_lies(
    header: int, before: list[int], large: int, shift: int, data: st.DataObject
) -> None:
    limit = data.draw(st.integers(1, large - 1))

    def cuts(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        begin = spans[-1][0]
        blobs = plan_blobs(spans, blob_bytes=limit)
        return [(lo - begin, hi - begin) for lo, hi in blobs if lo >= begin]

    first = cuts(spans_of(header, [*before, large]))
    second = cuts(spans_of(header + shift, [shift, *before, large]))

    assert first == second
    assert first[0] == (0, limit)


def blob_hashes(tensors: dict[str, torch.Tensor], *, blob_bytes: int) -> list[tuple[int, str]]:
    plan = payload.layout({"names": list(tensors)}, tensors)
    return [
        (begin, hashlib.sha256(b"".join(plan.pieces(begin, end))).hexdigest())
        for begin, end in plan_blobs(plan.spans(), blob_bytes=blob_bytes)
    ]


def test_only_the_blobs_of_a_changed_tensor_change() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "frozen_a": torch.randn(300, generator=generator),  # 1200 bytes: cut in 3
        "small_1": torch.randn(20, generator=generator),
        "small_2": torch.randn(20, generator=generator),
        "trained": torch.randn(200, generator=generator),  # 800 bytes: cut in 2
        "frozen_b": torch.randn(150, generator=generator),
    }
    before = blob_hashes(tensors, blob_bytes=512)
    plan = payload.layout({"names": list(tensors)}, tensors)
    trained_span = plan.spans()[4]

    tensors["trained"] = tensors["trained"] + 1
    after = blob_hashes(tensors, blob_bytes=512)

    assert [begin for begin, _ in before] == [begin for begin, _ in after]
    changed = {begin for (begin, old), (_, new) in zip(before, after, strict=True) if old != new}
    assert changed == {trained_span[0], trained_span[0] + 512}


def test_a_large_tensor_keeps_its_blobs_when_a_neighbour_grows() -> None:
    frozen = torch.arange(1000, dtype=torch.float32)

    def frozen_blobs(neighbour: int) -> set[str]:
        tensors = {"head": torch.zeros(neighbour), "frozen": frozen}
        return {digest for _, digest in blob_hashes(tensors, blob_bytes=1024)}

    shared = frozen_blobs(3) & frozen_blobs(50)

    assert len(shared) == 4  # 4000 bytes in 1024-byte cuts: all four blobs are reused
