"""Secrets kept out of log lines, error messages and exception text.

A bearer token or a dashboard session cookie in a log line is a secret in every pod's log.
``redact`` writes each one as its first characters and an ellipsis (``ckpt_2uQW…``): enough
to tell which token it was, not enough to use it. It knows three shapes, and the secrets
its caller names: a token of ours (``ckpt_`` and at least 20 characters, as
``service.settings.new_token`` makes them), whatever follows ``Bearer`` (an admin token
can be any string; httpx quotes a refused header as ``b'Bearer …'``), and the value of the
dashboard's cookies (``ckpt_session=…``, ``ckpt_csrf=…``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

TOKEN_PREFIX = "ckpt_"
SHOWN = 4  # characters of a secret shown after its prefix (``ckpt_``) or on their own
ELLIPSIS = "…"
# A secret shorter than this is not looked for by value (it would match ordinary words).
MIN_SECRET = 8

# Ours: token_urlsafe after the prefix. Names such as ckpt_http_requests do not match: a
# token has 20 characters or more and at least one capital, digit or dash among them.
_TOKEN = re.compile(r"\bckpt_(?=[A-Za-z0-9_-]{0,200}[A-Z0-9-])[A-Za-z0-9_-]{20,}")
# After Bearer: up to the end of the value, a quote or a backslash (repr's \n of b'...').
_BEARER = re.compile(r"(Bearer\s+)([^\s'\"\\,;]+)", re.IGNORECASE)
_BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f\s]+")
_COOKIE = re.compile(r"\b(ckpt_session|ckpt_csrf)=([^;\s'\"\\,]+)")


def shown(secret: str) -> str:
    """What is left of ``secret`` in a message: its prefix and a few characters, then ``…``."""
    keep = len(TOKEN_PREFIX) + SHOWN if secret.startswith(TOKEN_PREFIX) else SHOWN
    if secret.endswith(ELLIPSIS) and len(secret) <= keep + 1:
        return secret  # already redacted
    return secret[:keep] + ELLIPSIS


def _forms(secret: str | None) -> set[str]:
    """How ``secret`` may appear in a message: as it is, escaped as ``repr`` writes it
    (httpx quotes a refused header as bytes), and each of the pieces a line break or other
    control character splits it into; only those long enough to look for."""
    value = (secret or "").strip()
    forms = {value, value.encode("unicode_escape").decode("ascii")}
    forms |= {piece.strip() for piece in _BREAKS.split(value)}
    return {form for form in forms if len(form) >= MIN_SECRET}


def redact(text: object, *, secrets: Iterable[str | None] = ()) -> str:
    """``str(text)`` with every secret in it cut to ``shown(secret)``: the ``secrets`` named
    (surrounding whitespace ignored), then every token, ``Bearer`` value and session cookie
    the patterns find."""
    rendered = str(text)
    for value in sorted({form for s in secrets for form in _forms(s)}, key=len, reverse=True):
        if value in rendered:
            rendered = rendered.replace(value, shown(value))
    rendered = _BEARER.sub(lambda found: found.group(1) + shown(found.group(2)), rendered)
    rendered = _COOKIE.sub(lambda found: f"{found.group(1)}={shown(found.group(2))}", rendered)
    return _TOKEN.sub(lambda found: shown(found.group()), rendered)
