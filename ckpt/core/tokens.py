"""Where a client of the control plane finds its bearer token."""

from __future__ import annotations

import os
from pathlib import Path


def default_token() -> str | None:
    """``CKPT_TOKEN``, else the embedded server's admin token file if there is one."""
    token = os.environ.get("CKPT_TOKEN")
    if token:
        return token
    path = Path(os.environ.get("CKPT_ADMIN_TOKEN_FILE", ".ckpt/admin-token"))
    return path.read_text().strip() if path.is_file() else None
