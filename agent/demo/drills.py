"""The demo trainers' drills: a SIGKILL in the middle of an upload (``DrillStore``, aimed
by ``aim_drill``, recorded in a file so that it fires once per run), a SIGTERM of its own at
a position, and a hold at the step ``ckpt demo``'s chaos loop signals."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt.core.storage import ObjectStore

if TYPE_CHECKING:
    from agent.checkpointer import Checkpointer
    from agent.save.result import PendingSave

STOP_WAIT_SECONDS = 60.0  # the longest a drill waits for a SIGTERM to be noted


def drill_armed(marker: str | None) -> bool:
    """Whether the SIGKILL drill may fire: always without a record file, else only while
    there is none (it fires once per run, not once per attempt)."""
    return marker is None or not os.path.exists(marker)


def record_drill(marker: str | None, *, outcome: str, step: int) -> None:
    """Write what the drill did (``killed``, or ``nothing to upload``) to its record file."""
    if marker is not None:  # whole or not at all: a reader never sees it half written
        partial = f"{marker}.{os.getpid()}.{threading.get_ident()}"
        with open(partial, "w") as out:
            json.dump({"outcome": outcome, "step": step}, out)
        os.replace(partial, marker)


class DrillStore:
    """The real store, with uploads slowed down or the process killed in the middle of one."""

    def __init__(self, inner: ObjectStore, *, delay: float, marker: str | None) -> None:
        self.inner = inner
        self.url = inner.url
        self.delay = delay
        self.marker = marker
        self.kill_in_upload_of: int | None = None  # the step whose bundle the drill aims at
        self.drill_over = False  # it found its bundle stored already
        self.spared = False  # it met a process told to stop: that attempt must end preempted
        self.stopping: Callable[[], bool] = lambda: False  # Checkpointer.stopping, once built
        self._fire = threading.Lock()

    def put(self, key: str, pieces: Iterable[memoryview | bytes]) -> None:
        if key.startswith("blobs/"):
            if self.kill_in_upload_of is not None and self.stopping():
                self.spared = True
            elif self.kill_in_upload_of is not None:
                self._fire.acquire()  # one upload thread kills; the others wait for it
                record_drill(self.marker, outcome="killed", step=self.kill_in_upload_of)
                print("killed during an upload", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.delay)
        self.inner.put(key, pieces)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def aim_drill(
    store: DrillStore, *, at: int | None, every: int | None, position: tuple[int, int]
) -> bool:
    """Whether the SIGKILL drill aims at the save due at ``position``: the first save due at
    or after step ``at``. Its upload spares a process told to stop (``DrillStore.put``: the
    attempt of an emergency save must end preempted); a save spared, or skipped on a busy
    machine, moves it to the next save.
    """
    if at is None or every is None:
        return False
    step, micro = position
    due = micro == 0 and step % every == 0
    return due and step >= at and not store.drill_over and drill_armed(store.marker)


def finish_drill(store: DrillStore, saved: PendingSave | None) -> None:
    """Wait for the bundle the SIGKILL drill aims at, then disarm it.

    Uploading one of its blobs kills the process (``DrillStore.put``), so coming back here
    with a save means it had none to upload: the store already held every one
    (deduplicated), as it does when an earlier run saved the same state. That is recorded,
    not hidden. Without a save (skipped), or with one it spared, it aims at the next one.
    """
    step = store.kill_in_upload_of
    assert step is not None
    if saved is not None:
        saved.wait()
    if saved is not None and not store.spared:
        print(f"SIGKILL drill: the bundle of step {step} had no blob to upload", flush=True)
        record_drill(store.marker, outcome="nothing to upload", step=step)
        store.drill_over = True
    store.kill_in_upload_of = None
    store.spared = False


def signal_self(ckpt: Checkpointer) -> None:
    """SIGTERM this process, as a preemption does, and wait until the checkpointer has noted
    it: a thread of its own reads signals, and on a busy machine the loop could run steps on
    before it does, so that the drill's signal landed later than its position."""
    os.kill(os.getpid(), signal.SIGTERM)
    _until_stopping(ckpt, lambda: True)


def hold_for_signal(ckpt: Checkpointer, hold_file: str | None, position: tuple[int, int]) -> None:
    """``--hold-file``: at a step boundary at or after the step the file names, wait for the
    SIGTERM ``ckpt demo``'s chaos loop sends when the heartbeats report that step, until the
    file names a later step or none. Aimed by heartbeats alone, the signal could land steps
    late on a busy machine, or after the last step."""
    if hold_file is not None and position[1] == 0:
        _until_stopping(ckpt, lambda: _held_at(hold_file) <= position[0])


def _held_at(hold_file: str) -> float:
    """The step the hold file names (infinity: none)."""
    try:
        return int(Path(hold_file).read_text())
    except (OSError, ValueError):
        return math.inf


def _until_stopping(ckpt: Checkpointer, waiting: Callable[[], bool]) -> None:
    """Until the checkpointer has noted a stop signal, while ``waiting()`` (at most
    ``STOP_WAIT_SECONDS``); sleeping gives the GIL to the thread that notes it."""
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while not ckpt.stopping and waiting() and time.monotonic() < deadline:
        time.sleep(0.005)
