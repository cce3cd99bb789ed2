"""What the store holds of blobs, read outside any transaction and many at once: sizes, the
SHA-256 of those not verified before, and for run isolation when each was written. A store
that cannot be read is a ``StoreUnavailableError``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from datetime import datetime

from ckpt.core.errors import BadObjectError, StoreError
from ckpt.core.storage import ObjectStore, StoredObject, keys
from ckpt.core.threads import parallel
from ckpt.service.bundles.isolation import written_since
from ckpt.service.completeness import StoredBlob
from ckpt.service.errors import StoreUnavailableError

_STORE_THREADS = 4


def stored_sizes(store: ObjectStore, shas: Iterable[str]) -> dict[str, int | None]:
    """The stored size of each blob; None for a blob the store does not hold."""
    order = list(shas)
    return dict(
        zip(
            order,
            parallel(lambda sha: _size(store, sha), order, threads=_STORE_THREADS),
            strict=True,
        )
    )


def stored_blobs(
    store: ObjectStore,
    sizes: Mapping[str, int],
    *,
    verified: frozenset[str],
    unproven: frozenset[str] = frozenset(),
    opened_at: datetime | None = None,
) -> dict[str, StoredBlob]:
    """What the store holds of each blob: size always, SHA-256 unless ``verified`` before.
    Of an ``unproven`` blob (run isolation), nothing unless it was written since
    ``opened_at``: else it is ``written=False``, its size and presence unsaid."""

    def check(sha: str) -> StoredBlob:
        if sha in unproven:
            assert opened_at is not None, "an unproven blob is checked against an opening"
            found = _stat(store, sha)
            if found is None or not written_since(found.modified, opened_at):
                return StoredBlob(size=None, written=False)
            size: int | None = found.size
        else:
            size = _size(store, sha)
        if size != sizes[sha] or sha in verified:
            return StoredBlob(size=size)
        return read_back(store, sha)

    return dict(zip(sizes, parallel(check, sizes, threads=_STORE_THREADS), strict=True))


def read_back(store: ObjectStore, sha: str) -> StoredBlob:
    """Read one blob whole: its size and whether its bytes match its SHA-256.

    Raises:
        StoreUnavailableError: the store failed to answer (not: it has no such blob).
    """
    try:
        data = store.get(keys.blob_key(sha))
    except BadObjectError:
        return StoredBlob(size=None)
    except StoreError as err:
        raise StoreUnavailableError(f"cannot read blob {sha} from the store: {err}") from err
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
