"""The signal plumbing itself, in process: no signal lost, no Ctrl-C turned into an interrupt
too early, no handler left dangling, no staging buffer reused while it is persisted."""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.attempt.signals import SignalWatch
from ckpt import Checkpointer
from ckpt.core.storage import DirectoryStore


def preemption() -> SignalWatch:
    return SignalWatch(deadline_seconds=30, on_deadline=lambda: None)


def test_a_signal_during_a_long_c_call_is_noted_at_once_and_interrupts_nothing() -> None:
    """The watcher notes the signal while the main thread is inside one long C call; the
    first SIGINT must not become a KeyboardInterrupt (only a second one does)."""
    guard = preemption()
    assert guard.install()
    noted_during_call: list[bool] = []
    try:
        data = b"x" * (256 << 20)

        def interrupt_then_look() -> None:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            noted_during_call.append(guard.requested)

        threading.Timer(0.02, interrupt_then_look).start()
        hashlib.sha256(data).hexdigest()  # releases the GIL for ~0.15 s
        hashlib.sha256(data).hexdigest()
        for _ in range(1000):  # bytecodes: the Python-level handler runs here
            pass
        assert guard.requested and guard.signum == signal.SIGINT
        assert noted_during_call == [True]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
    finally:
        guard.uninstall()


def test_closing_checkpointers_out_of_order_leaves_no_dead_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    first, second = preemption(), preemption()
    first.install()
    second.install()
    first.uninstall()
    assert signal.getsignal(signal.SIGTERM) == second._handle  # the live one keeps it
    second.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


class GatedStore(DirectoryStore):
    """Blob writes wait until released: a persist that is certainly still in flight."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.writing = threading.Event()
        self.release = threading.Event()

    def put(self, key: str, pieces: Iterable[memoryview | bytes]) -> None:
        kept = list(pieces)
        self.writing.set()
        assert self.release.wait(timeout=300)
        super().put(key, kept)


def test_an_interrupted_wait_keeps_the_save_in_flight(tmp_path: Path) -> None:
    """Ctrl-C inside wait(): the persist still reads the staging buffers, so the next save
    must wait for it rather than copy new state into them."""
    model = nn.Linear(64, 64)
    store = GatedStore(tmp_path)
    ckpt = Checkpointer(run="r", models=model, store=store, handle_signals=False)
    first = ckpt.save()

    def interrupt_once_writing() -> None:
        assert store.writing.wait(timeout=300)
        # To the main thread itself: a signal sent to the process may land on any thread,
        # and then the main thread's lock wait is never interrupted (seen on a busy machine).
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    # Python's own Ctrl-C handler, whatever an earlier test in this process left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            threading.Thread(target=interrupt_once_writing).start()
            ckpt.wait()  # blocks until the interrupt: the persist cannot end before release
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not first.done()
    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.counters.step = 1
    store.release.set()
    second = ckpt.save()  # waits for the first persist before staging
    assert first.done() and first.durable
    second.wait()
    ckpt.close()


def test_the_exit_after_a_signal_leaves_the_heap_to_the_os(tmp_path: Path) -> None:
    """The interpreter's exit collects the whole heap several times over: with torch loaded,
    2 CPU-seconds, half a minute on a busy machine, past the grace period. What lives when
    ``maybe_save()`` raises SystemExit is frozen: the exit skips it."""
    ckpt = Checkpointer(run="r", models=nn.Linear(4, 4), store=str(tmp_path))
    gc.unfreeze()
    try:
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)
        while not ckpt.stopping:  # the watcher thread notes it
            time.sleep(0.01)
        with pytest.raises(SystemExit) as exited:
            ckpt.maybe_save()
        assert exited.value.code == 143
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this pytest process goes on
        ckpt.close()
