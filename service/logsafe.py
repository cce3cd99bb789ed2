"""Text that a client cannot forge: in the service's log lines and on the dashboard's pages.

Client text (a quarantine reason, a pod name, a notice, a database error quoting a value)
reaches the service's logs and pages. A newline in it would start a line of the client's
choosing, an escape sequence would rewrite the operator's terminal, a bidirectional override
(U+202E) would make "\\u202elive" read "evil". ``escape`` writes every such character as a
visible escape (``\\n``, ``\\x1b``, ``\\u202e``); ``protect`` installs a filter that applies
it to every message of the service's loggers, whatever the call site formats into it;
``reveal`` does the same for a page's text, where line breaks and tabs are mere spaces.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from service.names import HIDDEN, HIDDEN_BEYOND_C0

# Everything service.names.HIDDEN holds: C0, DEL, C1, the Unicode line and paragraph
# separators, the bidirectional controls and the other invisible format characters.
_CONTROL = re.compile(f"[{HIDDEN}]")
_ESCAPED = re.compile(f"[{HIDDEN}\\\\]")
# On a page: the same but for the whitespace HTML shows as a space (and markup is made of).
_ON_PAGE = re.compile(f"[\x00-\x08\x0b\x0c\x0e-\x1f{HIDDEN_BEYOND_C0}]")
_ASCII_HIDDEN = tuple(chr(code) for code in (*range(0x20), 0x7F) if chr(code) not in "\t\n\r")
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
    return _ESCAPED.sub(_escape_one, rendered)


def reveal(text: str) -> str:
    """``text`` as a page shows it: each hidden character but line breaks and tabs written
    as an escape (``\\u202e``); any other text, markup included, unchanged."""
    return _ON_PAGE.sub(_escape_one, text) if _may_hide(text) else text


def _may_hide(text: str) -> bool:
    """Whether ``text`` may hold a hidden character (never False when it does). A page's
    drawing is megabytes of markup: scanned in C (a find per control character, or
    ``isprintable``, which is False for every hidden character), not by the expression."""
    if text.isascii():
        return any(char in text for char in _ASCII_HIDDEN)
    return not text.replace("\n", " ").replace("\t", " ").replace("\r", " ").isprintable()


def _escape_one(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


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
