"""Catching SIGTERM and SIGINT without losing them, and the exit code after.

A Python signal handler runs only when the main thread next executes Python bytecode: a
training step stuck in one long C call (a compile, a collective, an evaluation) would
hold it back past the grace period, which is how "check a flag at step boundaries" setups
end up never saving in time. So the C-level wakeup fd (``signal.set_wakeup_fd``) also
wakes a watcher thread at once; the watcher notes the signal and arms a deadline. The
training loop acts on the signal at its next step boundary (``Checkpointer.maybe_save``,
through ``grace``); if it has not by the deadline, the deadline action ends the
process itself.

A process the agent ends after a signal exits with ``128 + signal`` — ``EXIT_PREEMPTED``
(143) for SIGTERM — the code of a process the signal killed, so a supervisor reads both
the same way.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("ckpt")

EXIT_PREEMPTED = 128 + signal.SIGTERM
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalWatch:
    """Notes the first SIGTERM or SIGINT and calls ``on_deadline`` when ``deadline_seconds``
    have passed since it without ``settle`` being called."""

    def __init__(self, *, deadline_seconds: float, on_deadline: Callable[[], None]) -> None:
        self.deadline_seconds = deadline_seconds
        self.signum: int | None = None
        self.received_at: float | None = None
        self._on_deadline = on_deadline
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._previous: dict[int, Any] = {}
        self._previous_fd: int | None = None
        self._pipe: tuple[socket.socket, socket.socket] | None = None
        self._watcher: threading.Thread | None = None
        self._interrupts = 0
        self._closed = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def elapsed(self) -> float:
        """Seconds since the signal (0 when none came)."""
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at

    def install(self) -> bool:
        """Take over SIGTERM and SIGINT; False (and nothing changed) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("ckpt: signals can only be handled from the main thread; not handling them")
            return False
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._pipe = (reader, writer)
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="ckpt-signals", daemon=True)
        self._watcher.start()
        return True

    def uninstall(self) -> None:
        """Give the signals back (main thread only), stop the deadline and the watcher thread,
        and drop ``on_deadline`` (and all it reaches: the checkpointer, the model, the data)."""
        self._settled.set()
        self._on_deadline = _nothing
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return
        # Another checkpointer may have taken the signals since: leave its handlers alone.
        current = signal.set_wakeup_fd(-1)
        if current != self._pipe[1].fileno():
            signal.set_wakeup_fd(current)  # it changed hands: put it back
        elif self._previous_fd is not None and self._previous_fd >= 0:
            with contextlib.suppress(OSError, ValueError):  # its owner may have closed it
                signal.set_wakeup_fd(self._previous_fd)
        self._closed = True
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, _live(previous, signum))
        # A forked child (a DataLoader worker) holds a copy of the writer, so closing ours
        # is no end of file for the watcher: shutting the reader down wakes it at once.
        with contextlib.suppress(OSError):
            self._pipe[0].shutdown(socket.SHUT_RDWR)
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        for end in self._pipe:
            end.close()
        self._pipe = None

    def settle(self) -> None:
        """The loop handled the signal: the deadline action must not run."""
        self._settled.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # The watcher notes every signal (through the wakeup fd); the handler only counts
        # Ctrl-Cs. It takes no lock and starts no thread: it may run inside either.
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1 and not self._settled.is_set():
                signal.default_int_handler(signum, frame)  # a second Ctrl-C interrupts

    def _watch(self) -> None:
        pipe = self._pipe
        assert pipe is not None
        while True:
            try:
                data = pipe[0].recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in SIGNALS:
                    self._note(signum)

    def _note(self, signum: int) -> None:
        with self._lock:
            if self.signum is not None:
                return
            self.signum, self.received_at = signum, time.monotonic()
        log.warning(
            "ckpt: %s received; saving at the next step boundary if it fits in %.0f s",
            signal.Signals(signum).name,
            self.deadline_seconds,
        )
        threading.Thread(target=self._arm, name="ckpt-deadline", daemon=True).start()

    def _arm(self) -> None:
        if not self._settled.wait(self.deadline_seconds):
            self._on_deadline()


def _nothing() -> None:
    return None


def _live(handler: Any, signum: int) -> Any:
    """The handler to give a signal back to: past the handlers of closed ``SignalWatch``es
    (checkpointers closed out of order) to the one before them."""
    owner = getattr(handler, "__self__", None)
    while isinstance(owner, SignalWatch) and owner._closed:
        handler = owner._previous.get(signum, signal.SIG_DFL)
        owner = getattr(handler, "__self__", None)
    return handler
