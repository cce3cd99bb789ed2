"""The upload phase of a save: lay out each layer's payload, hash its blobs and put the
ones the store lacks.

A blob is stored under its SHA-256 (``keys.blob_key``), so a blob the store already holds
is not uploaded again; ``HeldBlobs`` says which those are (the store itself, store-only, or
the control plane). Hashing and writing run as one task per blob on the I/O threads, so
CPU and I/O overlap.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from agent.format import payload
from agent.format.chunking import GROUP_BYTES, plan_blobs
from agent.ranks.base import MEET_SECONDS, Ranks
from agent.state.capture import LayerState
from ckpt.core.contract import BlobRef, LayerRecord
from ckpt.core.storage import ObjectStore, keys
from ckpt.core.threads import parallel

log = logging.getLogger("ckpt")


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


@dataclass
class Replicas:
    """The ranks of a job whose replicated layers are shared (``Share``) save by save."""

    ranks: Ranks
    told_unalike: bool = False  # warned that such a layer differs between the ranks

    def share(self) -> Share:
        """How this save's replicated layers are split among the ranks."""

        def alike(hashes: list[str]) -> list[bool]:
            flags = blobs_alike(self.ranks.gather(tuple(hashes), timeout=MEET_SECONDS))
            if not all(flags) and not self.told_unalike:
                self.told_unalike = True
                log.warning(
                    "ckpt: %d of %d blobs of a layer DDP replicates differ between the ranks "
                    "(buffers such as batch-norm statistics, changed since DDP last broadcast "
                    "them): every rank stores those itself (said once)",
                    flags.count(False),
                    len(flags),
                )
            return flags

        return Share(rank=self.ranks.rank, world_size=self.ranks.world_size, alike=alike)


def upload_layer(
    store: ObjectStore,
    state: LayerState,
    *,
    blob_bytes: int,
    stats: WriteStats,
    held: HeldBlobs,
    hashes: BlobHashes | None = None,
    share: Share | None = None,
    progress: Callable[[int], None] = lambda nbytes: None,
) -> LayerRecord:
    """Lay out one payload, hash its blobs and put those the store does not hold intact.

    ``held`` answers which of the new blobs the store already holds intact: the store
    itself (``store_held``) or the control plane (``/v1/blobs/missing``). ``hashes`` carries
    the previous save's blob hashes over; ``share`` splits a replicated layer's blobs among
    the ranks; ``progress`` is told the size of each blob done.
    """
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

    def store_blob(blob: BlobRef, span: tuple[int, int]) -> None:
        if stats.claim(blob.sha256) and not held([blob]):
            store.put(keys.blob_key(blob.sha256), plan.pieces(*span))
            stats.stored(blob.size)
        progress(blob.size)

    if share is None:
        # One task per blob, from hash to stored, so that hashing (CPU) and writing (I/O)
        # overlap across the threads instead of running as two phases.
        def persist(span: tuple[int, int]) -> BlobRef:
            blob = digest(span)
            store_blob(blob, span)
            return blob

        blobs = parallel(persist, ranges)
    else:
        blobs = _shared(share, ranges, digest=digest, store_blob=store_blob, progress=progress)
    stats.payload_bytes += plan.size
    return LayerRecord(
        payload_bytes=plan.size,
        header_bytes=len(plan.header),
        blobs=tuple(blobs),
        tensors=plan.index,
    )


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


def _shared(
    share: Share,
    ranges: list[tuple[int, int]],
    *,
    digest: Callable[[tuple[int, int]], BlobRef],
    store_blob: Callable[[BlobRef, tuple[int, int]], None],
    progress: Callable[[int], None],
) -> list[BlobRef]:
    """Hash every blob; store this rank's share (every blob, if the ranks disagree)."""
    blobs = parallel(digest, ranges)
    shared = [i for i, alike in enumerate(share.alike([b.sha256 for b in blobs])) if alike]
    owners = [share.rank] * len(blobs)  # a blob the ranks hold differently: each its own
    for index, owner in zip(shared, share.owners([blobs[i].size for i in shared]), strict=True):
        owners[index] = owner
    for blob, span, owner in zip(blobs, ranges, owners, strict=True):
        if owner == share.rank:
            store_blob(blob, span)
        else:
            progress(blob.size)
    return blobs
