"""The upload phase of a save: lay out each layer's payload, hash its blobs and put the
ones the store lacks.

A blob is stored under its SHA-256 (``keys.blob_key``), so a blob the store already holds
is not uploaded again; ``HeldBlobs`` says which those are (the store itself, store-only, or
the control plane), asked once a save for every blob of every layer (one request to the
control plane, however many layers and tensors). Hashing, then writing, run as one task per
blob on the I/O threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from agent.format import payload
from agent.format.chunking import GROUP_BYTES, plan_blobs
from agent.state.capture import LayerState
from ckpt.core.contract import BlobRef, Layer, LayerRecord
from ckpt.core.storage import ObjectStore, keys
from ckpt.core.threads import parallel


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


@dataclass
class Share:
    """Layers every rank holds byte for byte (DDP's replicated weights and optimizer state):
    each rank hashes every blob, but each blob is stored by one rank alone, so a bundle
    costs one replica's upload, spread over every rank. Blobs go to the rank with the fewest
    bytes so far, largest first: every rank computes the same split from the same sizes.

    ``alike(hashes)`` tells, blob by blob, whether every rank computed the same hash (a
    meeting of the ranks, ``blobs_alike``). A blob that differs (one holding batch-norm
    statistics a forward pass changed since DDP last broadcast them) is stored by every rank.
    """

    rank: int
    world_size: int
    alike: Callable[[list[str]], list[bool]]
    loads: list[int] = field(default_factory=list)  # bytes given to each rank this save

    def owners(self, sizes: list[int]) -> list[int]:
        """The rank that stores each blob."""
        if not self.loads:
            self.loads = [0] * self.world_size
        owners = [0] * len(sizes)
        for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            owner = min(range(self.world_size), key=lambda r: (self.loads[r], r))
            owners[index] = owner
            self.loads[owner] += sizes[index]
        return owners

    def mine(self, blobs: list[BlobRef]) -> list[bool]:
        """Whether this rank stores each blob of a replicated layer: its share of the blobs
        every rank holds alike, and every blob the ranks hold differently."""
        shared = [i for i, alike in enumerate(self.alike([b.sha256 for b in blobs])) if alike]
        owners = [self.rank] * len(blobs)
        for index, owner in zip(shared, self.owners([blobs[i].size for i in shared]), strict=True):
            owners[index] = owner
        return [owner == self.rank for owner in owners]


@dataclass
class HashedLayer:
    """One layer laid out and hashed, its blobs not yet stored."""

    plan: payload.PayloadLayout
    ranges: list[tuple[int, int]]
    blobs: list[BlobRef]
    mine: list[bool]  # whether this rank stores each blob (a replicated layer: its share)

    def record(self) -> LayerRecord:
        return LayerRecord(
            payload_bytes=self.plan.size,
            header_bytes=len(self.plan.header),
            blobs=tuple(self.blobs),
            tensors=self.plan.index,
        )


def hash_layer(
    state: LayerState,
    *,
    blob_bytes: int,
    hashes: BlobHashes | None = None,
    share: Share | None = None,
) -> HashedLayer:
    """Lay out one payload and hash its blobs (on the I/O threads). ``hashes`` carries the
    previous save's blob hashes over; ``share`` splits a replicated layer's blobs among the
    ranks."""
    plan = payload.layout(state.skeleton, state.tensors)
    ranges = plan_blobs(plan.spans(), blob_bytes=blob_bytes, group_bytes=GROUP_BYTES)
    hashes = hashes if hashes is not None else BlobHashes()

    def digest(span: tuple[int, int]) -> BlobRef:
        sources = plan.sources(*span)
        sha = hashes.known(sources)
        if sha is None:
            sha = _sha256(plan.pieces(*span))
        else:
            hashes.reused(span[1] - span[0])
        hashes.remember(sources, sha)
        return BlobRef(sha256=sha, size=span[1] - span[0])

    blobs = parallel(digest, ranges)
    mine = [True] * len(blobs) if share is None else share.mine(blobs)
    return HashedLayer(plan=plan, ranges=ranges, blobs=blobs, mine=mine)


def store_layers(
    store: ObjectStore,
    layers: Mapping[Layer, HashedLayer],
    *,
    stats: WriteStats,
    held: HeldBlobs,
    progress: Callable[[int], None] = lambda nbytes: None,
) -> dict[Layer, LayerRecord]:
    """Put the blobs of hashed layers that the store does not hold intact, and return the
    layers' records. ``held`` is asked once for every blob of the save (the store itself,
    ``store_held``, or the control plane, ``/v1/blobs/missing``: one request a save, however
    many layers and blobs); ``progress`` is told the size of each blob done."""
    wanted: dict[str, BlobRef] = {}
    for hashed in layers.values():
        for blob, mine in zip(hashed.blobs, hashed.mine, strict=True):
            if mine:
                wanted.setdefault(blob.sha256, blob)
    holding = held(list(wanted.values())) if wanted else set()
    tasks = [
        (hashed, blob, span, mine)
        for hashed in layers.values()
        for blob, span, mine in zip(hashed.blobs, hashed.ranges, hashed.mine, strict=True)
    ]

    def put(task: tuple[HashedLayer, BlobRef, tuple[int, int], bool]) -> None:
        hashed, blob, span, mine = task
        if mine and stats.claim(blob.sha256) and blob.sha256 not in holding:
            store.put(keys.blob_key(blob.sha256), hashed.plan.pieces(*span))
            stats.stored(blob.size)
        progress(blob.size)

    parallel(put, tasks)
    stats.payload_bytes += sum(hashed.plan.size for hashed in layers.values())
    return {layer: hashed.record() for layer, hashed in layers.items()}


def upload_layer(
    store: ObjectStore,
    state: LayerState,
    *,
    blob_bytes: int,
    stats: WriteStats,
    held: HeldBlobs,
    hashes: BlobHashes | None = None,
) -> LayerRecord:
    """Lay out one payload, hash its blobs and put those the store does not hold intact."""
    hashed = hash_layer(state, blob_bytes=blob_bytes, hashes=hashes)
    return store_layers(store, {Layer.WEIGHTS: hashed}, stats=stats, held=held)[Layer.WEIGHTS]


def durable_together(store: ObjectStore) -> contextlib.AbstractContextManager[object]:
    """A block whose puts the store makes durable together on exit, where it can
    (``DirectoryStore.batch``: one flush of the disk for a save's blobs); else nothing."""
    batch = getattr(store, "batch", None)
    return batch() if callable(batch) else contextlib.nullcontext()


def blobs_alike(hashes: Sequence[Sequence[str]]) -> list[bool]:
    """Given each rank's blob hashes of one layer: whether every rank has the same blob at
    each position (none, when the layouts differ in length)."""
    first = hashes[0]
    if any(len(other) != len(first) for other in hashes):
        return [False] * len(first)
    return [all(other[i] == sha for other in hashes) for i, sha in enumerate(first)]
