"""The catalog tokens this process authenticated lately, so that a heartbeat or a
``/resumable`` does not read its token from the catalog each time: that read was a
statement and a pooled connection of its own, about a third of what a heartbeat cost the
server beyond the floor's one statement (docs/performance.md).

An entry lives ``CKPT_TOKEN_CACHE_SECONDS``. A token revoked through this process is
forgotten at once; one revoked through another replica or worker is refused here once its
entry lapses. Expiry is checked at every use. Unknown tokens are never kept: each is looked
up anew, as before."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from service.models import utcnow

if TYPE_CHECKING:
    from service.auth.principal import Principal

# More distinct tokens than this within one lifetime of an entry is no fleet's steady
# state: the cache then starts over rather than grow.
MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class _Entry:
    until: float  # time.monotonic()
    principal: Principal
    expires_at: datetime | None


@dataclass
class TokenCache:
    seconds: float  # 0: nothing is kept
    _entries: dict[str, _Entry] = field(default_factory=dict)
    # When a token was last revoked through this process (``time.monotonic()``, after the
    # revocation committed): a read of a token that began before then may have found it
    # unrevoked, however long it then took (a heartbeat's statement waits for its locks),
    # and is not kept.
    _revoked_at: float = float("-inf")

    def get(self, token_hash: str) -> Principal | None:
        """The principal of a token seen lately, unless its entry lapsed or it expired."""
        entry = self._entries.get(token_hash)
        if entry is None:
            return None
        if time.monotonic() >= entry.until or (
            entry.expires_at is not None and entry.expires_at <= utcnow()
        ):
            self._entries.pop(token_hash, None)
            return None
        return entry.principal

    def put(
        self, token_hash: str, principal: Principal, *, expires_at: datetime | None, read_at: float
    ) -> None:
        """Keep a token read from the catalog, by a read that began at ``read_at``
        (``time.monotonic()``), for ``seconds`` from then; not if a token was revoked
        through this process since."""
        if self.seconds <= 0 or read_at <= self._revoked_at:
            return
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
        self._entries[token_hash] = _Entry(read_at + self.seconds, principal, expires_at)

    def forget(self, token_id: int) -> None:
        """Drop the token ``token_id`` (revoked, committed): its next use reads the catalog,
        and a read of it still under way is not kept."""
        self._revoked_at = time.monotonic()
        for token_hash, entry in list(self._entries.items()):
            if entry.principal.token_id == token_id:
                self._entries.pop(token_hash, None)
