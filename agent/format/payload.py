"""Safetensors-compatible payloads: one per (rank, layer).

Layout (the safetensors format, so ``safetensors.safe_open`` reads any payload)::

    u64 little-endian N | N bytes of JSON header, space-padded to 8 | tensor data

The header maps tensor names to dtype, shape and ``data_offsets`` (relative to the data
section) and carries ``__metadata__`` with the layer's JSON skeleton. Writing never builds
the payload as one bytes object: ``PayloadLayout.pieces`` yields zero-copy views of the
header and of each tensor's bytes, for any byte range.
"""

from __future__ import annotations

import bisect
import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from agent.format.dtypes import DTYPES, TORCH_DTYPES
from agent.format.skeleton import JSON
from ckpt.core.contract import TensorEntry
from ckpt.core.errors import BundleFormatError, UnrepresentableStateError

SKELETON_KEY = "ckpt.skeleton"
_LENGTH = struct.Struct("<Q")
_MAX_HEADER_BYTES = 1 << 30


DEVICE_PIECE_BYTES = 8 << 20


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def device_pieces(data: torch.Tensor, start: int, end: int) -> Iterator[memoryview]:
    """Bytes ``[start, end)`` of a flat uint8 tensor on a device, copied to host memory
    ``DEVICE_PIECE_BYTES`` at a time (a tensor read in place, over the staging budget)."""
    for lo in range(start, end, DEVICE_PIECE_BYTES):
        yield tensor_bytes(data[lo : min(lo + DEVICE_PIECE_BYTES, end)].cpu())


@dataclass(frozen=True)
class PayloadLayout:
    """Where every byte of a payload lives: the header and each tensor's memory.

    Built by ``layout`` to write a payload from tensors without copying them, and by
    ``allocate`` to read one into fresh tensors.
    """

    header: bytes | bytearray
    tensors: tuple[tuple[str, torch.Tensor], ...]
    index: dict[str, TensorEntry]

    @property
    def size(self) -> int:
        return len(self.header) + self.data_size

    @property
    def data_size(self) -> int:
        return max((entry.data_offsets[1] for entry in self.index.values()), default=0)

    def spans(self) -> list[tuple[int, int]]:
        """Absolute byte ranges: the header, then each tensor in payload order."""
        base = len(self.header)
        ranges = [(0, base)]
        for name, _ in self.tensors:
            begin, end = self.index[name].data_offsets
            ranges.append((base + begin, base + end))
        return ranges

    @cached_property
    def _segments(
        self,
    ) -> tuple[list[tuple[int, int]], list[memoryview | torch.Tensor], list[int]]:
        spans = self.spans()
        views: list[memoryview | torch.Tensor] = [memoryview(self.header)]
        for _, tensor in self.tensors:
            on_cpu = tensor.device.type == "cpu"
            views.append(tensor_bytes(tensor) if on_cpu else tensor.reshape(-1).view(torch.uint8))
        return spans, views, [begin for begin, _ in spans]

    def sources(self, start: int, end: int) -> tuple[tuple[str, int, int], ...]:
        """What bytes ``[start, end)`` hold: ``(tensor name, begin, end)`` within each tensor,
        with ``""`` naming the header."""
        spans, _, starts = self._segments
        names = ["", *(name for name, _ in self.tensors)]
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        found = []
        while i < len(spans) and spans[i][0] < end:
            begin, stop = spans[i]
            lo, hi = max(start, begin), min(end, stop)
            if lo < hi:
                found.append((names[i], lo - begin, hi - begin))
            i += 1
        return tuple(found)

    def pieces(self, start: int, end: int) -> Iterator[memoryview]:
        """Zero-copy views that together are bytes ``[start, end)`` of the payload."""
        spans, views, starts = self._segments
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(spans) and spans[i][0] < end:
            begin, stop = spans[i]
            lo, hi = max(start, begin), min(end, stop)
            if lo < hi:
                view = views[i]
                if isinstance(view, torch.Tensor):  # on a device: through host memory
                    yield from device_pieces(view, lo - begin, hi - begin)
                else:
                    yield view[lo - begin : hi - begin]
            i += 1


def layout(skeleton: JSON, tensors: Mapping[str, torch.Tensor]) -> PayloadLayout:
    """Plan a payload for tensors (made contiguous here if they are not): staged CPU
    buffers, or live tensors read in place.

    Raises:
        UnrepresentableStateError: a tensor's dtype has no safetensors code.
    """
    index: dict[str, TensorEntry] = {}
    ordered: list[tuple[str, torch.Tensor]] = []
    offset = 0
    # Widest dtypes first (a stable sort): every tensor then starts at a multiple of its
    # element size, since safetensors allows no padding between tensors.
    for name, tensor in sorted(tensors.items(), key=lambda item: -item[1].element_size()):
        if name == "__metadata__":
            raise UnrepresentableStateError("a tensor may not be named __metadata__")
        code = DTYPES.get(tensor.dtype)
        if code is None:
            raise UnrepresentableStateError(f"{name}: dtype {tensor.dtype} cannot be stored")
        contiguous = tensor.detach().contiguous()
        nbytes = contiguous.numel() * contiguous.element_size()
        index[name] = TensorEntry(
            dtype=code, shape=tuple(contiguous.shape), data_offsets=(offset, offset + nbytes)
        )
        ordered.append((name, contiguous))
        offset += nbytes
    header_json: dict[str, object] = {
        "__metadata__": {
            SKELETON_KEY: json.dumps(skeleton, separators=(",", ":"), allow_nan=False)
        },
        **{name: entry.model_dump(mode="json") for name, entry in index.items()},
    }
    encoded = json.dumps(header_json, separators=(",", ":")).encode()
    encoded += b" " * (-(len(encoded) + _LENGTH.size) % 8)
    return PayloadLayout(_LENGTH.pack(len(encoded)) + encoded, tuple(ordered), index)


@dataclass(frozen=True)
class Header:
    """A parsed payload header."""

    size: int
    skeleton: JSON
    index: dict[str, TensorEntry]


def allocate(
    index: Mapping[str, TensorEntry],
    *,
    header_bytes: int,
    into: Mapping[str, torch.Tensor] | None = None,
) -> PayloadLayout:
    """Tensors for every entry of a tensor index, laid out as the payload was.

    An entry whose name ``into`` maps to a contiguous CPU tensor of its dtype and shape is
    read straight into that tensor (the live object being restored: no second copy); every
    other entry gets a fresh tensor that owns its memory. Fill them with ``scatter``.

    Raises:
        BundleFormatError: the index has unknown dtypes or inconsistent offsets.
    """
    data_size = max((entry.data_offsets[1] for entry in index.values()), default=0)
    _check_offsets(index, data_size=data_size)
    ordered = sorted(index.items(), key=lambda item: item[1].data_offsets)
    live = into or {}
    tensors = tuple((name, _target(entry, live.get(name))) for name, entry in ordered)
    return PayloadLayout(bytearray(header_bytes), tensors, dict(index))


def _target(entry: TensorEntry, live: torch.Tensor | None) -> torch.Tensor:
    dtype = TORCH_DTYPES[entry.dtype]
    if (
        live is not None
        and live.device.type == "cpu"
        and live.dtype == dtype
        and tuple(live.shape) == entry.shape
        and live.is_contiguous()
        and not (live.is_neg() or live.is_conj())
    ):
        return live.detach()
    return torch.empty(entry.shape, dtype=dtype)


def scatter(target: PayloadLayout, start: int, data: memoryview) -> None:
    """Copy ``data``, bytes ``[start, start + len(data))`` of a payload, into ``target``."""
    offset = 0
    for piece in target.pieces(start, start + len(data)):
        piece[:] = data[offset : offset + len(piece)]
        offset += len(piece)


def parse_header(payload: memoryview, *, data_size: int | None = None) -> Header:
    """Parse and validate a payload header without trusting any offset in it.

    Args:
        payload: the payload, or at least its header.
        data_size: the size of the data section, when ``payload`` holds only the header;
            by default, whatever follows the header in ``payload``.

    Raises:
        BundleFormatError: malformed length, JSON, dtype, shape or offsets.
    """
    if len(payload) < _LENGTH.size:
        raise BundleFormatError("payload is shorter than its length prefix")
    (length,) = _LENGTH.unpack(payload[: _LENGTH.size])
    size = _LENGTH.size + length
    if length > _MAX_HEADER_BYTES or size > len(payload):
        raise BundleFormatError(
            f"payload header claims {length} bytes; the payload has {len(payload)}"
        )
    try:
        raw = json.loads(bytes(payload[_LENGTH.size : size]))
        metadata = raw.pop("__metadata__")
        skeleton = json.loads(metadata[SKELETON_KEY])
        index = {name: TensorEntry.model_validate(entry) for name, entry in raw.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise BundleFormatError(f"payload header is not a ckpt header: {err}") from err
    _check_offsets(index, data_size=len(payload) - size if data_size is None else data_size)
    return Header(size=size, skeleton=skeleton, index=index)


def _check_offsets(index: Mapping[str, TensorEntry], *, data_size: int) -> None:
    cursor = 0
    for name, entry in sorted(index.items(), key=lambda item: item[1].data_offsets):
        if entry.dtype not in TORCH_DTYPES:
            raise BundleFormatError(f"tensor {name!r} has unknown dtype {entry.dtype!r}")
        begin, end = entry.data_offsets
        itemsize = TORCH_DTYPES[entry.dtype].itemsize
        numel = 1
        for dim in entry.shape:
            numel *= dim
        if begin != cursor or end - begin != numel * itemsize or min(entry.shape, default=0) < 0:
            raise BundleFormatError(
                f"tensor {name!r} has inconsistent offsets {entry.data_offsets}"
            )
        cursor = end
    if cursor != data_size:
        raise BundleFormatError(f"tensor data covers {cursor} bytes; the payload holds {data_size}")
