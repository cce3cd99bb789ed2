"""The files an export writes, laid out before any tensor byte is read: each file's
framing (a safetensors header, a ``torch.save`` archive, DCP's items and ``.metadata``)
is written first with room for every tensor, and ``Slot`` says where each tensor's
bytes go; ``export_fill`` then streams the bytes in.

A ``torch.save`` archive is laid out by ``torch.save`` itself, straight into its file,
under ``torch.serialization.skip_data`` over fake tensors (no memory): it writes the pickle
and seeks past each storage's record (the file is sparse until filled). Its records' CRC-32
fields stay zero, as ``skip_data`` leaves them (``torch.load`` does not check them). A DCP
folder holds such an archive per tensor, as DCP's own writer stores each item.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agent.format.dtypes import DTYPES
from agent.interop.export_plan import Entry, transform
from ckpt.core.errors import BundleFormatError

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip entry's local header, before its name


@dataclass(frozen=True)
class Slot:
    """Where an entry's bytes go: ``offset`` in the file at ``path``."""

    path: str
    offset: int


Placed = list[tuple[Entry, Slot]]


def safetensors_file(
    path: str, tensors: Sequence[tuple[str, Entry]], metadata: dict[str, str]
) -> Placed:
    """A safetensors file holding ``tensors`` by name, its data still to be filled."""
    index: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, entry in tensors:
        index[name] = {
            "dtype": DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    encoded = json.dumps(index, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    header = struct.pack("<Q", len(encoded)) + encoded
    _create(path, header, len(header) + offset)
    placed, cursor = [], len(header)
    for _, entry in tensors:
        placed.append((entry, Slot(path, cursor)))
        cursor += entry.nbytes
    return placed


def shard(tensors: Sequence[tuple[str, Entry]], *, max_bytes: int) -> list[list[tuple[str, Entry]]]:
    """``tensors`` in order, cut into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[tuple[str, Entry]]] = [[]]
    size = 0
    for item in tensors:
        if shards[-1] and size + item[1].nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[1].nbytes
    return shards


def safetensors_folder(
    folder: str, tensors: Sequence[tuple[str, Entry]], *, max_bytes: int, metadata: dict[str, str]
) -> Placed:
    """``model.safetensors``, or past ``max_bytes`` the shards
    ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json`` (Hugging
    Face's names and index), in ``folder``."""
    shards = shard(tensors, max_bytes=max_bytes)
    if len(shards) == 1:
        return safetensors_file(os.path.join(folder, "model.safetensors"), tensors, metadata)
    placed: Placed = []
    weight_map = {}
    for i, part in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        placed += safetensors_file(os.path.join(folder, name), part, metadata)
        weight_map.update({key: name for key, _ in part})
    total = sum(entry.nbytes for _, entry in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as file:
        json.dump(index, file, indent=2)
    return placed


def torch_file(path: str, state: object, entry_of: Callable[[object], Entry | None]) -> Placed:
    """A ``torch.save`` archive of ``state`` (``torch.load(path, weights_only=True)`` reads
    it where ``state`` holds only tensors and plain values), its storages still to be filled.

    ``torch.save`` writes it to the file itself over fake tensors: under ``skip_data`` it
    seeks past each storage, so the file is sparse and nothing of its size is in memory.
    Storages are numbered in the order the pickle meets them (``torch.save``'s ``id_map``),
    which is the order of ``transform``'s depth-first walk.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    fakes: dict[int, torch.Tensor] = {}
    order: list[Entry] = []

    def fake(value: object) -> object:
        entry = entry_of(value)
        if entry is None:
            return value
        if id(entry) not in fakes:
            with FakeTensorMode():
                fakes[id(entry)] = torch.empty(entry.shape, dtype=entry.dtype)
            order.append(entry)
        return fakes[id(entry)]

    faked = transform(state, fake)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(faked, path)
    records = _data_records(path)
    assert len(records) == len(order), f"{len(records)} storages for {len(order)} tensors"
    placed = []
    for key, entry in enumerate(order):
        offset, size = records[str(key)]
        assert size == entry.nbytes, f"storage {key}: {size} bytes for {entry.nbytes}"
        placed.append((entry, Slot(path, offset)))
    return placed


def _data_records(path: str) -> dict[str, tuple[int, int]]:
    """Each storage record of a ``torch.save`` archive: key -> (offset of its bytes, size)."""
    found = {}
    with open(path, "rb") as file, zipfile.ZipFile(file) as zipped:
        for info in zipped.infolist():
            folder, _, key = info.filename.rpartition("/")
            if folder.endswith("/data") and key.isdigit():
                file.seek(info.header_offset)
                fields = _LOCAL_HEADER.unpack(file.read(_LOCAL_HEADER.size))
                name_length, extra_length = fields[-2], fields[-1]
                start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
                found[key] = (start, info.file_size)
    return found


def dcp_folder(
    folder: str, state: dict[str, Any], entry_of: Callable[[object], Entry | None]
) -> Placed:
    """A ``torch.distributed.checkpoint`` folder of ``state``: ``.metadata``, each tensor
    one item, whole, in a file of its own (``dcp.load`` reads it at any world size; a
    sharded target reads its part), and the other values as bytes items in one file, as DCP
    writes them."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    # DCP walks into a list only when it holds tensors: stand each entry in for a meta one.
    metas: dict[int, Entry] = {}

    def meta(value: object) -> object:
        entry = entry_of(value)
        if entry is None:
            return value
        tensor = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
        metas[id(tensor)] = entry
        return tensor

    standing = transform(state, meta)
    assert isinstance(standing, dict)
    flat, mapping = flatten_state_dict(standing)
    described: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    placed: Placed = []
    small = "__0_0.distcp"  # the values that are not tensors, one after the other
    with open(os.path.join(folder, small), "wb") as data:
        for number, (fqn, value) in enumerate(flat.items(), start=1):
            entry = metas.get(id(value))
            if entry is None:
                if _holds_tensor(value):
                    raise BundleFormatError(
                        f"{fqn}: a tuple or other container of tensors has no DCP form; "
                        "export this bundle as torch or safetensors"
                    )
                start = data.tell()
                torch.save(value, data)
                described[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = _StorageInfo(small, start, data.tell() - start)
                continue
            name = f"__0_{number}.distcp"  # each tensor a file: torch.save seeks within it
            path = os.path.join(folder, name)
            placed += torch_file(path, entry, _same_entry)
            origin = torch.Size([0] * len(entry.shape))
            described[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=entry.dtype),
                size=torch.Size(entry.shape),
                chunks=[ChunkStorageMetadata(offsets=origin, sizes=torch.Size(entry.shape))],
            )
            storage[MetadataIndex(fqn, origin)] = _StorageInfo(name, 0, os.path.getsize(path))
    metadata = Metadata(
        state_dict_metadata=described, planner_data=mapping, storage_data=storage, version="1.0.0"
    )
    with open(os.path.join(folder, ".metadata"), "wb") as file:
        pickle.dump(metadata, file)
    return placed


def _same_entry(value: object) -> Entry | None:
    return value if isinstance(value, Entry) else None


def _holds_tensor(value: object) -> bool:
    found = False

    def look(leaf: object) -> object:
        nonlocal found
        found = found or isinstance(leaf, torch.Tensor)
        return leaf

    transform(value, look)
    return found


def _create(path: str, head: bytes, size: int) -> None:
    with open(path, "wb") as file:
        file.write(head)
        file.truncate(size)
