"""The background half of a save: hash, upload, record, commit, on one thread.

``Checkpointer.save`` stages the state and hands it here; the save is *staged* when it
returns a ``PendingSave`` and *durable* once the catalog committed the bundle
(``PendingSave.wait``). At most one save is in flight: the next one waits for it or is
skipped (``InFlight``). A failed persist is raised exactly once, by ``PendingSave.wait``
or else by the next ``Persister.wait``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from agent.catalog.base import Catalog, Upload
from agent.catalog.manifests import bundle_name, bundle_name_at
from agent.ranks.base import MEET_SECONDS, Ranks
from agent.save.policy import Position
from agent.save.result import PendingSave, SaveResult
from agent.save.snapshot import Staged
from agent.save.upload import (
    BlobHashes,
    BlobSources,
    HeldBlobs,
    Share,
    WriteStats,
    blobs_alike,
    durable_together,
    upload_layer,
)
from agent.state.capture import LayerState
from agent.summary import announce, format_bytes
from ckpt.core.contract import Layer, LayerRecord
from ckpt.core.errors import CkptError, StateChangedError
from ckpt.core.progress import Progress
from ckpt.core.storage import ObjectStore

log = logging.getLogger("ckpt")


class Persister:
    """Persists staged saves on one background thread, one at a time, through a catalog."""

    def __init__(
        self,
        *,
        run: str,
        store: ObjectStore,
        catalog: Catalog,
        blob_bytes: int,
        ranks: Ranks,
        replicated: frozenset[Layer],
        quiet: bool,
    ) -> None:
        self.in_flight: PendingSave | None = None
        self.durable_at: Position | None = None  # where this process's newest bundle is
        self.save_seconds: float | None = None  # stall + persist of the last durable save
        self._run, self._store, self._catalog = run, store, catalog
        self._blob_bytes, self._ranks, self._quiet = blob_bytes, ranks, quiet
        self._replicated = replicated  # layers every rank holds alike (DDP): one upload
        self._told_unalike = False  # warned that such a layer differs between the ranks
        self._blob_hashes: Mapping[BlobSources, str] = {}  # of the last persist, for reuse
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist")

    def submit(
        self,
        states: Mapping[Layer, LayerState],
        staged: Staged,
        *,
        step: int,
        stall: float,
        position: Position,
    ) -> PendingSave:
        """Start persisting a staged save; the previous one must have ended (``settle``)."""
        future = self._thread.submit(
            self._persist, states, staged, step=step, stall=stall, position=position
        )
        self.in_flight = PendingSave(
            bundle=self._name(position), step=step, stall_seconds=stall, future=future
        )
        return self.in_flight

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until the save in flight (if any) is durable; raise its failure unless
        ``PendingSave.wait`` already did."""
        pending = self.in_flight
        if pending is None or pending.raised:
            self.in_flight = None
            return None
        try:
            return pending.wait(timeout)
        finally:
            if pending.done():  # not when interrupted: its buffers are still in use
                self.in_flight = None

    def ready(self, *, skip: bool, unreachable: Callable[[], bool], due_at: Position) -> bool:
        """Whether a due save may stage now: nothing in flight, or it ended while waited
        for. With ``skip`` (``in_flight="skip"``), or while the control plane is (or becomes)
        unreachable, the due save is skipped instead: the save in flight is retrying, and
        training does not wait on the control plane."""
        if self.settle(block=False):
            return True
        if skip:
            log.info("run %s: a save is still in flight; skipping this one", self._run)
            return False
        if self.wait_unless(unreachable):
            return True
        log.warning(
            "run %s: the control plane is unreachable and the save before is retrying; "
            "skipping the save due at %s",
            self._run,
            due_at,
        )
        return False

    def wait_unless(self, stop: Callable[[], bool], *, poll: float = 0.05) -> bool:
        """Wait for the save in flight like ``wait``, but give up (False) as soon as ``stop()``
        is true, checked every ``poll`` seconds."""
        pending = self.in_flight
        while pending is not None and not pending.done():
            if stop():
                return False
            with contextlib.suppress(TimeoutError):
                pending.wait(poll)
        self.wait()
        return True

    def settle(self, *, block: bool) -> bool:
        """Whether a new save may stage now: none in flight, or (``block``) it has ended."""
        pending = self.in_flight
        if pending is not None and not block and not pending.done():
            return False
        self.wait()
        return True

    def resumed_at(self, position: Position) -> None:
        """The bundle a resume restored is durable at ``position``."""
        self.durable_at = position

    def already_durable(self) -> PendingSave:
        """A save of the position that is durable already: done, and nothing written."""
        assert self.durable_at is not None
        step, name = self.durable_at.step, self._name(self.durable_at)
        future: Future[SaveResult] = Future()
        future.set_result(
            SaveResult(
                bundle=name,
                step=step,
                payload_bytes=0,
                new_bytes=0,
                stall_seconds=0.0,
                persist_seconds=0.0,
            )
        )
        return PendingSave(bundle=name, step=step, stall_seconds=0.0, future=future)

    def close(self) -> None:
        """Release the thread, after the save in flight (if any) ends."""
        self._thread.shutdown(wait=True)

    def _persist(
        self,
        states: Mapping[Layer, LayerState],
        staged: Staged,
        *,
        step: int,
        stall: float,
        position: Position,
    ) -> SaveResult:
        started = time.perf_counter()
        stats = WriteStats()
        hashes = BlobHashes(previous=self._blob_hashes, unchanged=staged.unchanged)
        total = sum(t.nbytes for t in staged.tensors.values())
        progress = Progress(f"ckpt: saving {self._name(position)}", total)
        try:
            staged.finish()
            upload = self._uploader(
                states,
                name=self._name(position),
                staged=staged,
                stats=stats,
                hashes=hashes,
                progress=progress,
            )
            manifest = self._catalog.commit(upload, position=position)
        except Exception:
            log.exception("run %s: saving %s failed", self._run, self._name(position))
            raise
        finally:
            staged.release(check=False)  # never leave the next optimizer step waiting
            self._blob_hashes = hashes.current
            progress.close()
        result = SaveResult(
            bundle=bundle_name(manifest),
            step=manifest.step,
            payload_bytes=stats.payload_bytes,
            new_bytes=stats.new_bytes,
            stall_seconds=stall + staged.step_wait_seconds,
            persist_seconds=time.perf_counter() - started,
            copied_bytes=staged.copied_bytes,
            hashed_bytes=stats.payload_bytes - hashes.reused_bytes,
            step_wait_seconds=staged.step_wait_seconds,
        )
        self.durable_at = position
        self.save_seconds = result.stall_seconds + result.persist_seconds
        self._announce(result, position)
        self._report(manifest.catalog.bundle_id if manifest.catalog else None, result)
        return result

    def _uploader(
        self,
        states: Mapping[Layer, LayerState],
        *,
        name: str,
        staged: Staged,
        stats: WriteStats,
        hashes: BlobHashes,
        progress: Progress,
    ) -> Upload:
        """Hash and store every layer's blobs, asking ``held`` which the store holds; then
        let training step (the tensors read in place are written)."""

        def upload(held: HeldBlobs) -> dict[Layer, LayerRecord]:
            if staged.held and staged.released:
                raise StateChangedError(
                    f"{name}: the store lost blobs of this save "
                    "before its commit, and the tensors it read in place (over the staging "
                    "budget) may have changed since: the save is not kept"
                )
            stats.seen.clear()  # a second round uploads the blobs that vanished again
            stats.payload_bytes = 0
            share = self._share()
            with durable_together(self._store):
                records = {
                    layer: upload_layer(
                        self._store,
                        state,
                        blob_bytes=self._blob_bytes,
                        stats=stats,
                        held=held,
                        hashes=hashes,
                        share=share if layer in self._replicated else None,
                        progress=progress.advance,
                    )
                    for layer, state in states.items()
                }
                staged.release()  # written: training may step while the disk flushes
            return records

        return upload

    def _name(self, position: Position) -> str:
        return bundle_name_at(self._run, (position.step, position.micro_step))

    def _share(self) -> Share | None:
        """How this save's replicated layers are split among the ranks (None: no such)."""
        if not self._replicated or self._ranks.world_size == 1:
            return None

        def alike(hashes: list[str]) -> list[bool]:
            flags = blobs_alike(self._ranks.gather(tuple(hashes), timeout=MEET_SECONDS))
            if not all(flags) and not self._told_unalike:
                self._told_unalike = True
                log.warning(
                    "ckpt: %d of %d blobs of a layer DDP replicates differ between the ranks "
                    "(buffers such as batch-norm statistics, changed since DDP last broadcast "
                    "them): every rank stores those itself (said once)",
                    flags.count(False),
                    len(flags),
                )
            return flags

        return Share(rank=self._ranks.rank, world_size=self._ranks.world_size, alike=alike)

    def _announce(self, result: SaveResult, position: Position) -> None:
        """One line per durable save; the details at debug level."""
        announce(
            f"ckpt: run {self._run}: saved {position}: {format_bytes(result.payload_bytes)} "
            f"({format_bytes(result.new_bytes)} new), stall {result.stall_seconds:.3f} s, "
            f"durable after {result.persist_seconds:.2f} s ({format_bytes(int(result.throughput))}/s)",
            quiet=self._quiet,
        )
        log.debug(
            "run %s: %s: %d bytes copied and %d hashed again",
            self._run,
            result.bundle,
            result.copied_bytes,
            result.hashed_bytes,
        )

    def _report(self, bundle_id: int | None, result: SaveResult) -> None:
        """Send the figures to the catalog; a failure costs only the figures."""
        try:
            self._catalog.report(bundle_id, rank=self._ranks.rank, figures=result.figures)
        except CkptError as err:
            log.warning(
                "run %s: could not report the figures of %s: %s", self._run, result.bundle, err
            )
