"""Where an attempt keeps its fingerprints for the next one, and reads the last one's.

store          store-only: one object per rank and attempt, replaced as the ring changes
               (every ``heartbeat_seconds`` in the background, and when asked), beside the
               run's bundles; the next attempt reads the newest older attempt's
control plane  on the heartbeats each rank sends anyway (``/v1/attempts/{id}/heartbeat``);
               the next attempt asks ``/v1/attempts/{id}/replay`` and reports its verdict
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from agent.catalog.base import Catalog
from agent.catalog.control_plane import ControlPlaneCatalog
from agent.verify.compare import Fingerprint, Place, Verification
from agent.verify.ring import Ring
from ckpt.core.errors import CkptError
from ckpt.core.storage import ObjectStore, keys

log = logging.getLogger("ckpt")

MAX_SENT = 512  # fingerprints per heartbeat
# How long a flush (``Checkpointer.wait``, ``end``) retries a control plane that does not
# answer: the loop never waits out an outage for them; the heartbeats carry them later.
FLUSH_PATIENCE = 5.0
_READ_ATTEMPTS = 16  # the older attempts a resume looks through for fingerprints


class Keeper(Protocol):
    def flush(self) -> None:
        """Keep what the ring holds that is not kept yet, now."""
        ...

    def replay(self, after: Place) -> tuple[int | None, list[Fingerprint]]:
        """The newest older attempt's fingerprints of this rank after ``after``: its
        attempt id (None store-only) and them, by position.

        Raises:
            CkptError: they could not be read.
        """
        ...

    def report(self, verification: Verification) -> None:
        """Record the attempt's verdict (rank 0)."""
        ...

    def close(self) -> None: ...


class StoreKeeper:
    """Store-only: each rank's ring in its own object, replaced (``keys.fingerprints_key``)."""

    def __init__(
        self, store: ObjectStore, *, run: str, rank: int, ring: Ring, seconds: float
    ) -> None:
        self._store, self._run, self._rank, self._ring = store, run, rank, ring
        self.attempt = f"{time.time_ns():020d}"  # names this attempt's objects, by age
        self._key = keys.fingerprints_key(run, self.attempt, rank)
        self._kept = 0  # the ring's version in the store
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._writer = threading.Thread(
            target=self._write, args=(seconds,), name="ckpt-fingerprints", daemon=True
        )
        self._writer.start()

    def flush(self) -> None:
        with self._lock:
            version = self._ring.version
            if version == self._kept:
                return
            body = {
                "attempt": self.attempt,
                "rank": self._rank,
                "fingerprints": [each.to_json() for each in self._ring.snapshot()],
            }
            self._store.put(self._key, [json.dumps(body).encode()])
            self._kept = version

    def replay(self, after: Place) -> tuple[int | None, list[Fingerprint]]:
        owners = (keys.fingerprints_owner(key) for key in self._store.list_keys(self._prefix))
        older = sorted(
            (owner[0] for owner in owners if owner and owner[1] == self._rank),
            reverse=True,
        )
        for attempt in [label for label in older if label < self.attempt][:_READ_ATTEMPTS]:
            stored = json.loads(
                self._store.get(keys.fingerprints_key(self._run, attempt, self._rank))
            )
            prints = [Fingerprint.from_json(each) for each in stored["fingerprints"]]
            if replayed := sorted((p for p in prints if p.place > after), key=lambda p: p.place):
                return None, replayed
        return None, []

    def report(self, verification: Verification) -> None:
        body = json.dumps(verification.to_json() | {"attempt": self.attempt}).encode()
        self._store.put(keys.verification_key(self._run, self.attempt), [body])

    def close(self) -> None:
        self._closed.set()
        self._writer.join()

    @property
    def _prefix(self) -> str:
        return keys.fingerprints_prefix(self._run)

    def _write(self, seconds: float) -> None:
        while not self._closed.wait(seconds):
            try:
                self.flush()
            except CkptError as err:
                log.warning("run %s: could not keep the fingerprints: %s", self._run, err)


class ControlPlaneKeeper:
    """Through the control plane: the ring rides on this rank's heartbeats (the attempt's
    ``outbox``), newest positions after the last one sent."""

    def __init__(self, catalog: ControlPlaneCatalog, *, rank: int, ring: Ring) -> None:
        self._control, self._attempt = catalog.control, catalog.attempt
        self._rank, self._ring = rank, ring
        self._sent: Place | None = None  # the newest position a heartbeat delivered
        self._attempt.outbox = self

    def pending(self) -> list[dict[str, Any]]:
        """The fingerprints the next heartbeat carries."""
        return [each.to_json() for each in self._ring.snapshot(after=self._sent)[:MAX_SENT]]

    def sent(self, fingerprints: list[dict[str, Any]]) -> None:
        if fingerprints:
            last = fingerprints[-1]
            self._sent = max(self._sent or (-1, -1), (last["step"], last["micro_step"]))

    def flush(self) -> None:
        while self._attempt.registration is not None and self.pending():
            self._attempt.beat(patience=FLUSH_PATIENCE)

    def replay(self, after: Place) -> tuple[int | None, list[Fingerprint]]:
        registration = self._attempt.registration
        if registration is None:
            return None, []
        self._sent = None
        source, served = self._control.replay(registration.attempt_id, rank=self._rank, after=after)
        prints = sorted((Fingerprint.from_json(each) for each in served), key=lambda p: p.place)
        return source, [each for each in prints if each.place > after]

    def report(self, verification: Verification) -> None:
        registration = self._attempt.registration
        if registration is not None:
            self._control.verification(registration.attempt_id, verification.to_json())

    def close(self) -> None:
        self._attempt.outbox = None


def open_keeper(
    catalog: Catalog, *, store: ObjectStore, run: str, rank: int, seconds: float
) -> Callable[[Ring], Keeper]:
    """The control plane's keeper where the catalog is the control plane's, else the store's
    (writing every ``seconds``)."""
    if isinstance(catalog, ControlPlaneCatalog):
        return lambda ring: ControlPlaneKeeper(catalog, rank=rank, ring=ring)
    return lambda ring: StoreKeeper(store, run=run, rank=rank, ring=ring, seconds=seconds)
