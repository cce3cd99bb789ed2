"""Which blobs a save may skip uploading, through the control plane, for one request a save.

A save's blobs that the store already holds are, as a rule, blobs of the bundle before it
(tensors that did not change since): the control plane is asked once a save which of *those*
it holds (``/v1/blobs/missing``, which also claims them against garbage collection), and
every other blob of the save is new, so uploaded without asking. The question is asked
when the save first needs its answer, by whichever upload thread comes first; the others
wait for that answer."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ckpt.core.contract import BlobRef, Manifest
from ckpt.core.errors import CkptError


def blobs_of(manifest: Manifest, *, rank: int) -> dict[str, BlobRef]:
    """The blobs of ``rank``'s layers in a bundle (of every rank's, when it has none of that
    rank: saved at another world size), by SHA-256."""
    ranks = [r for r in manifest.ranks if r.rank == rank] or manifest.ranks
    return {
        blob.sha256: blob for r in ranks for record in r.layers.values() for blob in record.blobs
    }


class AskedOnce:
    """The answer of ``ask``, asked at the first ``get`` and kept (a failure too)."""

    def __init__(self, ask: Callable[[], set[str]]) -> None:
        self._ask = ask
        self._lock = threading.Lock()
        self._answer: set[str] | None = None
        self._failure: CkptError | None = None

    def get(self) -> set[str]:
        with self._lock:
            if self._answer is None and self._failure is None:
                try:
                    self._answer = self._ask()
                except CkptError as err:
                    self._failure = err
        if self._failure is not None:
            raise self._failure
        assert self._answer is not None
        return self._answer
