"""What an export writes, tensor by tensor, and where each tensor's bytes are in the bundle.

An export never decodes a payload's tensors: it reads each payload's header blob (verified),
decodes its skeleton over *meta* tensors (no memory), and so learns the state's shape; each
tensor it writes (an ``Entry``) then names the payload bytes it is made of (``Source``): one
payload tensor, or, for a tensor sharded over ranks (FSDP2), every saved rank's block of it.
The small layers (scheduler, rng, data, counters) are read whole when an export needs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from agent.catalog.manifests import bundle_name, layer_record
from agent.format import payload, skeleton
from agent.format.dtypes import TORCH_DTYPES
from agent.format.sharding import Block
from agent.restore.download import fetch_blob, read_layer
from agent.state.sharded import Shards, merge
from ckpt.core.contract import Layer, Manifest
from ckpt.core.errors import BundleFormatError
from ckpt.core.storage import ObjectStore

STREAMED = (Layer.WEIGHTS, Layer.OPTIMIZER)  # large: read blob by blob, never whole


@dataclass(frozen=True)
class Source:
    """Bytes of one payload tensor, which land at ``at`` in the exported tensor's bytes."""

    rank: int
    layer: Layer
    tensor: str  # the name in the payload's tensor index
    at: int


@dataclass(frozen=True, eq=False)
class Entry:
    """One tensor an export writes: from payload bytes (``sources``) or, for the small
    layers read whole, from memory (``value``)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    sources: tuple[Source, ...] = ()
    value: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Plan:
    """The bundle's state with every tensor an ``Entry``: ``states[layer]`` is the layer's
    state object (merged over ranks, as a resume at world size 1 would see it)."""

    def __init__(self, store: ObjectStore, manifest: Manifest, layers: tuple[Layer, ...]) -> None:
        self.manifest = manifest
        self._entries: dict[int, Entry] = {}  # by id() of the meta tensor standing for it
        self.states: dict[Layer, Any] = {
            layer: self._read(store, layer) if layer in STREAMED else self._read_whole(store, layer)
            for layer in layers
        }

    def leaves(self, state: object, *, prefix: str = "") -> Iterator[tuple[str, Entry]]:
        """Every tensor of ``state`` as (dotted key path, entry), depth first."""
        for key, value in _walk(state, prefix):
            entry = self.entry(value)
            if entry is not None:
                yield key, entry

    def entry(self, value: object) -> Entry | None:
        """The entry ``value`` (a leaf of ``states``) stands for; None for a non-tensor."""
        if isinstance(value, Block | Shards):
            return self._sharded(value)
        if isinstance(value, torch.Tensor):
            return self._entries.get(id(value)) or Entry(
                dtype=value.dtype, shape=tuple(value.shape), value=value
            )
        return None

    def _read(self, store: ObjectStore, layer: Layer) -> Any:
        ranks = [record.rank for record in self.manifest.ranks if layer in record.layers]
        states = [self._decode(store, rank, layer) for rank in sorted(ranks)]
        return merge(states, source=0) if len(states) > 1 else states[0]

    def _decode(self, store: ObjectStore, rank: int, layer: Layer) -> Any:
        record = layer_record(self.manifest, rank=rank, layer=layer)
        header = bytearray(record.header_bytes)
        fetch_blob(store, self.manifest, record.blobs[0], memoryview(header))
        parsed = payload.parse_header(
            memoryview(header), data_size=record.payload_bytes - record.header_bytes
        )
        if parsed.index != record.tensors:
            raise BundleFormatError(
                f"bundle {bundle_name(self.manifest)}: the rank {rank} {layer} payload's "
                "header disagrees with its manifest"
            )
        metas = {}
        for name, index in record.tensors.items():
            meta = torch.empty(index.shape, dtype=TORCH_DTYPES[index.dtype], device="meta")
            self._entries[id(meta)] = Entry(
                dtype=meta.dtype, shape=index.shape, sources=(Source(rank, layer, name, 0),)
            )
            metas[name] = meta
        return skeleton.decode(parsed.skeleton, metas)

    def _read_whole(self, store: ObjectStore, layer: Layer) -> Any:
        found, tensors = read_layer(store, self.manifest, rank=0, layer=layer)
        return skeleton.decode(found, tensors)

    def _sharded(self, saved: Block | Shards) -> Entry:
        """The whole tensor from its blocks, each a contiguous run of its bytes: blocks cut
        along the first dimension only (FSDP2's ``Shard(0)``), or replicated."""
        blocks = saved.blocks if isinstance(saved, Shards) else (saved,)
        dtype, shape = blocks[0].data.dtype, blocks[0].shape
        row = math.prod(shape[1:]) * dtype.itemsize
        runs: dict[int, tuple[Source, int]] = {}
        for block in blocks:
            if tuple(block.data.shape[1:]) != shape[1:] or any(block.offset[1:]):
                raise BundleFormatError(
                    f"a tensor of shape {shape} is sharded along a dimension other than the "
                    "first; export reads FSDP2's Shard(0) and replicated tensors only"
                )
            (source,) = self._entries[id(block.data)].sources
            at = block.offset[0] * row if shape else 0
            placed = Source(source.rank, source.layer, source.tensor, at)
            runs.setdefault(at, (placed, block.data.numel() * dtype.itemsize))
        cursor = 0
        for at in sorted(runs):
            cursor = max(cursor, at + runs[at][1]) if 0 <= at <= cursor else -1
        entry = Entry(dtype=dtype, shape=shape, sources=tuple(runs[at][0] for at in sorted(runs)))
        if cursor != entry.nbytes:
            raise BundleFormatError(
                f"the saved blocks of a tensor of shape {shape} do not cover it: a rank's "
                "block is missing"
            )
        return entry


def _walk(state: object, prefix: str) -> Iterator[tuple[str, object]]:
    """(dotted key path, leaf) of a state object, depth first, in insertion order."""
    if isinstance(state, Mapping):
        for key, value in state.items():
            yield from _walk(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, list | tuple):
        for i, value in enumerate(state):
            yield from _walk(value, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, state


def by_name(objects: Mapping[str, Any]) -> Any:
    """One registered object's state as it is; several, by name."""
    return next(iter(objects.values())) if len(objects) == 1 else dict(objects)


def transform(state: object, leaf: Callable[[object], object]) -> object:
    """``state`` with each leaf replaced by ``leaf(value)``; containers keep their types."""
    if isinstance(state, Mapping):
        return {key: transform(value, leaf) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(transform(value, leaf) for value in state)
    return leaf(state)
