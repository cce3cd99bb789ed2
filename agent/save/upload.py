"""The upload phase of a save: lay out each layer's payload, hash its blobs and put the
ones the store lacks.

A blob is stored under its SHA-256 (``keys.blob_key``), so a blob the store already holds
is not uploaded again; ``HeldBlobs`` says which those are (the store itself, store-only, or
the control plane), asked once a save about every blob the rank stores: the blobs are
hashed first, one task per blob on the I/O threads, then the missing ones written.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from agent.format import payload
from agent.format.chunking import GROUP_BYTES, plan_blobs
from agent.ranks.base import MEET_SECONDS, Ranks
from agent.state.capture import LayerState
from ckpt.core.contract import BlobRef, Layer, LayerRecord
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


Span = tuple[int, int]


@dataclass(frozen=True)
class _Blob:
    """One blob of a layer's payload: where it lies, and what it is."""

    plan: payload.PayloadLayout
    span: Span
    ref: BlobRef


def upload_layers(
    store: ObjectStore,
    states: Mapping[Layer, LayerState],
    *,
    blob_bytes: int,
    stats: WriteStats,
    held: HeldBlobs,
    hashes: BlobHashes | None = None,
    share: Share | None = None,
    replicated: Collection[Layer] = (),
    progress: Callable[[int], None] = lambda nbytes: None,
    pace: Callable[[Iterator[memoryview]], Iterator[memoryview]] = lambda pieces: pieces,
) -> dict[Layer, LayerRecord]:
    """Lay out each layer's payload, hash every blob, and put those the store does not hold.

    ``held`` is asked once, about every blob this rank stores: the store itself
    (``store_held``) or the control plane (``/v1/blobs/missing``: one request a save, however
    many layers and tensors it holds). So blobs are hashed first (one task per blob over
    every layer, on the I/O threads), then the missing ones written. ``hashes`` carries the
    previous save's blob hashes over; ``share`` splits the ``replicated`` layers' blobs among
    the ranks; ``progress`` is told the size of each blob done; the bytes hashed and written
    pass through ``pace`` (``StepGate.pieces``: they wait while the optimizer steps).
    """
    plans = {
        layer: payload.layout(state.skeleton, state.tensors) for layer, state in states.items()
    }
    laid = _hashed(plans, blob_bytes=blob_bytes, hashes=hashes or BlobHashes(), pace=pace)
    mine: list[_Blob] = []
    for layer, blobs in laid.items():
        here = _stored_here(share, blobs) if share is not None and layer in replicated else None
        for index, blob in enumerate(blobs):
            if (here is None or here[index]) and stats.claim(blob.ref.sha256):
                mine.append(blob)
            else:
                progress(blob.ref.size)  # another rank's, or met before in this save
    found = held([blob.ref for blob in mine]) if mine else set()

    def put(blob: _Blob) -> None:
        if blob.ref.sha256 not in found:
            store.put(keys.blob_key(blob.ref.sha256), pace(blob.plan.pieces(*blob.span)))
            stats.stored(blob.ref.size)
        progress(blob.ref.size)

    parallel(put, mine)
    stats.payload_bytes += sum(plan.size for plan in plans.values())
    return {
        layer: LayerRecord(
            payload_bytes=plan.size,
            header_bytes=len(plan.header),
            blobs=tuple(blob.ref for blob in laid[layer]),
            tensors=plan.index,
        )
        for layer, plan in plans.items()
    }


def _hashed(
    plans: Mapping[Layer, payload.PayloadLayout],
    *,
    blob_bytes: int,
    hashes: BlobHashes,
    pace: Callable[[Iterator[memoryview]], Iterator[memoryview]],
) -> dict[Layer, list[_Blob]]:
    """Every layer's blobs, hashed as one task per blob over all layers (the previous save's
    hash reused where every tensor a blob covers is unchanged)."""
    spans = [
        (layer, span)
        for layer, plan in plans.items()
        for span in plan_blobs(plan.spans(), blob_bytes=blob_bytes, group_bytes=GROUP_BYTES)
    ]

    def digest(task: tuple[Layer, Span]) -> _Blob:
        plan, span = plans[task[0]], task[1]
        sources = plan.sources(*span)
        sha = hashes.known(sources)
        if sha is None:
            sha = _sha256(pace(plan.pieces(*span)))
        else:
            hashes.reused(span[1] - span[0])
        hashes.remember(sources, sha)
        return _Blob(plan, span, BlobRef(sha256=sha, size=span[1] - span[0]))

    laid: dict[Layer, list[_Blob]] = {layer: [] for layer in plans}
    for (layer, _), blob in zip(spans, parallel(digest, spans), strict=True):
        laid[layer].append(blob)
    return laid


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


def _stored_here(share: Share, blobs: list[_Blob]) -> list[bool]:
    """Which blobs of a replicated layer this rank stores: its share of those every rank
    holds alike, and every blob the ranks hold differently (each its own)."""
    refs = [blob.ref for blob in blobs]
    shared = [i for i, alike in enumerate(share.alike([r.sha256 for r in refs])) if alike]
    here = [True] * len(refs)
    for index, owner in zip(shared, share.owners([refs[i].size for i in shared]), strict=True):
        here[index] = owner == share.rank
    return here
