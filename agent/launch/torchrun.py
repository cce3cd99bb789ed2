"""What ``ckpt launch`` reads of torchrun: whether a command runs it, and how it ended.

torchrun exits 1 however its ranks ended; what it prints last on its stderr says the rest
(see ``agent.launch.supervisor``). ``Tail`` copies that stderr through and keeps its end;
``ending`` reads it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass(frozen=True)
class Ending:
    """How one attempt ended: the return code it stands for, and the words for the log.

    ``returncode`` reads like ``Popen.returncode`` (negative: killed by that signal): the
    trainer's own, or for torchrun what its stderr says (``ending``).
    """

    returncode: int
    description: str


# What torchrun prints last when it ends (torch 2.x, measured): the exception that ended it.
_TORCHRUN_SIGNALLED = re.compile(r"SignalException: Process \d+ got signal: (\d+)")
_TORCHRUN_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*: (\d+).*?exitcode\s*: (-?\d+)", re.S
)


def ending(returncode: int, *, torchrun_stderr: str | None = None) -> Ending:
    """What an attempt that ended with ``returncode`` stands for.

    Args:
        returncode: the trainer's, as ``Popen.returncode``.
        torchrun_stderr: the end of torchrun's stderr when the trainer is torchrun, which
            exits 1 however its ranks failed: torchrun stopped by signal S stands for -S,
            and a failed rank for the exit code of the first to fail.
    """
    who = "trainer" if torchrun_stderr is None else "torchrun"
    said = f"{who} {fate(returncode)}"
    if torchrun_stderr is None or returncode <= 0:  # succeeded, or torchrun itself was killed
        return Ending(returncode, said)
    last = _last(_TORCHRUN_SIGNALLED, torchrun_stderr), _last(_TORCHRUN_ROOT_CAUSE, torchrun_stderr)
    signalled, cause = last
    if signalled is not None and (cause is None or signalled.start() > cause.start()):
        signum = int(signalled[1])
        return Ending(
            -signum, f"torchrun (stopped by {_signal_name(signum)}) exited with {returncode}"
        )
    if cause is not None and int(cause[2]) != 0:
        rank, code = int(cause[1]), int(cause[2])
        return Ending(code, f"{said}: rank {rank} {fate(code)} first")
    return Ending(returncode, said)


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    """The last match of ``pattern`` in ``text``: torchrun's own words come at the end."""
    matches = list(pattern.finditer(text))
    return matches[-1] if matches else None


def is_torchrun(command: Sequence[str]) -> bool:
    """Whether ``command`` runs torchrun: ``torchrun ...``, ``python -m torch.distributed.run``."""
    module = any(a == "-m" and b == "torch.distributed.run" for a, b in itertools.pairwise(command))
    return module or any(Path(word).name == "torchrun" for word in command)


class Tail:
    """Copies a pipe through to our stderr as it comes, and keeps the end of it."""

    KEEP = 1 << 16

    def __init__(self, pipe: IO[bytes]) -> None:
        self._pipe = pipe
        self._kept = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, name="ckpt-launch-tail", daemon=True)
        self._thread.start()

    def text(self, *, timeout: float) -> str:
        """The last ``KEEP`` bytes, once the pipe is closed (or ``timeout`` passed)."""
        self._thread.join(timeout)
        with self._lock:
            return self._kept.decode(errors="replace")

    def _copy(self) -> None:
        with self._pipe:
            while chunk := os.read(self._pipe.fileno(), self.KEEP):
                _write_stderr(chunk)
                with self._lock:
                    self._kept += chunk
                    del self._kept[: -self.KEEP]


def _write_stderr(data: bytes) -> None:
    """Write to file descriptor 2, where the trainer's stderr would have gone unread."""
    view = memoryview(data)
    with contextlib.suppress(OSError):  # our stderr is gone: keep draining the trainer's
        while view:
            view = view[os.write(2, view) :]


def fate(returncode: int) -> str:
    """``exited with N`` or ``killed by SIGX``, for a ``Popen.returncode``."""
    if returncode < 0:
        return f"killed by {_signal_name(-returncode)}"
    return f"exited with {returncode}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal has no name
        return f"signal {signum}"
