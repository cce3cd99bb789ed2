"""Log lines that a client cannot forge.

Client text (a quarantine reason, a pod name, a database error quoting a value) reaches the
service's logs. A newline in it would start a line of the client's choosing, an escape
sequence would rewrite the operator's terminal. ``escape`` writes every such character as a
visible escape (``\\n``, ``\\x1b``, ``\\u2028``); ``protect`` installs a filter that applies it
to every message of the service's loggers, whatever the call site formats into it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

# C0 controls, DEL, C1 controls and the Unicode line and paragraph separators: everything
# that str.splitlines() or a terminal treats as more than a character.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}

SERVICE_LOGGERS = (
    "ckpt.service",
    "ckpt.runs",
    "ckpt.gc",
    "ckpt.scrub",
    "ckpt.rebuild",
    "ckpt.limits",
)


def escape(text: object) -> str:
    """``str(text)`` on one line, with every control character written as an escape."""
    rendered = str(text)
    if not _CONTROL.search(rendered):
        return rendered
    # Backslashes are doubled too (only in lines that need escaping), so that a client
    # cannot write a literal "\n" that reads like an escaped newline.
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\\]", _escape_one, rendered)


def _escape_one(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class EscapeControlCharacters(logging.Filter):
    """Render each record's message once, escaped: the arguments are client text."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _CONTROL.search(message):
            record.msg, record.args = escape(message), None
        return True


_FILTER = EscapeControlCharacters()


def protect(names: Iterable[str] = SERVICE_LOGGERS) -> None:
    """Escape control characters in every message of these loggers (idempotent).

    A filter on a logger sees only the records logged on it, not its children's: every
    logger of the service is named here, and a new one belongs in ``SERVICE_LOGGERS``.
    """
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
