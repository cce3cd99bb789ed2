"""A progress line for long uploads and downloads, on a terminal only.

``CKPT_PROGRESS=1`` forces it on (for a log file, say), ``CKPT_PROGRESS=0`` off; by default
it shows when standard error is a terminal. Nothing is drawn for a transfer that ends
within its first second, so quick saves stay quiet.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TextIO

_REDRAW_SECONDS = 0.25
_QUIET_SECONDS = 1.0


def enabled(stream: TextIO) -> bool:
    setting = os.environ.get("CKPT_PROGRESS", "").strip().lower()
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    return stream.isatty()


def format_progress(label: str, done: int, total: int, seconds: float) -> str:
    """``label  412.1/1023.4 MB  40%  0.85 GB/s``."""
    percent = 100 * done / total if total else 100.0
    rate = done / seconds / 1e9 if seconds > 0 else 0.0
    return f"{label}  {done / 1e6:.1f}/{total / 1e6:.1f} MB  {percent:3.0f}%  {rate:.2f} GB/s"


class Progress:
    """Counts bytes done out of ``total`` (from any thread) and redraws one status line."""

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._show = enabled(self._stream)
        self._started = time.monotonic()
        self._drawn_at = 0.0
        self._drawn = False
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if (
                self._show
                and now - self._started >= _QUIET_SECONDS
                and now - self._drawn_at >= _REDRAW_SECONDS
            ):
                self._draw(now, end="\r")

    def close(self) -> None:
        """Finish the line, if one was drawn."""
        with self._lock:
            if self._drawn:
                self._draw(time.monotonic(), end="\n")

    def _draw(self, now: float, *, end: str) -> None:
        line = format_progress(self.label, self.done, self.total, now - self._started)
        self._stream.write(f"\r{line}\x1b[K{end}")
        self._stream.flush()
        self._drawn_at = now
        self._drawn = True
