"""Stream a bundle's tensor bytes into laid-out export files, blob by blob.

Each blob that holds a byte an export needs is read once, into a buffer of its own thread
(a few blobs in memory at a time, never the state), and checked against its SHA-256 and
size before any of its bytes is written; then its bytes are written where each tensor they
belong to goes (``os.pwrite``). Tensors already in memory (the small layers) are written as
they are.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

from agent.catalog.manifests import layer_record
from agent.format.payload import tensor_bytes
from agent.interop.export_files import Placed
from agent.restore.download import fetch_blob
from ckpt.core.contract import BlobRef, Layer, Manifest
from ckpt.core.errors import CorruptBundleError
from ckpt.core.storage import ObjectStore
from ckpt.core.threads import IO_THREADS, parallel

Targets = dict[str, list[tuple[int, int]]]  # payload tensor -> (file, where its byte 0 goes)


@dataclass(frozen=True)
class _Work:
    """One blob to read, at ``start`` of its payload, and the needed tensors it overlaps."""

    blob: BlobRef
    start: int
    tensors: tuple[tuple[str, int, int], ...]  # name, begin, end: absolute in the payload
    targets: Targets


def fill(
    store: ObjectStore,
    manifest: Manifest,
    placed: Placed,
    *,
    progress: Callable[[int], None] = lambda nbytes: None,
    threads: int = IO_THREADS,
) -> None:
    """Write every placed entry's bytes into its slot.

    Raises:
        CorruptBundleError: a blob is missing or does not match its SHA-256 (the message
            names the blob and the tensors it holds); nothing after it is trusted.
    """
    with ExitStack() as stack:
        files: dict[str, int] = {}

        def descriptor(path: str) -> int:
            if path not in files:
                files[path] = os.open(path, os.O_WRONLY)
                stack.callback(os.close, files[path])
            return files[path]

        wanted: dict[tuple[int, Layer], Targets] = {}
        for entry, slot in placed:
            fd = descriptor(slot.path)
            if entry.value is not None:
                _write(fd, tensor_bytes(entry.value.contiguous()), slot.offset)
            for source in entry.sources:
                targets = wanted.setdefault((source.rank, source.layer), {})
                targets.setdefault(source.tensor, []).append((fd, slot.offset + source.at))
        work = [
            item
            for (rank, layer), targets in wanted.items()
            for item in _blobs(manifest, rank, layer, targets)
        ]
        local = threading.local()

        def run(item: _Work) -> None:
            buffer = getattr(local, "buffer", None)
            if buffer is None or len(buffer) < item.blob.size:
                buffer = local.buffer = bytearray(item.blob.size)
            view = memoryview(buffer)[: item.blob.size]
            _fetch(store, manifest, item, view)
            for name, begin, end in item.tensors:
                low, high = max(begin, item.start), min(end, item.start + item.blob.size)
                for fd, at in item.targets[name]:
                    _write(fd, view[low - item.start : high - item.start], at + low - begin)
            progress(item.blob.size)

        parallel(run, work, threads=threads)


def _blobs(manifest: Manifest, rank: int, layer: Layer, targets: Targets) -> Iterator[_Work]:
    """The blobs of one payload that hold bytes of the ``targets`` tensors."""
    record = layer_record(manifest, rank=rank, layer=layer)
    base = record.header_bytes
    spans = sorted(
        (
            base + record.tensors[name].data_offsets[0],
            base + record.tensors[name].data_offsets[1],
            name,
        )
        for name in targets
    )
    ends = [end for _, end, _ in spans]
    start = 0
    for blob in record.blobs:
        stop = start + blob.size
        first = bisect.bisect_right(ends, start)
        hit = []
        for begin, end, name in itertools.islice(spans, first, None):
            if begin >= stop:
                break
            hit.append((name, begin, end))
        if hit:
            yield _Work(blob, start, tuple(hit), targets)
        start = stop


def _fetch(store: ObjectStore, manifest: Manifest, item: _Work, view: memoryview) -> None:
    try:
        fetch_blob(store, manifest, item.blob, view)
    except CorruptBundleError as err:
        names = ", ".join(name for name, _, _ in item.tensors[:5])
        more = f" and {len(item.tensors) - 5} more" if len(item.tensors) > 5 else ""
        raise CorruptBundleError(
            f"{err}; it holds tensor(s) {names}{more}: nothing was exported",
            bundle=err.bundle,
            blob=err.blob,
        ) from err


def _write(fd: int, data: memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
