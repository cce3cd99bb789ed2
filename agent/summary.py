"""One line for the user per resume, per durable save and per change of the auto interval,
with or without logging set up.

The lines go to the ``ckpt`` logger at INFO when the program configured logging (any
handler on it or on the root logger), and straight to standard error otherwise, so that a
script that never touched ``logging`` still sees what ckpt did. ``quiet``
(``CKPT_QUIET=1``) silences them; warnings and errors are logged either way.
"""

from __future__ import annotations

import contextlib
import logging
import sys

log = logging.getLogger("ckpt")


def announce(message: str, *, quiet: bool) -> None:
    if quiet:
        log.debug("%s", message)
    elif log.hasHandlers():
        log.info("%s", message)
    else:
        with contextlib.suppress(OSError, ValueError):  # a broken stderr fails no save
            print(message, file=sys.stderr, flush=True)


def format_seconds(seconds: float) -> str:
    """``350 ms``, ``4.27 s``, ``1234 s``: three significant figures, whole seconds above."""
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 100:
        return f"{seconds:.3g} s"
    return f"{seconds:.0f} s"


def format_bytes(count: int) -> str:
    """``1.02 GB``, ``3.4 MB``, ``812 B`` (powers of 1000)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.{1 if count >= 10 * size else 2}f} {unit}"
    return f"{count} B"
