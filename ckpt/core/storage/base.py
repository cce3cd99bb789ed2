"""The object-store seam.

Keys are plain ``str`` (``blobs/sha256/ab/ab12...``), never paths, so the same keys work
on a directory and on S3. A ``put`` is atomic: readers see the whole object or nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol, runtime_checkable


class StoredObject(NamedTuple):
    """One object of a listing."""

    key: str
    size: int
    modified: float  # seconds since the epoch, when the object was last written
    # The SHA-256 (hex) of the whole object as the store computed it when it received the
    # bytes, where it keeps one (S3 and MinIO, for an object uploaded in one PUT with
    # ``x-amz-checksum-sha256``); None otherwise. ``stat`` fills it in, listings do not.
    sha256: str | None = None


@runtime_checkable
class ObjectStore(Protocol):
    """Where blobs and manifests live."""

    url: str

    def put(self, key: str, pieces: Iterable[memoryview | bytes]) -> None:
        """Store the concatenation of ``pieces`` under ``key``, atomically."""
        ...

    def get(self, key: str) -> bytes:
        """The whole object; raises ``StoreError`` when it is absent."""
        ...

    def read_into(self, key: str, buffer: memoryview) -> int:
        """Fill ``buffer`` from the start of the object; returns the object's size.

        Raises ``StoreError`` when the object is absent or does not fit ``buffer``.
        """
        ...

    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None when it is absent."""
        ...

    def stat(self, key: str) -> StoredObject | None:
        """The object's size and when it was last written, or None when it is absent."""
        ...

    def list_keys(self, prefix: str) -> Iterator[str]:
        """Every key that starts with ``prefix``, in lexicographic order."""
        ...

    def list_objects(self, prefix: str) -> Iterator[StoredObject]:
        """Every object whose key starts with ``prefix``, with its size and age, by key."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; absent keys are ignored."""
        ...

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove every one of ``keys`` (as few requests as the store allows); absent keys
        are ignored. Raises ``StoreError`` naming the keys it could not remove."""
        ...
