"""The background half of a save: hash, upload, record, commit, on one thread.

A save is *staged* when ``Checkpointer.save`` returns its ``PendingSave``, *written* once its
bytes are in the store, *durable* once the catalog committed it (``PendingSave.wait``). One
save is written at a time (one staging copy): the next waits or is skipped. A commit the
control plane does not answer goes to the commit thread (a daemon, which ``finish`` waits
for a bounded time): it commits in order once answered, holding only layer records. A
failure is raised once, by ``PendingSave.wait`` or the next ``Persister.wait``; a deferred
save that cannot be committed (``SaveLostError``) by its own ``wait`` only. The persist
thread, and the hashing and writing threads it starts, run ``CKPT_SAVE_NICENESS`` (default 0) below
training's priority and pause while the optimizer steps (``agent.save.yielding``);
``agent.save.tax`` measures what the loop still pays.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from agent.catalog.base import Catalog, Deferred, Upload
from agent.catalog.manifests import bundle_name, bundle_name_at
from agent.ranks.base import Ranks
from agent.save.policy import Position
from agent.save.result import PendingSave, SaveResult
from agent.save.snapshot import Staged
from agent.save.tax import StepClock, Window
from agent.save.upload import (
    BlobHashes,
    BlobSources,
    HeldBlobs,
    Replicas,
    WriteStats,
    durable_together,
    upload_layers,
)
from agent.save.yielding import StepGate, save_yield_seconds
from agent.state.capture import LayerState
from agent.summary import announce, format_bytes
from ckpt.core.contract import Layer, LayerRecord, Manifest
from ckpt.core.errors import CkptError, SaveLostError, StateChangedError
from ckpt.core.progress import Progress
from ckpt.core.storage import ObjectStore
from ckpt.core.threads import lower_priority, save_niceness

log = logging.getLogger("ckpt")


class Persister:
    """Writes staged saves on one background thread, one at a time, through a catalog; a
    commit the catalog defers (the control plane does not answer) runs on a second thread,
    in the order the saves were written."""

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
        self.durable_at: Position | None = None  # where this process's newest bundle is
        self.save_seconds: float | None = None  # stall + persist of the last durable save
        self._run, self._store, self._catalog = run, store, catalog
        self._blob_bytes, self._ranks, self._quiet = blob_bytes, ranks, quiet
        self.gate = StepGate(save_yield_seconds())  # the save's work pauses while a step runs
        self.steps = StepClock(gate=self.gate)  # the loop's steps (``watch``): each save's tax
        self._replicated = replicated  # layers every rank holds alike (DDP): one upload
        self._replicas = Replicas(ranks) if replicated and ranks.world_size > 1 else None
        self._blob_hashes: Mapping[BlobSources, str] = {}  # of the last persist, for reuse
        self._unsettled: list[PendingSave] = []  # submitted, outcome not yet taken; oldest first
        self._writing: Future[None] | None = None  # the newest save's bytes, until written
        self._thread = ThreadPoolExecutor(
            1,
            thread_name_prefix="ckpt-persist",
            initializer=lower_priority,  # the threads it starts inherit this niceness
            initargs=(save_niceness(),),
        )
        # Deferred commits, in order, on a daemon thread: one the control plane never
        # answers must not hold the interpreter's exit (``finish`` bounds the wait).
        self._commits: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._committer: threading.Thread | None = None

    @property
    def in_flight(self) -> PendingSave | None:
        """The newest save not yet durable (or whose failure is not yet raised)."""
        return self._unsettled[-1] if self._unsettled else None

    def submit(
        self,
        states: Mapping[Layer, LayerState],
        staged: Staged,
        *,
        step: int,
        stall: float,
        position: Position,
    ) -> PendingSave:
        """Start persisting a staged save, the previous one's bytes written (``settle``)."""
        durable: Future[SaveResult] = Future()
        window = self.steps.started()
        self._writing = self._thread.submit(
            self._persist,
            states,
            staged,
            step=step,
            stall=stall,
            position=position,
            durable=durable,
            window=window,
        )
        pending = PendingSave(
            bundle=self._name(position), step=step, stall_seconds=stall, future=durable
        )
        self._unsettled.append(pending)
        return pending

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until every save submitted (if any) is durable, oldest first, for at most
        ``timeout`` seconds in all; raise the first failure that ``PendingSave.wait`` did
        not raise already."""
        result = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._unsettled:
            if deadline is not None:
                timeout = max(deadline - time.monotonic(), 0.0)
            pending = self._unsettled[0]
            if pending.raised:
                self._unsettled.pop(0)
                continue
            try:
                result = pending.wait(timeout)
            except SaveLostError:
                pass  # logged; the next save replaces it
            finally:
                if pending.done():  # not when interrupted: its buffers are still in use
                    self._unsettled.pop(0)
        return result

    def ready(self, *, skip: bool) -> bool:
        """Whether a due save may stage now: the save before has written its bytes, or did
        while waited for; with ``skip`` (``in_flight="skip"``) it is skipped instead."""
        if self.settle(block=False):
            return True
        if skip:
            log.info("run %s: a save is still in flight; skipping this one", self._run)
            return False
        return self.settle(block=True)

    def settle(self, *, block: bool) -> bool:
        """Whether a new save may stage now: the save before has written its bytes (or,
        ``block``, once it has); a save that failed since is raised here, once."""
        writing = self._writing
        if writing is not None and not writing.done():
            if not block:
                return False
            futures.wait([writing])
        for pending in [p for p in self._unsettled if p.done()]:
            self._unsettled.remove(pending)
            if not pending.raised and not pending.lost:
                pending.wait()  # raises its failure
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

    def finish(self, *, seconds: float) -> SaveResult | None:
        """Like ``wait``, but once the bytes are written wait for commits the control plane
        does not answer at most ``seconds``; then log which bundles stay uncommitted."""
        writing = self._writing
        if writing is not None:
            futures.wait([writing])  # the bytes, and the commit unless deferred
        try:
            return self.wait(timeout=seconds)
        except TimeoutError:
            uncommitted = [p.bundle for p in self._unsettled if not p.done()]
            self._unsettled = [p for p in self._unsettled if p.done()]  # waited for once
            log.warning(
                "run %s: no answer from the control plane in %g s; %s stay uncommitted in the "
                "store (the next attempt commits one whose layers were all recorded)",
                *(self._run, seconds, ", ".join(uncommitted)),
            )
            return None

    def close(self) -> None:
        """Release the persist thread once its save is written; a deferred commit waiting
        is abandoned with the process."""
        self._thread.shutdown(wait=True)
        self._commits.put(None)  # the commit thread ends after the commits before

    def _defer(self, commit: Callable[[], None]) -> None:
        """Run ``commit`` on the commit thread, after those deferred before it."""
        self._commits.put(commit)
        if self._committer is None:
            self._committer = threading.Thread(
                target=self._commit_in_order, name="ckpt-commit", daemon=True
            )
            self._committer.start()

    def _commit_in_order(self) -> None:
        while (commit := self._commits.get()) is not None:
            commit()

    def _persist(
        self,
        states: Mapping[Layer, LayerState],
        staged: Staged,
        *,
        step: int,
        stall: float,
        position: Position,
        durable: Future[SaveResult],
        window: Window | None,
    ) -> None:
        """Write the save's bytes and commit it (or defer: ``durable`` gets the outcome)."""
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
            outcome = self._catalog.commit(upload, position=position)
        except Exception as err:
            log.exception("run %s: saving %s failed", self._run, self._name(position))
            self._failed(durable, err)
            return
        finally:
            staged.release(check=False)  # never leave the next optimizer step waiting
            self._blob_hashes = hashes.current
            progress.close()

        def done(manifest: Manifest) -> None:
            durable.set_result(
                self._durable(
                    manifest,
                    staged=staged,
                    stats=stats,
                    hashes=hashes,
                    stall=stall,
                    started=started,
                    position=position,
                    window=window,
                )
            )

        if isinstance(outcome, Manifest):
            done(outcome)
        else:
            self._defer(lambda: self._commit_later(outcome, done, durable))

    def _commit_later(
        self, deferred: Deferred, done: Callable[[Manifest], None], durable: Future[SaveResult]
    ) -> None:
        try:
            manifest = deferred.finish()
        except Exception as err:
            lost = isinstance(err, SaveLostError)  # not raised: the next save replaces it
            (log.warning if lost else log.exception)(
                "run %s %s: %s", self._run, deferred.position, err
            )
            self._failed(durable, err)
            return
        done(manifest)

    def _failed(self, durable: Future[SaveResult], err: BaseException) -> None:
        self.steps.ended(None)  # no tax: the save is not kept
        durable.set_exception(err)

    def _durable(
        self,
        manifest: Manifest,
        *,
        staged: Staged,
        stats: WriteStats,
        hashes: BlobHashes,
        stall: float,
        started: float,
        position: Position,
        window: Window | None,
    ) -> SaveResult:
        """The save is committed: what it cost, said and reported."""
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
            tax_seconds=self.steps.ended(window),
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
            with durable_together(self._store):
                records = upload_layers(
                    self._store,
                    states,
                    blob_bytes=self._blob_bytes,
                    stats=stats,
                    held=held,
                    hashes=hashes,
                    share=self._replicas.share() if self._replicas else None,
                    replicated=self._replicated,
                    progress=progress.advance,
                    pace=self.gate.pieces,
                )
                staged.release()  # written: training may step while the disk flushes
            return records

        return upload

    def _name(self, position: Position) -> str:
        return bundle_name_at(self._run, (position.step, position.micro_step))

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
