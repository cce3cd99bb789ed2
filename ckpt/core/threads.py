"""Blob I/O on threads.

hashlib and file and socket I/O release the GIL on large buffers, so blobs are hashed,
written and read on threads: on 2 cores this nearly halves the time of a save or a restore.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

IO_THREADS = max(2, min(8, 2 * (os.cpu_count() or 1)))

T = TypeVar("T")
R = TypeVar("R")


def parallel(action: Callable[[T], R], items: Iterable[T], *, threads: int = IO_THREADS) -> list[R]:
    """``action`` of every item, on up to ``threads`` threads, in the items' order."""
    items = list(items)
    if len(items) <= 1:
        return [action(item) for item in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="ckpt-io") as pool:
        return list(pool.map(action, items))
