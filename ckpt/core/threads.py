"""Blob I/O on threads.

hashlib and file and socket I/O release the GIL on large buffers, so blobs are hashed,
written and read on threads: on 2 cores this nearly halves the time of a save or a restore.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar


def _io_threads() -> int:
    """Two threads per core, 2 to 8, shared by the ranks of one host (torchrun sets
    ``LOCAL_WORLD_SIZE``): eight ranks on a node do not start 64 hashing threads each."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(2, min(8, 2 * (os.cpu_count() or 1) // ranks))


IO_THREADS = _io_threads()

T = TypeVar("T")
R = TypeVar("R")


def parallel(action: Callable[[T], R], items: Iterable[T], *, threads: int = IO_THREADS) -> list[R]:
    """``action`` of every item, on up to ``threads`` threads, in the items' order."""
    items = list(items)
    if len(items) <= 1:
        return [action(item) for item in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="ckpt-io") as pool:
        return list(pool.map(action, items))


def lower_priority(niceness: int) -> None:
    """Raise the calling thread's niceness by ``niceness``, so that it takes only the CPU
    the other threads leave (threads it starts inherit it). Linux only, where niceness is
    per thread; elsewhere it would be the whole process's, so nothing is done."""
    if niceness <= 0 or sys.platform != "linux":
        return
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):  # a container may forbid it: the save runs all the same
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + niceness)


def save_niceness() -> int:
    """How far below training a save's background threads run (``CKPT_SAVE_NICENESS``).

    Raises:
        ValueError: the variable is not a whole number from 0 to 19.
    """
    raw = os.environ.get("CKPT_SAVE_NICENESS", "").strip() or "0"
    if not raw.isdigit() or int(raw) > 19:
        raise ValueError(
            f"CKPT_SAVE_NICENESS={raw!r}: expected a whole number from 0 (the save's threads at "
            "training's priority) to 19 (the lowest)"
        )
    return int(raw)
