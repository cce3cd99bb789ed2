"""Through the control plane (``CKPT_SERVER``): the catalog of every run, with fencing.

Resuming registers this process's attempt, which fences every older one, and takes the
bundle the control plane names. A save opens a bundle under the attempt's epoch, asks which
blobs the store lacks, uploads them, records every layer and commits; the control plane
checks that every rank recorded every layer and every blob is in the store, then writes
the manifest and moves the run's head. One bundle per attempt and step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from agent.attempt.interval import ESTIMATE_PATIENCE
from agent.attempt.notices import Notice
from agent.catalog.base import Upload
from agent.catalog.client import ControlPlane, IncompleteCommitError, IntactBlobError, Registration
from agent.catalog.manifests import versions
from agent.catalog.registration import Attempt
from agent.ranks.base import MEET_SECONDS, Ranks
from agent.save.policy import Position
from ckpt.core.contract import BlobRef, Layer, LayerRecord, Manifest, SaveFigures
from ckpt.core.errors import CkptError, ControlPlaneError, RankError, StoreError

log = logging.getLogger("ckpt")

# Upload, record and commit; a round that finds blobs gone uploads them again.
_COMMIT_ROUNDS = 3


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
        store_url: str,
    ) -> None:
        self.control = control
        self.attempt = Attempt(
            control,
            run=run,
            heartbeat_seconds=heartbeat_seconds,
            step=step,
            ranks=ranks,
            store_url=store_url,
        )
        self._run, self._ranks, self._store_url = run, ranks, store_url

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
            raise self._other_store(f"cannot read {manifest.run} step {manifest.step} ({reason})")
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
        return None  # the control plane keeps what it verified

    def check_save(self, position: Position) -> None:
        return None  # the control plane refuses what would not extend the run's head

    def resumed(self, position: Position) -> None:
        return None  # the attempt's registration says where it resumed

    def commit(self, upload: Upload, *, position: Position) -> Manifest:
        """One bundle per attempt and position (the checkpointer saves a position once)."""
        return self._commit_new(self.attempt.current(), position, upload)

    def _commit_new(self, attempt: Registration, position: Position, upload: Upload) -> Manifest:
        """Rank 0 opens; every rank uploads what the store lacks and records its layers; once
        every rank has, rank 0 commits. A commit that finds blobs gone (collected while this
        save deduplicated against them) has them uploaded again."""
        bundle_id = self._ranks.from_first(
            lambda: self.control.open_bundle(
                self._run,
                attempt=attempt,
                step=position.step,
                micro_step=position.micro_step,
                world_size=self._ranks.world_size,
                versions=versions(),
            ),
            timeout=MEET_SECONDS,
        )
        force: frozenset[str] = frozenset()
        for _ in range(_COMMIT_ROUNDS):
            self._record_round(bundle_id, attempt, upload, force)
            outcome = self._ranks.from_first(
                lambda: self._commit_once(bundle_id, attempt), timeout=MEET_SECONDS
            )
            if isinstance(outcome, Manifest):
                return outcome
            if force and outcome <= force:  # written just now, and still not seen
                raise self._other_store(
                    f"the control plane does not find {len(outcome)} blob(s) this job has "
                    "just written"
                )
            log.warning(
                "bundle %d: %d blob(s) vanished; uploading them again", bundle_id, len(outcome)
            )
            force = outcome
        raise ControlPlaneError(
            f"bundle {bundle_id}: blobs kept vanishing through {_COMMIT_ROUNDS} rounds of "
            "uploads (is garbage collection running with a grace period shorter than a save?)"
        )

    def _record_round(
        self, bundle_id: int, attempt: Registration, upload: Upload, force: frozenset[str]
    ) -> None:
        """This rank uploads and records its layers; then every rank learns whether all did."""
        failure: CkptError | None = None
        try:
            self._record(bundle_id, attempt, upload(self._held(force)))
        except CkptError as err:
            failure = err
        if not self._ranks.all_ok(failure is None, timeout=MEET_SECONDS):
            if failure is not None:
                raise failure
            raise RankError(f"bundle {bundle_id}: another rank failed to record its layers")

    def _commit_once(self, bundle_id: int, attempt: Registration) -> Manifest | frozenset[str]:
        """The committed manifest, or the blobs the commit found missing."""
        try:
            return self.control.commit(bundle_id, epoch=attempt.epoch)
        except IncompleteCommitError as err:
            if not err.blobs:
                raise
            return frozenset(err.blobs)

    def _other_store(self, problem: str) -> ControlPlaneError:
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

    def _held(self, force: frozenset[str]) -> Callable[[list[BlobRef]], set[str]]:
        """Which blobs the store holds, by the control plane, less those to upload anyway."""

        def held(blobs: list[BlobRef]) -> set[str]:
            return {b.sha256 for b in blobs} - self.control.missing_blobs(blobs) - force

        return held

    def _record(
        self, bundle_id: int, attempt: Registration, records: dict[Layer, LayerRecord]
    ) -> None:
        for layer, record in records.items():
            self.control.record_layer(
                bundle_id, rank=self._ranks.rank, layer=layer, epoch=attempt.epoch, record=record
            )

    def report(self, bundle_id: int | None, *, rank: int, figures: SaveFigures) -> None:
        if bundle_id is not None:
            self.control.report_save(bundle_id, rank=rank, figures=figures)

    def end(
        self, reason: str, *, final_save_committed: bool, step: int, patience: float | None
    ) -> None:
        self.attempt.end(
            reason, final_save_committed=final_save_committed, step=step, patience=patience
        )

    def notice(self, notice: Notice, *, step: int) -> None:
        self.attempt.notice(notice, step=step)

    def preemption_rate(self) -> float | None:
        return self.control.preemption_rate(self._run, patience=ESTIMATE_PATIENCE)

    def interval(self, seconds: float, waste_seconds_per_hour: float | None) -> None:
        self.attempt.interval = (seconds, waste_seconds_per_hour)

    def account(self, figures: Callable[[], dict[str, float | int] | None]) -> None:
        self.attempt.time = figures

    def unreachable(self) -> bool:
        return self.control.unreachable

    def close(self) -> None:
        self.attempt.stop()
        self.control.close()
