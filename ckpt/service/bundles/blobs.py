"""What the store holds of blobs, read outside any transaction and many at once: sizes, and
the SHA-256 of those not verified before. A store that cannot be read is a
``StoreUnavailableError``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from ckpt.core.errors import StoreError
from ckpt.core.storage import ObjectStore, keys
from ckpt.core.threads import parallel
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
    store: ObjectStore, sizes: Mapping[str, int], *, verified: frozenset[str]
) -> dict[str, StoredBlob]:
    """What the store holds of each blob: size always, SHA-256 unless verified before."""

    def check(sha: str) -> StoredBlob:
        size = _size(store, sha)
        if size != sizes[sha] or sha in verified:
            return StoredBlob(size=size)
        try:
            data = store.get(keys.blob_key(sha)) if size else b""
        except StoreError as err:
            raise StoreUnavailableError(f"cannot read blob {sha} from the store: {err}") from err
        return StoredBlob(size=len(data), sha256_ok=hashlib.sha256(data).hexdigest() == sha)

    return dict(zip(sizes, parallel(check, sizes, threads=_STORE_THREADS), strict=True))


def _size(store: ObjectStore, sha: str) -> int | None:
    try:
        return store.size(keys.blob_key(sha))
    except StoreError as err:
        raise StoreUnavailableError(f"the store cannot be read: {err}") from err
