"""Object stores: a small protocol over string keys (``base``), the directory store
(``directory``: the embedded default and the reference), S3 (``s3``), and the object keys
(``keys``). ``open_store`` picks one by URL.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse
from urllib.request import url2pathname

from ckpt.core.storage.base import ObjectStore, StoredObject
from ckpt.core.storage.directory import DirectoryStore
from ckpt.core.version import install_hint

__all__ = ["DirectoryStore", "ObjectStore", "StoredObject", "open_store"]


def open_store(url: str) -> ObjectStore:
    """The store for a URL: a directory path, ``file://`` URL, or ``s3://bucket/prefix``
    (``CKPT_S3_ENDPOINT`` names a MinIO or other S3-compatible endpoint).

    Raises:
        ValueError: an unsupported scheme.
    """
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
            from ckpt.core.storage.s3 import S3ObjectStore
        except ImportError as err:
            raise ValueError(f"{url}: S3 needs boto3: {install_hint('s3')} ({err})") from err
        return S3ObjectStore(url, endpoint_url=os.environ.get("CKPT_S3_ENDPOINT") or None)
    raise ValueError(
        f"unsupported store URL {url!r}: use a directory path, file:///path or s3://bucket/prefix"
    )
