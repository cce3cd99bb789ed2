"""Where a client of the control plane finds its bearer token, and the header it sends.

A token read from the environment or a file loses its surrounding whitespace, as kubectl
and most clients do: a Secret made from ``ckpt token create``'s output, or a token file
written by ``echo``, ends with a newline. A token with whitespace or control characters
inside is refused here, naming where it came from (never the token): sent as it is, the
HTTP client would refuse the header, and the agent would report a network error.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_token() -> str | None:
    """``CKPT_TOKEN``, else the embedded server's admin token file if there is one.

    Raises:
        ValueError: the token found is empty or not one word of printable characters.
    """
    token = os.environ.get("CKPT_TOKEN")
    if token:
        return clean_token(token, source="CKPT_TOKEN")
    path = Path(os.environ.get("CKPT_ADMIN_TOKEN_FILE", ".ckpt/admin-token"))
    if not path.is_file():
        return None
    return clean_token(path.read_text(errors="replace"), source=f"the token file {path}")


def clean_token(text: str, *, source: str) -> str:
    """``text`` without surrounding whitespace; ``source`` says where it came from.

    Raises:
        ValueError: nothing is left, or what is left holds whitespace, control characters
            or non-ASCII characters (a bearer token is one word of printable ASCII).
    """
    token = text.strip()
    if not token:
        raise ValueError(
            f"the bearer token in {source} is empty: set it to the token "
            "'ckpt token create' printed"
        )
    for position, char in enumerate(token, start=1):
        if not "!" <= char <= "~":
            raise ValueError(
                f"the bearer token in {source} contains {_kind(char)} at character "
                f"{position} of {len(token)}: a token is one word of printable ASCII (leading "
                "and trailing whitespace is ignored); set it again from 'ckpt token create'"
            )
    return token


def bearer(token: str | None, *, source: str = "the token given") -> dict[str, str]:
    """The ``Authorization`` header for ``token`` (none without one).

    Raises:
        ValueError: see ``clean_token``.
    """
    if not token:
        return {}
    return {"Authorization": f"Bearer {clean_token(token, source=source)}"}


def _kind(char: str) -> str:
    if char.isspace():
        return "whitespace"
    if char.isprintable():
        return "a non-ASCII character"
    return "a control character"
