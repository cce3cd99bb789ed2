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
    # Tokens revoked through this process lately (id: until when), never kept again: a
    # request that read one just before its revocation committed must not keep it after.
    _revoked: dict[int, float] = field(default_factory=dict)

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

    def put(self, token_hash: str, principal: Principal, *, expires_at: datetime | None) -> None:
        now = time.monotonic()
        if self.seconds <= 0 or self._revoked.get(principal.token_id or 0, now) > now:
            return
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
        self._entries[token_hash] = _Entry(now + self.seconds, principal, expires_at)

    def forget(self, token_id: int) -> None:
        """Drop the token ``token_id`` (revoked): its next use reads the catalog."""
        now = time.monotonic()
        self._revoked = {id_: t for id_, t in self._revoked.items() if t > now}
        self._revoked[token_id] = now + self.seconds
        for token_hash, entry in list(self._entries.items()):
            if entry.principal.token_id == token_id:
                self._entries.pop(token_hash, None)
