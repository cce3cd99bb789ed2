"""What the store holds of blobs, read outside any transaction and many at once: sizes, the
store's own checksum where it keeps one, and for run isolation when each was written;
metadata only, never a blob's bytes (a commit costs a HEAD per blob, whatever the blobs'
size). Reading a blob back whole (``read_back``) is the scrubber's and a quarantine's. A
store that cannot be read is a ``StoreUnavailableError``."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import TypeVar

from ckpt.core.errors import BadObjectError, StoreError
from ckpt.core.storage import DirectoryStore, ObjectStore, StoredObject, keys
from ckpt.core.threads import parallel
from service.bundles.isolation import written_since
from service.completeness import StoredBlob
from service.errors import StoreUnavailableError
from service.metrics import Metrics
from service.yielding import step_aside

T = TypeVar("T")
_STORE_THREADS = 16  # S3 answers a HEAD in tens of milliseconds: a commit waits on many
_LOCAL_GROUP = 250  # a directory's stats between two pause points: about 4 ms


def _each(store: ObjectStore, action: Callable[[str], T], shas: Iterable[str]) -> list[T]:
    """``action`` of every blob, in order: on up to ``_STORE_THREADS`` threads, one task per
    group of blobs, for a store that answers over the network; in this thread for a
    directory (its stat is a local call: threads would only contend for the GIL, 1,000
    stats took 28 ms on 16 threads and 17 ms on one), stepping aside between groups for a
    priority request in flight (``service.yielding``: callers hold no transaction)."""
    order = list(shas)
    if isinstance(store, DirectoryStore):
        found: list[T] = []
        for start in range(0, len(order), _LOCAL_GROUP):
            found += [action(sha) for sha in order[start : start + _LOCAL_GROUP]]
            step_aside()  # after each group, the last too: what the caller does next is long
        return found
    size = max(1, -(-len(order) // _STORE_THREADS))
    groups = [order[start : start + size] for start in range(0, len(order), size)]
    done = parallel(lambda group: [action(sha) for sha in group], groups, threads=_STORE_THREADS)
    return [found for group in done for found in group]


def stored_sizes(store: ObjectStore, shas: Iterable[str]) -> dict[str, int | None]:
    """The stored size of each blob; None for a blob the store does not hold."""
    order = list(shas)
    return dict(
        zip(
            order,
            _each(store, lambda sha: _size(store, sha), order),
            strict=True,
        )
    )


def stored_blobs(
    store: ObjectStore,
    sizes: Mapping[str, int],
    *,
    metrics: Metrics,
    damaged: frozenset[str] = frozenset(),
    unproven: frozenset[str] = frozenset(),
    opened_at: datetime | None = None,
) -> dict[str, StoredBlob]:
    """What the store's metadata says of each blob: its size, and ``sha256_ok=True`` where
    the store's own checksum of the bytes it received is the blob's SHA-256 (None: not
    known; a checksum that differs proves nothing, it may be a multipart upload's).

    A blob the catalog found ``damaged`` is read back instead (its size alone cannot tell a
    rewritten blob from a rotten one; the agent rewrites damaged blobs, so this is rare). Of
    an ``unproven`` blob (run isolation), nothing unless it was written since ``opened_at``:
    else it is ``written=False``, its size and presence unsaid.
    """

    def check(sha: str) -> StoredBlob:
        found = _stat(store, sha)
        if sha in unproven:
            assert opened_at is not None, "an unproven blob is checked against an opening"
            if found is None or not written_since(found.modified, opened_at):
                return StoredBlob(size=None, written=False)
        if found is None:
            return StoredBlob(size=None)
        if found.size == sizes[sha] and sha in damaged:
            return read_back(store, sha, metrics=metrics, by="commit")
        confirmed = found.size == sizes[sha] and found.sha256 == sha
        return StoredBlob(size=found.size, sha256_ok=True if confirmed else None)

    return dict(zip(sizes, _each(store, check, sizes), strict=True))


def read_back_all(
    store: ObjectStore, sizes: Mapping[str, int], *, metrics: Metrics, by: str
) -> dict[str, StoredBlob]:
    """Each blob read back whole (those of the recorded size), many at once."""

    def check(sha: str) -> StoredBlob:
        size = _size(store, sha)
        if size != sizes[sha]:
            return StoredBlob(size=size)
        return read_back(store, sha, metrics=metrics, by=by)

    return dict(zip(sizes, _each(store, check, sizes), strict=True))


def read_back(store: ObjectStore, sha: str, *, metrics: Metrics, by: str) -> StoredBlob:
    """Read one blob whole: its size and whether its bytes match its SHA-256 (``by``: who
    reads, for ``ckpt_blob_read_bytes``).

    Raises:
        StoreUnavailableError: the store failed to answer (not: it has no such blob).
    """
    try:
        data = store.get(keys.blob_key(sha))
    except BadObjectError:
        return StoredBlob(size=None)
    except StoreError as err:
        raise StoreUnavailableError(f"cannot read blob {sha} from the store: {err}") from err
    metrics.blob_read_bytes.labels(by=by).inc(len(data))
    return StoredBlob(size=len(data), sha256_ok=hashlib.sha256(data).hexdigest() == sha)


def _size(store: ObjectStore, sha: str) -> int | None:
    try:
        return store.size(keys.blob_key(sha))
    except StoreError as err:
        raise StoreUnavailableError(f"the store cannot be read: {err}") from err


def _stat(store: ObjectStore, sha: str) -> StoredObject | None:
    try:
        return store.stat(keys.blob_key(sha))
    except StoreError as err:
        raise StoreUnavailableError(f"the store cannot be read: {err}") from err
