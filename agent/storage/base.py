"""The object-store seam.

Keys are plain ``str`` (``blobs/sha256/ab/ab12...``), never paths, so the same keys work
on a directory and on S3. A ``put`` is atomic: readers see the whole object or nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import NamedTuple, Protocol, runtime_checkable
from urllib.parse import urlparse
from urllib.request import url2pathname


class StoredObject(NamedTuple):
    """One object of a listing."""

    key: str
    size: int
    modified: float  # seconds since the epoch, when the object was last written


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

    def list_keys(self, prefix: str) -> Iterator[str]:
        """Every key that starts with ``prefix``, in lexicographic order."""
        ...

    def list_objects(self, prefix: str) -> Iterator[StoredObject]:
        """Every object whose key starts with ``prefix``, with its size and age, by key."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; absent keys are ignored."""
        ...


def open_store(url: str) -> ObjectStore:
    """The store for a URL: a directory path, ``file://`` URL, or ``s3://bucket/prefix``
    (``CKPT_S3_ENDPOINT`` names a MinIO or other S3-compatible endpoint).

    Raises:
        ValueError: an unsupported scheme.
    """
    from agent.storage.directory import DirectoryStore

    parsed = urlparse(url)
    if parsed.scheme == "":
        return DirectoryStore(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(
                f"store URL {url!r} names host {parsed.netloc!r}; use file:///absolute/path"
            )
        return DirectoryStore(url2pathname(parsed.path))
    if parsed.scheme == "s3":
        try:
            from agent.storage.s3 import S3ObjectStore
        except ImportError as err:
            raise ValueError(f"{url}: S3 needs boto3: pip install 'ckpt[s3]' ({err})") from err
        return S3ObjectStore(url, endpoint_url=os.environ.get("CKPT_S3_ENDPOINT") or None)
    raise ValueError(
        f"unsupported store URL {url!r}: use a directory path, file:///path or s3://bucket/prefix"
    )
