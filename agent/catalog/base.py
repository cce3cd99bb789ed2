"""The ``Catalog`` protocol: what restore and persist need from wherever bundles are kept."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from agent.attempt.notices import Notice
from agent.save.policy import Position
from agent.save.upload import HeldBlobs
from ckpt.core.contract import Layer, LayerRecord, Manifest, SaveFigures

# Hash and store every layer's blobs, asking ``HeldBlobs`` which the store already holds.
Upload = Callable[[HeldBlobs], dict[Layer, LayerRecord]]


@dataclass(frozen=True)
class Deferred:
    """A save whose bytes are in the store and whose commit waits for the control plane to
    answer: ``finish()`` commits it, in the background, and returns its manifest."""

    position: Position
    finish: Callable[[], Manifest]


class Catalog(Protocol):
    """Finds the bundle to resume from and commits new ones, for one process of a run."""

    def resumable(self, run: str, *, own: bool, step: int | None = None) -> Manifest | None:
        """The newest resumable bundle of ``run`` (``own``: the checkpointer's run, which
        this process is about to continue), or None; with ``step`` (another run only), its
        resumable bundle at that step, or None."""
        ...

    def fall_back(
        self, run: str, manifest: Manifest, *, own: bool, reason: str, blob: str
    ) -> Manifest | None:
        """Set ``manifest`` aside (its ``blob`` failed verification) and return the bundle
        before it."""
        ...

    def verified(self, blobs: Iterable[str]) -> None:
        """These blobs were read back from the store and matched their SHA-256."""
        ...

    def check_save(self, position: Position) -> None:
        """Raise ``BundleExistsError`` when a save at ``position`` would replace a resumable
        bundle of another job: this process did not resume the run to before it."""
        ...

    def resumed(self, position: Position) -> None:
        """This process resumed the run's own bundle at ``position`` (every layer): it
        continues the run from there, and every later position is its to save."""
        ...

    def commit(self, upload: Upload, *, position: Position) -> Manifest | Deferred:
        """Upload through ``upload``, record every layer and commit: the bundle's manifest;
        or, when the catalog does not answer, the commit left to do once the bytes are in
        the store."""
        ...

    def report(self, bundle_id: int | None, *, rank: int, figures: SaveFigures) -> None:
        """Keep what one rank's save cost."""
        ...

    def end(
        self, reason: str, *, final_save_committed: bool, step: int, patience: float | None
    ) -> None:
        """Record how this attempt ended (once; later calls do nothing)."""
        ...

    def notice(self, notice: Notice, *, step: int) -> None:
        """Record on this attempt a cloud's notice of a coming preemption."""
        ...

    def preemption_rate(self) -> float | None:
        """The mean time between preemptions the catalog estimates for this run; None when
        it keeps no attempts.

        Raises:
            CkptError: it could not be asked.
        """
        ...

    def interval(self, seconds: float, waste_seconds_per_hour: float | None) -> None:
        """Keep the save interval ``every="auto"`` chose, and what it expects to lose."""
        ...

    def account(self, figures: Callable[[], dict[str, float | int] | None]) -> None:
        """Report ``figures()`` (where the attempt's time went) with the attempt's reports."""
        ...

    def close(self) -> None: ...
