"""Payloads: safetensors-compatible bytes, byte-range pieces, and a distrustful header parser."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from agent.format import payload, skeleton
from agent.format.payload import SKELETON_KEY, Header, PayloadLayout
from agent.format.skeleton import JSON
from ckpt.core.contract import TensorEntry
from ckpt.core.errors import BundleFormatError, UnrepresentableStateError


def full_bytes(plan: PayloadLayout) -> bytes:
    return b"".join(plan.pieces(0, plan.size))


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=generator)
    return {
        "f32": base,
        "f64": torch.randn(3, generator=generator, dtype=torch.float64),
        "f16": torch.randn(2, 2, generator=generator).half(),
        "bf16": torch.randn(5, generator=generator).bfloat16(),
        "f8": torch.randn(3, generator=generator).to(torch.float8_e5m2),
        "bool": torch.tensor([True, False, True]),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i64": torch.tensor([-(2**63), 2**63 - 1]),
        "u16": torch.tensor([0, 65535], dtype=torch.uint16),
        "u32": torch.tensor([[0, 1, 2**32 - 1]], dtype=torch.uint32),
        "u64": torch.tensor([2**64 - 1], dtype=torch.uint64),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),  # not contiguous
        "row": base[2],  # a view with a storage offset
    }


def bit_equal(left: torch.Tensor, right: torch.Tensor) -> bool:
    if left.dtype != right.dtype or left.shape != right.shape:
        return False
    if left.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.equal(left.view(torch.uint8), right.view(torch.uint8))
    return torch.equal(left, right)


SKELETON: JSON = {"model": {"$tensor": "f32"}, "note": "hello", "n": [1, 2.5, None]}


def test_payload_is_read_by_safetensors(tmp_path: Path) -> None:
    tensors = sample_tensors()
    plan = payload.layout(SKELETON, tensors)
    path = tmp_path / "layer.safetensors"
    path.write_bytes(full_bytes(plan))

    with safe_open(str(path), framework="pt") as reader:
        names = set(reader.keys())
        loaded = {name: reader.get_tensor(name) for name in names}
        metadata = reader.metadata()

    assert names == set(tensors)
    for name, tensor in tensors.items():
        assert bit_equal(loaded[name], tensor), name
    assert json.loads(metadata[SKELETON_KEY]) == SKELETON


def test_layout_size_and_spans_describe_the_bytes() -> None:
    tensors = sample_tensors()
    plan = payload.layout(SKELETON, tensors)
    data = full_bytes(plan)
    spans = plan.spans()

    assert len(data) == plan.size
    assert len(plan.header) % 8 == 0
    assert spans[0] == (0, len(plan.header))
    assert [end for _, end in spans[:-1]] == [begin for begin, _ in spans[1:]]
    assert spans[-1][1] == plan.size
    assert sorted(name for name, _ in plan.tensors) == sorted(tensors)
    for (name, tensor), (begin, end) in zip(plan.tensors, spans[1:], strict=True):
        assert end - begin == tensor.numel() * tensor.element_size(), name
        # Widest dtypes first: each tensor is aligned to its element size in the payload.
        assert begin % tensor.element_size() == 0, name


def test_pieces_are_zero_copy_views_of_the_tensors() -> None:
    tensor = torch.zeros(4, dtype=torch.int32)
    plan = payload.layout({}, {"t": tensor})

    tensor[0] = 0x01020304

    data = full_bytes(plan)
    assert all(isinstance(piece, memoryview) for piece in plan.pieces(0, plan.size))
    assert data[len(plan.header) : len(plan.header) + 4] == (0x01020304).to_bytes(4, "little")


PLAN = payload.layout(SKELETON, sample_tensors())
FULL = full_bytes(PLAN)


@settings(database=None, deadline=None, max_examples=300)
@given(st.integers(0, PLAN.size + 16), st.integers(0, PLAN.size + 16))
def test_pieces_of_any_range_are_that_slice(start: int, end: int) -> None:
    pieces = list(PLAN.pieces(start, end))

    assert b"".join(pieces) == FULL[start:end]
    assert all(len(piece) > 0 for piece in pieces)


@settings(database=None, deadline=None, max_examples=100)
@given(st.integers(0, 200), st.integers(0, 200), st.integers(1, 64))
def test_device_pieces_copy_any_range_in_bounded_pieces(start: int, end: int, piece: int) -> None:
    # The path of a GPU tensor read in place (over the staging budget), run on a CPU tensor.
    data = torch.arange(200, dtype=torch.int16).view(torch.uint8)[:200]
    original = payload.DEVICE_PIECE_BYTES
    payload.DEVICE_PIECE_BYTES = piece
    try:
        pieces = list(payload.device_pieces(data, start, end))
    finally:
        payload.DEVICE_PIECE_BYTES = original
    assert b"".join(pieces) == bytes(data.numpy())[start:end]
    assert all(0 < len(p) <= piece for p in pieces)


def test_layout_refuses_dtypes_without_a_safetensors_code() -> None:
    with pytest.raises(UnrepresentableStateError, match=r"^weights/z: .*complex64"):
        payload.layout({}, {"weights/z": torch.zeros(2, dtype=torch.complex64)})


def test_parse_header_reads_back_the_layout() -> None:
    header = payload.parse_header(memoryview(FULL))

    assert header.size == len(PLAN.header)
    assert header.skeleton == SKELETON
    assert header.index == PLAN.index


def read_back(raw: bytes, *, chunk: int | None = None) -> tuple[dict[str, torch.Tensor], Header]:
    """Parse a payload's header, allocate its tensors and scatter its bytes into them."""
    header = payload.parse_header(memoryview(raw))
    target = payload.allocate(header.index, header_bytes=header.size)
    step = chunk or len(raw) or 1
    for start in range(0, len(raw), step):
        payload.scatter(target, start, memoryview(raw)[start : start + step])
    assert bytes(target.header) == raw[: header.size]
    return dict(target.tensors), header


def test_read_back_round_trip() -> None:
    tensors = sample_tensors()
    result, _ = read_back(full_bytes(payload.layout(SKELETON, tensors)))

    assert set(result) == set(tensors)
    for name, tensor in tensors.items():
        assert bit_equal(result[name], tensor), name


@settings(database=None, deadline=None, max_examples=50)
@given(st.integers(1, 97))
def test_scatter_in_any_chunks_rebuilds_the_tensors(chunk: int) -> None:
    tensors = sample_tensors()
    result, _ = read_back(full_bytes(payload.layout(SKELETON, tensors)), chunk=chunk)
    for name, tensor in tensors.items():
        assert bit_equal(result[name], tensor), name


def test_allocated_tensors_own_their_memory() -> None:
    raw = full_bytes(payload.layout({}, {"a": torch.zeros(3), "b": torch.ones(5)}))
    result, _ = read_back(raw)
    assert all(t.storage_offset() == 0 and t.is_contiguous() for t in result.values())
    assert result["a"].untyped_storage().data_ptr() != result["b"].untyped_storage().data_ptr()


def test_allocate_refuses_an_inconsistent_index() -> None:
    index = {"a": TensorEntry(dtype="F32", shape=(2,), data_offsets=(0, 4))}
    with pytest.raises(BundleFormatError):
        payload.allocate(index, header_bytes=8)


dtypes = st.sampled_from(
    [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int32, torch.uint8, torch.bool]
)
tensor_specs = st.lists(
    st.tuples(dtypes, st.lists(st.integers(0, 4), max_size=3)), min_size=0, max_size=6
)


@settings(database=None, deadline=None, max_examples=100)
@given(tensor_specs, st.integers(0, 2**32 - 1))
def test_any_tensor_mix_round_trips(specs: list[tuple[torch.dtype, list[int]]], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"t{i}": torch.randint(0, 2, shape, generator=generator).to(dtype)
        if dtype == torch.bool
        else torch.randint(-100, 100, shape, generator=generator).to(dtype)
        for i, (dtype, shape) in enumerate(specs)
    }
    state, named = skeleton.encode(list(tensors.values()))
    tensors_back, header = read_back(full_bytes(payload.layout(state, named)))
    result = skeleton.decode(header.skeleton, tensors_back)

    assert len(result) == len(tensors)
    for got, expected in zip(result, tensors.values(), strict=True):
        assert bit_equal(got, expected)


def craft(header: object, data: bytes = b"", *, raw: bytes | None = None) -> memoryview:
    """A payload with a hand-written header (``raw`` bypasses JSON encoding)."""
    text = raw if raw is not None else json.dumps(header).encode()
    return memoryview(struct.pack("<Q", len(text)) + text + data)


def meta(skeleton_value: JSON = None) -> dict[str, str]:
    return {SKELETON_KEY: json.dumps(skeleton_value)}


def f32(begin: int, end: int, *shape: int) -> dict[str, object]:
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}


def test_craft_builds_a_valid_payload() -> None:
    header = payload.parse_header(
        craft({"__metadata__": meta([1]), "a": f32(0, 8, 2), "b": f32(8, 12, 1)}, bytes(12))
    )

    assert header.skeleton == [1]
    assert set(header.index) == {"a", "b"}


@pytest.mark.parametrize(
    "bad",
    [
        memoryview(b""),
        memoryview(b"\x05\x00\x00"),
        memoryview(struct.pack("<Q", 100) + b"{}"),
        memoryview(struct.pack("<Q", 1 << 40)),
        craft({"__metadata__": meta(), "a": f32(0, 8, 2)}, bytes(7)),  # data truncated
    ],
    ids=["empty", "short-prefix", "short-header", "huge-header", "short-data"],
)
def test_parse_header_rejects_truncated_payloads(bad: memoryview) -> None:
    with pytest.raises(BundleFormatError):
        payload.parse_header(bad)


def test_parse_header_rejects_a_truncated_real_payload() -> None:
    for cut in (1, len(FULL) - len(PLAN.header), len(FULL) - 4):
        with pytest.raises(BundleFormatError):
            payload.parse_header(memoryview(FULL[:-cut]))


@pytest.mark.parametrize(
    ("entries", "data_size"),
    [
        ({"a": f32(0, 8, 2), "b": f32(4, 12, 2)}, 12),  # overlap
        ({"a": f32(0, 8, 2), "b": f32(12, 20, 2)}, 20),  # gap
        ({"a": f32(4, 12, 2)}, 12),  # does not start at 0
        ({"a": f32(0, 8, 2)}, 12),  # trailing bytes
        ({"a": f32(0, 8, 3)}, 8),  # size does not match shape
        ({"a": f32(0, 8, -1, -2)}, 8),  # negative dimensions
        ({"a": f32(8, 0, 0)}, 0),  # reversed
        ({"a": f32(0, 8, 2), "b": f32(0, 8, 2)}, 8),  # aliasing
    ],
    ids=["overlap", "gap", "offset", "trailing", "shape", "negative", "reversed", "alias"],
)
def test_parse_header_rejects_inconsistent_offsets(
    entries: dict[str, object], data_size: int
) -> None:
    with pytest.raises(BundleFormatError):
        payload.parse_header(craft({"__metadata__": meta(), **entries}, bytes(data_size)))


@pytest.mark.parametrize("dtype", ["F128", "C64", "f32", "", "O"])
def test_parse_header_rejects_unknown_dtypes(dtype: str) -> None:
    entry = {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}

    with pytest.raises(BundleFormatError, match="dtype"):
        payload.parse_header(craft({"__metadata__": meta(), "a": entry}, bytes(8)))


@pytest.mark.parametrize(
    "bad",
    [
        craft(None, raw=b"{not json"),
        craft(None, raw=b"\xff\xfe\x00\x00"),
        craft([1, 2]),
        craft("text"),
        craft({"a": f32(0, 0, 0)}),  # no __metadata__
        craft({"__metadata__": {}}),  # no skeleton
        craft({"__metadata__": "flat"}),
        craft({"__metadata__": {SKELETON_KEY: "{broken"}}),
        craft({"__metadata__": meta(), "a": {"dtype": "F32"}}),
        craft({"__metadata__": meta(), "a": {**f32(0, 0, 0), "extra": 1}}),
        craft({"__metadata__": meta(), "a": "entry"}),
    ],
    ids=[
        "not-json",
        "not-utf8",
        "list",
        "string",
        "no-metadata",
        "no-skeleton",
        "metadata-string",
        "skeleton-not-json",
        "entry-missing-fields",
        "entry-extra-field",
        "entry-string",
    ],
)
def test_parse_header_rejects_malformed_headers(bad: memoryview) -> None:
    with pytest.raises(BundleFormatError):
        payload.parse_header(bad)


def test_unaligned_tensors_from_other_writers_are_read() -> None:
    header_json = json.dumps(
        {
            "__metadata__": {SKELETON_KEY: "{}"},
            "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
        }
    ).encode()
    data = bytes([7]) + torch.tensor([1.5, -2.0]).numpy().tobytes()
    raw = len(header_json).to_bytes(8, "little") + header_json + data
    result, _ = read_back(raw)

    assert result["a"].tolist() == [7]
    assert result["b"].tolist() == [1.5, -2.0]
