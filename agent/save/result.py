"""What a save hands back: ``PendingSave`` when it is staged, ``SaveResult`` once durable."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from ckpt.core.contract import SaveFigures
from ckpt.core.errors import SaveLostError


@dataclass(frozen=True)
class SaveResult:
    """What one save wrote and what it cost, once durable.

    Attributes:
        stall_seconds: how long the save held training up: ``save`` (staging, plus waiting
            for the save before it when that one was still in flight) and
            ``step_wait_seconds``.
        step_wait_seconds: how long the next optimizer step waited for the copies left to
            the background (overlap) and for the tensors read in place (staging budget).
        persist_seconds: from the end of staging until the bundle was committed.
        payload_bytes: the bundle's bytes (this rank); new_bytes: those uploaded, the rest
            being blobs the store already held.
        copied_bytes: tensor bytes staging copied (unchanged frozen tensors are not);
            hashed_bytes: payload bytes hashed (the rest reused the last save's hashes).
        tax_seconds: how much later the training loop reached where it is because of this
            save: the extra time of the optimizer steps from ``save()`` until durable over
            the median step before it (``agent.save.tax``). It holds the stall and what
            the background hashing and writing took from training. None until the loop has
            made a few steps without a save in flight.
    """

    bundle: str
    step: int
    payload_bytes: int
    new_bytes: int
    stall_seconds: float
    persist_seconds: float
    copied_bytes: int = 0
    hashed_bytes: int = 0
    step_wait_seconds: float = 0.0
    tax_seconds: float | None = None

    @property
    def throughput(self) -> float:
        """Bundle bytes persisted per second."""
        return self.payload_bytes / self.persist_seconds if self.persist_seconds else 0.0

    @property
    def dedup_ratio(self) -> float:
        """The fraction of the bundle that was uploaded: 1.0 when nothing was in the store."""
        return self.new_bytes / self.payload_bytes if self.payload_bytes else 0.0

    @property
    def figures(self) -> SaveFigures:
        return SaveFigures(
            stall_seconds=self.stall_seconds,
            persist_seconds=self.persist_seconds,
            payload_bytes=self.payload_bytes,
            new_bytes=self.new_bytes,
            tax_seconds=self.tax_seconds,
        )


class PendingSave:
    """A staged save; its persist (hash, upload, commit) runs in the background.

    The save is *staged* when ``Checkpointer.save`` returns it: the state was copied, so
    training may change it. It is *durable* once the bundle is committed: ``wait()``.
    """

    def __init__(
        self, *, bundle: str, step: int, stall_seconds: float, future: Future[SaveResult]
    ) -> None:
        self.bundle = bundle
        self.step = step
        self.stall_seconds = stall_seconds
        self.raised = False  # whether wait() already raised the persist's failure
        self._future = future

    @property
    def durable(self) -> bool:
        """Whether the bundle is committed (False while in flight or when the persist failed)."""
        return self._future.done() and self._future.exception() is None

    def done(self) -> bool:
        """Whether the persist ended, committed or failed."""
        return self._future.done()

    @property
    def lost(self) -> bool:
        """Whether the save was deferred through an outage and could not be committed
        (``SaveLostError``): logged, and raised by this ``wait()`` only, never by a later call
        of the checkpointer; the next save replaces it."""
        return self._future.done() and isinstance(self._future.exception(), SaveLostError)

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until the bundle is durable.

        Raises:
            TimeoutError: still in flight after ``timeout`` seconds.
            StoreError: the store failed; no manifest was written, so no bundle exists.
            FencedError: a newer attempt of the run registered; this process must stop.
            ControlPlaneError: the control plane refused the bundle (its message says why)
                or stayed unreachable through the retries.
        """
        try:
            return self._future.result(timeout)
        except BaseException as err:
            self.raised = self._future.done() and self._future.exception() is err
            raise

    def __repr__(self) -> str:
        state = "durable" if self.durable else "done" if self.done() else "in flight"
        return f"<PendingSave {self.bundle} {state}>"
