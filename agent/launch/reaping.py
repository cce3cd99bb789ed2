"""Linux process-tree chores of ``ckpt launch``: find its children, kill orphans it adopted.

torchrun starts each rank in a session of its own, out of reach of a kill of the trainer's
process group. ``subreaper`` makes the supervisor the parent of such orphans, ``children``
finds them, and ``kill_orphans`` kills them with their groups.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path


def children() -> set[int]:
    """The supervisor's child processes (Linux; none found elsewhere)."""
    me, found = os.getpid(), set()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and _parent(Path(entry.path, "stat")) == me:
                found.add(int(entry.name))
    return found


def _parent(stat: Path) -> int | None:
    try:
        text = stat.read_text()
    except OSError:  # gone already
        return None
    # "pid (command) state ppid ...": the command may hold spaces and parentheses.
    return int(text.rpartition(")")[2].split()[1])


def kill_orphans(pids: set[int]) -> None:
    """SIGKILL processes the supervisor adopted (with their process groups) and reap them."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """Linux: adopt the trainer's orphaned descendants while supervising.

    torchrun starts each rank in a session of its own, out of reach of a kill of the
    trainer's group: were torchrun killed, its ranks would live on beside the next attempt.
    A subreaper becomes the parent of such orphans, so ``_Trainer.wait`` finds and kills them.
    """
    if not sys.platform.startswith("linux"):
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    previous = ctypes.c_int(0)
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, previous.value, 0, 0, 0)
