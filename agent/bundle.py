"""Write a bundle to an object store, find the latest one, and read its layers back.

Phases of a save, named as in the design: *layout* (plan each payload and its blobs),
*upload* (hash each blob and put the ones the store lacks), *commit* (write the manifest,
last). A bundle exists only once its manifest does.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import platform
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypeVar

import torch
from pydantic import ValidationError

from agent.errors import BadObjectError, BundleFormatError, CorruptBundleError, StoreError
from agent.format import payload
from agent.format.chunking import GROUP_BYTES, plan_blobs
from agent.format.skeleton import JSON
from agent.storage import ObjectStore, keys
from service import __version__
from service.contract import (
    BlobRef,
    Layer,
    LayerRecord,
    Manifest,
    RankRecord,
    Versions,
    missing_parts,
)

log = logging.getLogger("ckpt.bundle")


@dataclass
class LayerState:
    """One layer of one rank, split for storage: a JSON skeleton and its CPU tensors."""

    skeleton: JSON
    tensors: dict[str, torch.Tensor]


@dataclass
class WriteStats:
    """What one save wrote; blobs are counted from several threads."""

    payload_bytes: int = 0
    new_bytes: int = 0
    seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def claim(self, sha256: str) -> bool:
        """Whether this is the first time the save meets this blob (so it may store it)."""
        with self._lock:
            first = sha256 not in self.seen
            self.seen.add(sha256)
            return first

    def stored(self, size: int) -> None:
        with self._lock:
            self.new_bytes += size


# hashlib and file I/O release the GIL on large buffers, so blobs are hashed, written and
# read on threads: on 2 cores this nearly halves the time of a save or a restore.
_IO_THREADS = max(2, min(8, 2 * (os.cpu_count() or 1)))

T = TypeVar("T")
R = TypeVar("R")


def _parallel(action: Callable[[T], R], items: Iterable[T]) -> list[R]:
    items = list(items)
    if len(items) <= 1:
        return [action(item) for item in items]
    with ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="ckpt-io") as pool:
        return list(pool.map(action, items))


def _sha256(pieces: Iterator[memoryview]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


HeldBlobs = Callable[[list[BlobRef]], set[str]]
BlobSources = tuple[tuple[str, int, int], ...]


@dataclass
class BlobHashes:
    """SHA-256s of the previous save's blobs, reused for blobs whose bytes did not change.

    A blob is known by what it holds (``PayloadLayout.sources``); when every tensor it
    covers is ``unchanged`` since the previous save, its hash from then still holds.
    """

    previous: Mapping[BlobSources, str] = field(default_factory=dict)
    unchanged: frozenset[str] = frozenset()
    current: dict[BlobSources, str] = field(default_factory=dict)
    reused_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def known(self, sources: BlobSources) -> str | None:
        if not all(name in self.unchanged for name, _, _ in sources):
            return None
        return self.previous.get(sources)

    def remember(self, sources: BlobSources, sha256: str) -> None:
        self.current[sources] = sha256  # one key per thread: a dict store is atomic

    def reused(self, size: int) -> None:
        with self._lock:
            self.reused_bytes += size


def upload_layer(
    store: ObjectStore,
    state: LayerState,
    *,
    blob_bytes: int,
    stats: WriteStats,
    held: HeldBlobs,
    hashes: BlobHashes | None = None,
    progress: Callable[[int], None] = lambda nbytes: None,
) -> LayerRecord:
    """Lay out one payload, hash its blobs and put those the store does not hold intact.

    ``held`` answers which of the new blobs the store already holds intact: the store
    itself (``store_held``) or the control plane (``/v1/blobs/missing``). ``hashes`` carries
    the previous save's blob hashes over; ``progress`` is told the size of each blob done.
    """
    plan = payload.layout(state.skeleton, state.tensors)
    ranges = plan_blobs(plan.spans(), blob_bytes=blob_bytes, group_bytes=GROUP_BYTES)
    hashes = hashes if hashes is not None else BlobHashes()

    # One task per blob, from hash to stored, so that hashing (CPU) and writing (I/O)
    # overlap across the threads instead of running as two phases.
    def persist(span: tuple[int, int]) -> BlobRef:
        sources = plan.sources(*span)
        sha = hashes.known(sources)
        if sha is None:
            sha = _sha256(plan.pieces(*span))
        else:
            hashes.reused(span[1] - span[0])
        hashes.remember(sources, sha)
        blob = BlobRef(sha256=sha, size=span[1] - span[0])
        if stats.claim(sha) and not held([blob]):
            store.put(keys.blob_key(sha), plan.pieces(*span))
            stats.stored(blob.size)
        progress(blob.size)
        return blob

    blobs = _parallel(persist, ranges)
    stats.payload_bytes += plan.size
    return LayerRecord(
        payload_bytes=plan.size,
        header_bytes=len(plan.header),
        blobs=tuple(blobs),
        tensors=plan.index,
    )


def store_held(store: ObjectStore, verified: set[str]) -> HeldBlobs:
    """Ask the store itself which blobs it holds intact.

    Every blob's presence and size are checked at each save (something else may have
    deleted it). ``verified`` holds blobs this process wrote or checked: a blob the store
    holds that is not among them is read back and hashed once before it is trusted, so a
    damaged blob is rewritten rather than referenced again. Blobs found intact join
    ``verified``; the caller adds those it writes once their writes succeed.
    """

    def held(blobs: list[BlobRef]) -> set[str]:
        intact = _parallel(lambda blob: _stored_intact(store, blob, verified), blobs)
        found = {blob.sha256 for blob, ok in zip(blobs, intact, strict=True) if ok}
        verified.update(found)
        return found

    return held


def _stored_intact(store: ObjectStore, blob: BlobRef, verified: set[str]) -> bool:
    """Whether the store holds ``blob`` with the right size (and SHA-256, unless verified)."""
    key = keys.blob_key(blob.sha256)
    if store.size(key) != blob.size:
        return False
    if blob.sha256 in verified:
        return True
    buffer = torch.empty(blob.size, dtype=torch.uint8).numpy().data
    try:
        store.read_into(key, buffer)
    except StoreError:
        return False
    return hashlib.sha256(buffer).hexdigest() == blob.sha256


def commit_bundle(
    store: ObjectStore,
    *,
    run: str,
    step: int,
    world_size: int,
    ranks: Mapping[int, Mapping[Layer, LayerRecord]],
) -> Manifest:
    """Write the manifest, last: from now on the bundle is resumable."""
    manifest = Manifest(
        run=run,
        step=step,
        world_size=world_size,
        created_at=datetime.now(UTC).isoformat(),
        versions=Versions(
            ckpt=__version__, python=platform.python_version(), torch=torch.__version__
        ),
        ranks=tuple(
            RankRecord(rank=rank, layers=dict(layers)) for rank, layers in sorted(ranks.items())
        ),
    )
    missing = missing_parts(manifest)
    assert not missing, f"refusing to commit an incomplete bundle: {missing}"
    store.put(keys.manifest_key(run, step), [manifest.model_dump_json(indent=1).encode()])
    return manifest


def bundle_name(manifest: Manifest) -> str:
    return bundle_name_at(manifest.run, manifest.step)


def bundle_name_at(run: str, step: int) -> str:
    return keys.manifest_key(run, step).removesuffix("/manifest.json")


def load_manifest(store: ObjectStore, key: str) -> Manifest:
    """Parse and validate one manifest.

    Raises:
        BundleFormatError: the manifest is not valid JSON of a known format.
    """
    try:
        return Manifest.model_validate_json(store.get(key))
    except ValidationError as err:
        raise BundleFormatError(f"{key}: not a valid ckpt manifest: {err}") from err


def latest_manifest(store: ObjectStore, run: str, *, below: int | None = None) -> Manifest | None:
    """The newest bundle of ``run`` (below step ``below``) whose manifest is valid and
    complete, or None.

    Blobs without a manifest (an interrupted save) are not bundles and are ignored; a
    manifest that fails validation is skipped with a warning.
    """
    steps = {key: keys.manifest_step(key) for key in store.list_keys(keys.bundles_prefix(run))}
    manifests = {
        key: step
        for key, step in steps.items()
        if step is not None and (below is None or step < below)
    }
    for key in sorted(manifests, key=manifests.__getitem__, reverse=True):
        try:
            manifest = load_manifest(store, key)
        except BundleFormatError as err:
            log.warning("skipping unreadable bundle: %s", err)
            continue
        if manifest.run != run or missing_parts(manifest):
            log.warning("skipping %s: it is incomplete or belongs to another run", key)
            continue
        return manifest
    return None


def layer_record(manifest: Manifest, *, rank: int, layer: Layer) -> LayerRecord:
    """What the manifest records for one rank's layer."""
    return next(r for r in manifest.ranks if r.rank == rank).layers[layer]


def read_layer(
    store: ObjectStore,
    manifest: Manifest,
    *,
    rank: int,
    layer: Layer,
    into: Mapping[str, torch.Tensor] | None = None,
    progress: Callable[[int], None] = lambda nbytes: None,
) -> tuple[JSON, dict[str, torch.Tensor]]:
    """Download one payload, verify every blob's size and SHA-256, and parse it.

    Tensors are filled blob by blob, in parallel: the live tensors of ``into`` (by name)
    where they match the manifest's index, fresh ones otherwise. A blob that fails its
    check raises, but may have been written into its tensor already.

    Raises:
        CorruptBundleError: a blob is missing or does not match the manifest.
        BundleFormatError: the payload is malformed or disagrees with the manifest.
    """
    record = layer_record(manifest, rank=rank, layer=layer)
    name = bundle_name(manifest)
    target = payload.allocate(record.tensors, header_bytes=record.header_bytes, into=into)
    if target.size != record.payload_bytes:
        raise BundleFormatError(
            f"bundle {name}: the {layer} tensor index covers {target.size} bytes, "
            f"the payload has {record.payload_bytes}"
        )
    offsets = itertools.accumulate((blob.size for blob in record.blobs), initial=0)

    def fetch(item: tuple[BlobRef, int]) -> None:
        blob, start = item
        pieces = list(target.pieces(start, start + blob.size))
        # A blob that is one piece (a chunk of a large tensor, or the header) is read in
        # place; a group of small tensors goes through a buffer of its own.
        direct = len(pieces) == 1
        buffer = pieces[0] if direct else torch.empty(blob.size, dtype=torch.uint8).numpy().data
        _fetch_blob(store, blob, buffer, bundle=name, rank=rank, layer=layer)
        if not direct:
            payload.scatter(target, start, buffer)
        progress(blob.size)

    _parallel(fetch, zip(record.blobs, offsets, strict=False))
    header = payload.parse_header(
        memoryview(target.header), data_size=record.payload_bytes - record.header_bytes
    )
    if header.size != record.header_bytes or header.index != record.tensors:
        raise BundleFormatError(
            f"bundle {name}: the {layer} payload's header disagrees with its manifest"
        )
    return header.skeleton, dict(target.tensors)


def _fetch_blob(
    store: ObjectStore, blob: BlobRef, target: memoryview, *, bundle: str, rank: int, layer: Layer
) -> None:
    """Read one blob into ``target`` and check its size and SHA-256."""
    try:
        size = store.read_into(keys.blob_key(blob.sha256), target) if blob.size else 0
    except BadObjectError as err:
        raise CorruptBundleError(
            f"bundle {bundle}: blob {blob.sha256} of rank {rank} {layer} is unusable: {err}",
            bundle=bundle,
            blob=blob.sha256,
        ) from err
    except StoreError as err:
        raise StoreError(
            f"bundle {bundle}: the store failed while reading blob {blob.sha256} of rank "
            f"{rank} {layer} ({err}); nothing was quarantined: retry when the store answers"
        ) from err
    if size != blob.size or hashlib.sha256(target).hexdigest() != blob.sha256:
        raise CorruptBundleError(
            f"bundle {bundle}: blob {blob.sha256} of rank {rank} {layer} does not match its "
            f"SHA-256 or size ({size} bytes read, {blob.size} expected); refusing to restore it",
            bundle=bundle,
            blob=blob.sha256,
        )
