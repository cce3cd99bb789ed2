"""Through the control plane (``CKPT_SERVER``): the catalog of every run, with fencing.

Resuming registers this process's attempt, which fences every older one, and takes the
bundle the control plane names. A save opens a bundle under the attempt's epoch, asks which
blobs the store lacks, uploads them, records every layer and commits; the control plane
checks that every rank recorded every layer and every blob is in the store, then writes
the manifest and moves the run's head. One bundle per attempt and step.

A single process's save never waits on the control plane for long: when it does not answer
within twice ``ANSWER_SECONDS`` (down, restarting, unreachable, or holding the connection:
``agent.catalog.late``), the save's bytes go to the store
anyway (the store itself says which blobs it holds) and its commit is ``Deferred``: opened,
recorded and committed in the background once the control plane answers, under the epoch of
the attempt that wrote it, so a fenced attempt's save is refused as ever. A job of many
ranks does the same, deciding together at its meetings (``agent.catalog.job``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from agent.attempt.interval import ESTIMATE_PATIENCE
from agent.attempt.notices import Notice
from agent.catalog.base import Deferred, Upload
from agent.catalog.client import (
    ControlPlane,
    IncompleteCommitError,
    IntactBlobError,
    Registration,
    UnansweredError,
    no_answer,
)
from agent.catalog.estimate import Estimate
from agent.catalog.figures import PendingFigures
from agent.catalog.job import ANSWER_SECONDS, COMMIT_ROUNDS, DEFER_ROUNDS, JobCommit
from agent.catalog.late import SaveCalls
from agent.catalog.manifests import versions
from agent.catalog.registration import Attempt
from agent.catalog.store import store_held
from agent.ranks.base import Ranks
from agent.save.policy import Position
from agent.save.upload import HeldBlobs
from ckpt.core.contract import BlobRef, Layer, LayerRecord, Manifest, SaveFigures
from ckpt.core.errors import ControlPlaneError, SaveLostError, StoreError
from ckpt.core.storage import ObjectStore

log = logging.getLogger("ckpt")


@dataclass
class _Save:
    """How far one process's save got with the control plane."""

    position: Position
    bundle_id: int | None = None
    records: dict[Layer, LayerRecord] | None = None


class ControlPlaneCatalog:
    """The control plane's catalog, as one attempt of one run sees it."""

    def __init__(
        self,
        control: ControlPlane,
        *,
        run: str,
        heartbeat_seconds: float,
        step: Callable[[], int],
        ranks: Ranks,
        store: ObjectStore,
    ) -> None:
        self.control = control
        store_url = store.url
        self.attempt = Attempt(
            control,
            run=run,
            heartbeat_seconds=heartbeat_seconds,
            step=step,
            ranks=ranks,
            store_url=store_url,
        )
        self.run, self.ranks, self.store, self._store_url = run, ranks, store, store_url
        self._verified: set[str] = set()  # blobs this process wrote or read back whole
        self._closed = threading.Event()  # deferred commits stop waiting once set
        self._lock = threading.Lock()
        self._waiting: set[Position] = set()  # saves whose commits are deferred, not ended
        self._figures = PendingFigures()  # this rank's, for its next layer record
        self.calls = SaveCalls(control)  # a save's, each waited for a bounded time
        self._estimate = Estimate(
            lambda: control.preemption_rate(run, patience=control.retry_seconds),
            first_wait=ESTIMATE_PATIENCE,
            what=f"run {run}",
        )
        self._job = JobCommit(self, closed=self._closed)

    def resumable(self, run: str, *, own: bool, step: int | None = None) -> Manifest | None:
        """Register this attempt (fencing every older one); resume from the bundle the
        control plane names, or (another run) that run's resumable bundle, or its complete
        bundle at ``step``."""
        if own:
            return self.attempt.register(resume=True).resume_from
        if self.attempt.registration is None:
            self.attempt.register(resume=False)
        return self.control.resumable(run) if step is None else self.control.bundle_at(run, step)

    def fall_back(
        self, run: str, manifest: Manifest, *, own: bool, reason: str, blob: str
    ) -> Manifest | None:
        """Report ``blob`` damaged (the control plane reads it back and quarantines every
        complete bundle using it); register again so that the new attempt resumes from (and
        records) the bundle before it. Refuse instead when the control plane reads another
        store (the bundle is likely whole there, and only this process cannot see it), or
        reads the blob back intact (this read went wrong on the way: retry)."""
        registration = self.attempt.registration
        if registration is not None and registration.store not in (None, self._store_url):
            raise self.other_store(f"cannot read {manifest.run} step {manifest.step} ({reason})")
        if manifest.catalog is not None:
            epoch = registration.epoch if own and registration is not None else None
            try:
                self.control.quarantine(
                    manifest.catalog.bundle_id, reason=reason, epoch=epoch, blob=blob
                )
            except IntactBlobError as err:
                raise StoreError(
                    f"{reason}; but the control plane reads blob {blob} back intact from the "
                    "store: this read went wrong between the store and this process. Nothing "
                    "was quarantined; retry the resume"
                ) from err
        if own:
            return self.attempt.register(resume=True).resume_from
        return self.control.resumable(run)

    def verified(self, blobs: Iterable[str]) -> None:
        self._verified.update(blobs)  # for the saves that ask the store itself

    def check_save(self, position: Position) -> None:
        return None  # the control plane refuses what would not extend the run's head

    def resumed(self, position: Position) -> None:
        return None  # the attempt's registration says where it resumed

    def commit(self, upload: Upload, *, position: Position) -> Manifest | Deferred:
        """One bundle per attempt and position (the checkpointer saves a position once). A single
        process defers the commit when the control plane does not answer; so do the ranks of
        a job, together (``agent.catalog.job``)."""
        if self.ranks.world_size > 1:
            return self._job.commit(upload, position=position)
        save = _Save(position)
        problem = self.why_defer()
        if problem is None:
            try:
                return self._advance(save, upload, patience=ANSWER_SECONDS)
            except ControlPlaneError as err:
                if not no_answer(err):
                    raise
                problem = str(err)
        if save.records is None:
            save.records = upload(store_held(self.store, self._verified))
        log.warning(
            "run %s: %s is in the store; its commit waits (%s)",
            self.run,
            position,
            problem,
        )
        return self.deferred(position, lambda: self._finish(save))

    def why_defer(self) -> str | None:
        """Why a save should not try the control plane now, or None: it is known not to
        answer, or earlier saves still wait for their commits (bundles commit in order: a
        newer one committed first would leave the older behind the run's head)."""
        if self.attempt.registration is None or self.calls.silent:
            return "the control plane is unreachable"
        with self._lock:
            if self._waiting:
                return f"{sorted(self._waiting)[0]} and after still wait for their commits"
        return None

    def deferred(self, position: Position, finish: Callable[[], Manifest]) -> Deferred:
        """The commit ``finish`` left for the background; later saves defer behind it until
        it ends, committed or failed."""
        with self._lock:
            self._waiting.add(position)

        def in_order() -> Manifest:
            try:
                return finish()
            finally:
                with self._lock:
                    self._waiting.discard(position)

        return Deferred(position=position, finish=in_order)

    def _finish(self, save: _Save) -> Manifest:
        """Commit a deferred save once the control plane answers."""
        for _ in range(DEFER_ROUNDS - 1):
            try:
                return self._advance(save, None, patience=None)
            except ControlPlaneError as err:
                if not no_answer(err) or self._closed.is_set():
                    raise
                log.warning(
                    "run %s: %s still waits for its commit: %s", self.run, save.position, err
                )
        return self._advance(save, None, patience=None)

    def _advance(self, save: _Save, upload: Upload | None, *, patience: float | None) -> Manifest:
        """Open, upload (``upload``: None once the bytes are written and the staging reused),
        record and commit a single process's save, from where it got; each call retried for
        ``patience`` seconds (None: the client's window)."""
        attempt = self.attempt.current()
        if save.bundle_id is None:
            save.bundle_id = self.calls.answer(
                lambda: self.control.open_bundle(
                    self.run,
                    attempt=attempt,
                    step=save.position.step,
                    micro_step=save.position.micro_step,
                    world_size=1,
                    versions=versions(),
                    patience=patience,
                ),
                patience=patience,
                what=f"opening the bundle of {save.position}",
            )
        force: frozenset[str] = frozenset()
        for _ in range(COMMIT_ROUNDS):
            if save.records is None or force:
                if upload is None and self._elsewhere():
                    raise self.other_store(
                        f"the control plane does not find {len(force)} blob(s) this job wrote"
                    )
                if upload is None:
                    raise SaveLostError(
                        f"bundle {save.bundle_id}: {len(force)} blob(s) this save wrote during "
                        "the outage are not accepted at its commit: collected meanwhile (a "
                        "garbage-collection grace period shorter than the outage), or written "
                        "before its bundle was opened under a run token (run isolation); the "
                        "save is not kept"
                    )
                save.records = upload(self.held(force, patience=patience))
            if patience is not None and self.calls.silent:
                raise UnansweredError("the control plane stopped answering during the save")
            self.record(
                save.bundle_id, epoch=attempt.epoch, records=save.records, patience=patience
            )
            outcome = self.commit_once(save.bundle_id, attempt, patience=patience)
            if isinstance(outcome, Manifest):
                self._verified.update(
                    b.sha256 for record in save.records.values() for b in record.blobs
                )
                return outcome
            if force and outcome <= force:
                raise self.other_store(
                    f"the control plane does not find {len(outcome)} blob(s) this job has "
                    "just written"
                )
            force = outcome
        raise ControlPlaneError(
            f"bundle {save.bundle_id}: blobs kept vanishing through {COMMIT_ROUNDS} rounds of "
            "uploads (is garbage collection running with a grace period shorter than a save?)"
        )

    def commit_once(
        self, bundle_id: int, attempt: Registration, *, patience: float | None = None
    ) -> Manifest | frozenset[str]:
        """The committed manifest, or the blobs the commit found missing."""
        try:
            return self.calls.answer(
                lambda: self.control.commit(bundle_id, epoch=attempt.epoch, patience=patience),
                patience=patience,
                what=f"committing bundle {bundle_id}",
            )
        except IncompleteCommitError as err:
            if not err.blobs:
                raise
            return frozenset(err.blobs)

    def other_store(self, problem: str) -> ControlPlaneError:
        """The agent and the control plane do not see the same store: say so, and how to fix
        it, rather than that blobs vanished or bundles are corrupt."""
        registration = self.attempt.registration
        server = registration.store if registration is not None else None
        same_url = server == self._store_url
        return ControlPlaneError(
            f"{problem}: this process uses the store {self._store_url}, the control plane "
            f"{server or 'another one'}. The agent and the control plane must use the same "
            "store: give both the same CKPT_STORE (a directory such as the default "
            ".ckpt/store is relative to each process's working directory)"
            + ("; for S3, also the same CKPT_S3_ENDPOINT" if same_url else "")
        )

    def _elsewhere(self) -> bool:
        """Whether the control plane names a store other than this process's."""
        registration = self.attempt.registration
        return registration is not None and registration.store not in (None, self._store_url)

    def held(self, force: frozenset[str], *, patience: float | None = None) -> HeldBlobs:
        """Which blobs the store holds, less those to upload anyway: by the control plane,
        asked once a save about every blob this rank stores (``/v1/blobs/missing``, which
        also claims them against garbage collection); by the store itself while the control
        plane does not answer (a single process)."""
        by_store = store_held(self.store, self._verified)

        def held(blobs: list[BlobRef]) -> set[str]:
            if patience is not None and self.calls.silent:
                return by_store(blobs) - force
            try:
                missing = self.calls.answer(
                    lambda: self.control.missing_blobs(blobs, patience=patience),
                    patience=patience,
                    what=f"asking which of {len(blobs)} blobs the store lacks",
                )
            except ControlPlaneError as err:
                if patience is None or not no_answer(err):
                    raise
                return by_store(blobs) - force
            return {b.sha256 for b in blobs} - missing - force

        return held

    def record(
        self,
        bundle_id: int,
        *,
        epoch: int,
        records: Mapping[Layer, LayerRecord],
        patience: float | None,
    ) -> None:
        """Record this rank's layers, and with them the figures of its saves not yet sent."""
        saves = self._figures.take()
        try:
            self.calls.answer(
                lambda: self.control.record_layers(
                    bundle_id,
                    rank=self.ranks.rank,
                    epoch=epoch,
                    records=records,
                    patience=patience,
                    saves=saves,
                ),
                patience=patience,
                what=f"recording the layers of bundle {bundle_id}",
            )
        except BaseException:
            self._figures.put_back(saves)
            raise

    def report(self, bundle_id: int | None, *, rank: int, figures: SaveFigures) -> None:
        """Keep the figures for this rank's next layer record (or ``end``, ``close``)."""
        if bundle_id is not None:
            self._figures.keep(bundle_id, figures)

    def end(
        self, reason: str, *, final_save_committed: bool, step: int, patience: float | None
    ) -> None:
        self._figures.send(self.control, rank=self.ranks.rank, patience=ANSWER_SECONDS)
        try:
            self.attempt.end(
                reason, final_save_committed=final_save_committed, step=step, patience=patience
            )
        except ControlPlaneError as err:
            if not no_answer(err):
                raise
            log.warning(
                "run %s: could not report the attempt's end (%s); without heartbeats the "
                "control plane will mark it lost",
                self.run,
                err,
            )

    def notice(self, notice: Notice, *, step: int) -> None:
        self.attempt.notice(notice, step=step)

    def preemption_rate(self) -> float | None:
        return self._estimate.latest()  # asked in the background: training never waits on it

    def interval(self, seconds: float, waste_seconds_per_hour: float | None) -> None:
        self.attempt.interval = (seconds, waste_seconds_per_hour)

    def account(self, figures: Callable[[], dict[str, float | int] | None]) -> None:
        self.attempt.time = figures

    def close(self) -> None:
        self._figures.send(self.control, rank=self.ranks.rank, patience=ANSWER_SECONDS)
        self._closed.set()
        self.attempt.stop()
        self.control.close()
