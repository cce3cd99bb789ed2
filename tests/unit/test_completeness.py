"""What a bundle lacks before it may become complete: ``service.completeness``."""

from __future__ import annotations

import hashlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.core.contract import RESTORE_ORDER, BlobRef, Layer, LayerRecord, TensorEntry
from service.completeness import (
    BadBlob,
    BlobProblem,
    Missing,
    Part,
    StoredBlob,
    missing,
    missing_layers,
)

Key = tuple[int, Layer]

ALL_LAYERS = list(RESTORE_ORDER)


def sha(tag: str) -> str:
    return hashlib.sha256(tag.encode()).hexdigest()


def record(header: BlobRef, *data: BlobRef) -> LayerRecord:
    """A valid record: ``header`` alone in the first blob, one tensor spanning ``data``."""
    data_bytes = sum(blob.size for blob in data)
    return LayerRecord(
        payload_bytes=header.size + data_bytes,
        header_bytes=header.size,
        blobs=(header, *data),
        tensors={"t": TensorEntry(dtype="U8", shape=(data_bytes,), data_offsets=(0, data_bytes))},
    )


def header_of(rank: int, layer: Layer) -> BlobRef:
    return BlobRef(sha256=sha(f"header-{rank}-{layer}"), size=40 + rank)


def data_of(rank: int, layer: Layer) -> BlobRef:
    return BlobRef(sha256=sha(f"data-{rank}-{layer}"), size=100 + 7 * rank + len(layer))


def bundle(world_size: int) -> dict[Key, LayerRecord]:
    """Every (rank, layer) of a ``world_size`` bundle, each with its own two blobs."""
    return {
        (rank, layer): record(header_of(rank, layer), data_of(rank, layer))
        for rank in range(world_size)
        for layer in RESTORE_ORDER
    }


def all_stored(recorded: dict[Key, LayerRecord]) -> dict[str, StoredBlob]:
    """The store holding every referenced blob at its recorded size (hash not re-read)."""
    return {
        blob.sha256: StoredBlob(size=blob.size)
        for layer_record in recorded.values()
        for blob in layer_record.blobs
    }


def parts(*keys: Key) -> list[Part]:
    return [Part(rank=rank, layer=layer) for rank, layer in keys]


def test_the_helpers_build_valid_records() -> None:
    # The fixture itself must be what the contract accepts, or every test below is moot.
    layer_record = record(header_of(0, Layer.WEIGHTS), data_of(0, Layer.WEIGHTS))
    assert layer_record.blobs[0].size == layer_record.header_bytes
    assert layer_record.payload_bytes == sum(blob.size for blob in layer_record.blobs)
    with pytest.raises(ValueError, match="first blob"):
        LayerRecord(
            payload_bytes=10,
            header_bytes=4,
            blobs=(BlobRef(sha256=sha("x"), size=10),),
            tensors={"t": TensorEntry(dtype="U8", shape=(6,), data_offsets=(0, 6))},
        )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_complete_bundle_lacks_nothing(world_size: int) -> None:
    recorded = bundle(world_size)
    result = missing(world_size=world_size, recorded=recorded, stored=all_stored(recorded))
    assert result == Missing()
    assert result.ranks == []
    assert result.layers == []
    assert result.blobs == []
    assert not result


@pytest.mark.parametrize(
    ("world_size", "gone"),
    [
        (world_size, (rank, layer))
        for world_size in range(1, 5)
        for rank in range(world_size)
        for layer in RESTORE_ORDER
    ],
)
def test_each_missing_layer_is_reported_alone(world_size: int, gone: Key) -> None:
    recorded = bundle(world_size)
    del recorded[gone]
    result = missing(world_size=world_size, recorded=recorded, stored=all_stored(recorded))
    assert result.layers == parts(gone)
    assert result.ranks == []  # the rank recorded its other five layers
    assert result.blobs == []
    assert result


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_whole_missing_rank_is_listed_with_its_six_layers(world_size: int) -> None:
    gone_rank = world_size - 1
    recorded = {key: value for key, value in bundle(world_size).items() if key[0] != gone_rank}
    result = missing(world_size=world_size, recorded=recorded, stored=all_stored(recorded))
    assert result.ranks == [gone_rank]
    assert result.layers == parts(*((gone_rank, layer) for layer in RESTORE_ORDER))
    assert result.blobs == []
    assert result


def test_several_missing_ranks_and_layers_in_rank_then_restore_order() -> None:
    recorded = bundle(4)
    for key in [(3, Layer.COUNTERS), (1, Layer.WEIGHTS), (3, Layer.OPTIMIZER)]:
        del recorded[key]
    for layer in RESTORE_ORDER:
        del recorded[(0, layer)]
        del recorded[(2, layer)]
    result = missing(world_size=4, recorded=recorded, stored=all_stored(recorded))
    assert result.ranks == [0, 2]
    assert result.layers == [
        *parts(*((0, layer) for layer in RESTORE_ORDER)),
        *parts((1, Layer.WEIGHTS)),
        *parts(*((2, layer) for layer in RESTORE_ORDER)),
        *parts((3, Layer.OPTIMIZER), (3, Layer.COUNTERS)),
    ]


def test_nothing_recorded_means_every_rank_and_layer_is_missing() -> None:
    result = missing(world_size=3, recorded={}, stored={})
    assert result.ranks == [0, 1, 2]
    assert result.layers == parts(*((rank, layer) for rank in range(3) for layer in RESTORE_ORDER))
    assert result.blobs == []
    assert result


def test_a_rank_with_one_layer_is_not_a_missing_rank() -> None:
    recorded = {key: value for key, value in bundle(2).items() if key == (1, Layer.RNG)}
    recorded.update({key: value for key, value in bundle(2).items() if key[0] == 0})
    result = missing(world_size=2, recorded=recorded, stored=all_stored(recorded))
    assert result.ranks == []
    assert result.layers == parts(*((1, layer) for layer in RESTORE_ORDER if layer != Layer.RNG))


@pytest.mark.parametrize(
    ("found", "problem"),
    [
        (None, BlobProblem.ABSENT),
        (StoredBlob(size=None), BlobProblem.ABSENT),
        (StoredBlob(size=99), BlobProblem.WRONG_SIZE),
        (StoredBlob(size=0), BlobProblem.WRONG_SIZE),
        (StoredBlob(size=99, sha256_ok=False), BlobProblem.WRONG_SIZE),  # size is checked first
        (StoredBlob(size=None, sha256_ok=False), BlobProblem.ABSENT),
        (StoredBlob(size=123, sha256_ok=False), BlobProblem.WRONG_HASH),
        # Run isolation: not written by the committing run, whatever the store holds.
        (StoredBlob(size=None, written=False), BlobProblem.NOT_WRITTEN),
        (StoredBlob(size=123, sha256_ok=True, written=False), BlobProblem.NOT_WRITTEN),
        (StoredBlob(size=123, written=True), None),
    ],
)
def test_a_bad_blob_is_reported_with_its_problem_and_sizes(
    found: StoredBlob | None, problem: BlobProblem | None
) -> None:
    recorded = bundle(2)
    bad = BlobRef(sha256=sha("bad"), size=123)
    recorded[(1, Layer.DATA)] = record(header_of(1, Layer.DATA), bad)
    stored = all_stored(recorded)
    del stored[bad.sha256]
    if found is not None:
        stored[bad.sha256] = found
    result = missing(world_size=2, recorded=recorded, stored=stored)
    assert result.layers == []
    assert result.ranks == []
    if problem is None:
        assert not result
        return
    assert result.blobs == [
        BadBlob(
            sha256=bad.sha256,
            size=123,
            problem=problem,
            found_size=None if found is None else found.size,
            used_by=parts((1, Layer.DATA)),
        )
    ]
    assert result  # a bad blob alone keeps the bundle incomplete


@pytest.mark.parametrize("verified", [None, True])
def test_a_blob_of_the_right_size_whose_hash_is_not_known_bad_is_fine(
    verified: bool | None,
) -> None:
    recorded = bundle(1)
    stored = {
        key: StoredBlob(size=value.size, sha256_ok=verified)
        for key, value in all_stored(recorded).items()
    }
    result = missing(world_size=1, recorded=recorded, stored=stored)
    assert result.blobs == []
    assert not result


def test_unreferenced_bad_blobs_in_the_store_do_not_matter() -> None:
    recorded = bundle(1)
    stored = all_stored(recorded)
    stored[sha("stray")] = StoredBlob(size=5, sha256_ok=False)
    assert not missing(world_size=1, recorded=recorded, stored=stored)


def test_a_shared_bad_blob_is_listed_once_with_every_user() -> None:
    shared = BlobRef(sha256=sha("shared"), size=64)
    users = [(0, Layer.WEIGHTS), (0, Layer.OPTIMIZER), (2, Layer.WEIGHTS), (3, Layer.COUNTERS)]
    recorded = bundle(4)
    for rank, layer in users:
        recorded[(rank, layer)] = record(header_of(rank, layer), data_of(rank, layer), shared)
    # One layer references it twice (two identical chunks): still one user entry.
    recorded[(1, Layer.RNG)] = record(header_of(1, Layer.RNG), shared, shared)
    users.append((1, Layer.RNG))
    stored = all_stored(recorded)
    stored[shared.sha256] = StoredBlob(size=64, sha256_ok=False)
    result = missing(world_size=4, recorded=recorded, stored=stored)
    assert len(result.blobs) == 1
    (bad,) = result.blobs
    assert bad.sha256 == shared.sha256
    assert bad.problem == BlobProblem.WRONG_HASH
    assert bad.size == 64
    assert bad.found_size == 64
    used_by = [(part.rank, part.layer) for part in bad.used_by]
    assert len(used_by) == len(set(used_by)), "a user is listed twice"
    assert sorted(used_by) == sorted(users)
    assert [rank for rank, _ in used_by] == sorted(rank for rank, _ in used_by)


def test_every_bad_blob_is_listed_once_sorted_by_sha256() -> None:
    recorded = bundle(3)
    absent = recorded[(0, Layer.WEIGHTS)].blobs[1]
    short = recorded[(1, Layer.SCHEDULER)].blobs[0]
    corrupt = recorded[(2, Layer.COUNTERS)].blobs[1]
    stored = all_stored(recorded)
    del stored[absent.sha256]
    stored[short.sha256] = StoredBlob(size=short.size - 1)
    stored[corrupt.sha256] = StoredBlob(size=corrupt.size, sha256_ok=False)
    result = missing(world_size=3, recorded=recorded, stored=stored)
    expected = sorted(
        [
            BadBlob(
                sha256=absent.sha256,
                size=absent.size,
                problem=BlobProblem.ABSENT,
                found_size=None,
                used_by=parts((0, Layer.WEIGHTS)),
            ),
            BadBlob(
                sha256=short.sha256,
                size=short.size,
                problem=BlobProblem.WRONG_SIZE,
                found_size=short.size - 1,
                used_by=parts((1, Layer.SCHEDULER)),
            ),
            BadBlob(
                sha256=corrupt.sha256,
                size=corrupt.size,
                problem=BlobProblem.WRONG_HASH,
                found_size=corrupt.size,
                used_by=parts((2, Layer.COUNTERS)),
            ),
        ],
        key=lambda blob: blob.sha256,
    )
    assert result.blobs == expected
    assert result.layers == []


def test_missing_layers_and_bad_blobs_are_reported_together() -> None:
    recorded = bundle(2)
    del recorded[(1, Layer.DATA)]
    stored = all_stored(recorded)
    gone = recorded[(0, Layer.RNG)].blobs[0]
    del stored[gone.sha256]
    result = missing(world_size=2, recorded=recorded, stored=stored)
    assert result.layers == parts((1, Layer.DATA))
    assert [(blob.sha256, blob.problem) for blob in result.blobs] == [
        (gone.sha256, BlobProblem.ABSENT)
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_missing_layers_of_nothing_recorded_is_every_part_in_order(world_size: int) -> None:
    assert missing_layers(world_size=world_size, recorded=set()) == [
        Part(rank=rank, layer=layer) for rank in range(world_size) for layer in RESTORE_ORDER
    ]
    everything = set(itertools.product(range(world_size), RESTORE_ORDER))
    assert missing_layers(world_size=world_size, recorded=everything) == []


def test_missing_layers_ignores_ranks_beyond_the_world() -> None:
    recorded = set(itertools.product(range(2), RESTORE_ORDER)) | {(5, Layer.WEIGHTS)}
    assert missing_layers(world_size=2, recorded=recorded) == []
    assert missing_layers(world_size=1, recorded={(1, Layer.WEIGHTS)}) == parts(
        *((0, layer) for layer in RESTORE_ORDER)
    )


def test_restore_order_is_not_alphabetical() -> None:
    # Guards the order assertions above: sorting layers by name would give another order.
    assert list(RESTORE_ORDER) != sorted(RESTORE_ORDER, key=str)
    assert missing_layers(world_size=1, recorded=set())[0].layer == Layer.WEIGHTS


@st.composite
def recorded_subsets(draw: st.DrawFn) -> tuple[int, set[Key]]:
    world_size = draw(st.integers(min_value=1, max_value=4))
    every = list(itertools.product(range(world_size), RESTORE_ORDER))
    subset = draw(st.sets(st.sampled_from(every), max_size=len(every)))
    return world_size, subset


@settings(database=None, deadline=None, max_examples=300)
@given(recorded_subsets())
def test_missing_is_exactly_the_complement_in_rank_then_restore_order(
    case: tuple[int, set[Key]],
) -> None:
    world_size, subset = case
    every = bundle(world_size)
    recorded = {key: every[key] for key in subset}
    result = missing(world_size=world_size, recorded=recorded, stored=all_stored(recorded))
    expected = [
        Part(rank=rank, layer=layer)
        for rank in range(world_size)
        for layer in ALL_LAYERS
        if (rank, layer) not in subset
    ]
    assert result.layers == expected
    assert missing_layers(world_size=world_size, recorded=subset) == expected
    assert result.ranks == [
        rank
        for rank in range(world_size)
        if all((rank, layer) not in subset for layer in ALL_LAYERS)
    ]
    assert result.blobs == []
    assert bool(result) == (len(subset) < 6 * world_size)


STORE_STATES = st.sampled_from(["ok", "verified", "absent", "short", "long", "corrupt"])


@settings(database=None, deadline=None, max_examples=200)
@given(
    world_size=st.integers(min_value=1, max_value=4),
    states=st.lists(STORE_STATES, min_size=48, max_size=48),
)
def test_bad_blobs_are_exactly_those_the_store_gets_wrong(
    world_size: int, states: list[str]
) -> None:
    recorded = bundle(world_size)
    blobs = sorted(
        {blob for layer_record in recorded.values() for blob in layer_record.blobs},
        key=lambda blob: blob.sha256,
    )
    stored: dict[str, StoredBlob] = {}
    expected: dict[str, tuple[BlobProblem, int | None]] = {}
    for blob, state in zip(blobs, states, strict=False):
        if state == "ok":
            stored[blob.sha256] = StoredBlob(size=blob.size)
        elif state == "verified":
            stored[blob.sha256] = StoredBlob(size=blob.size, sha256_ok=True)
        elif state == "absent":
            expected[blob.sha256] = (BlobProblem.ABSENT, None)
        elif state == "short":
            stored[blob.sha256] = StoredBlob(size=blob.size - 1, sha256_ok=True)
            expected[blob.sha256] = (BlobProblem.WRONG_SIZE, blob.size - 1)
        elif state == "long":
            stored[blob.sha256] = StoredBlob(size=blob.size + 1)
            expected[blob.sha256] = (BlobProblem.WRONG_SIZE, blob.size + 1)
        else:
            stored[blob.sha256] = StoredBlob(size=blob.size, sha256_ok=False)
            expected[blob.sha256] = (BlobProblem.WRONG_HASH, blob.size)
    result = missing(world_size=world_size, recorded=recorded, stored=stored)
    assert [blob.sha256 for blob in result.blobs] == sorted(expected)
    users = {
        blob.sha256: [key] for key, layer_record in recorded.items() for blob in layer_record.blobs
    }
    for bad in result.blobs:
        assert (bad.problem, bad.found_size) == expected[bad.sha256]
        assert [(part.rank, part.layer) for part in bad.used_by] == users[bad.sha256]
    assert result.layers == []
    assert bool(result) == bool(expected)
