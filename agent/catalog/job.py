"""The commit of a job of many ranks through the control plane, and what an outage defers.

Rank 0 opens the bundle; every rank uploads what the store lacks and records its layers;
once every rank has, rank 0 commits. Every call waits ``ANSWER_SECONDS`` for an answer; what
the control plane does not answer in time is decided together at the ranks' meetings (rank 0
answers for the open and the commit; the ranks gather who recorded), so every rank defers
alike:

- a rank whose layers the control plane did not take writes them to the store as a *rank
  record* (``keys.rank_record_key``, as store-only jobs do), beside its bytes;
- rank 0's commit is ``Deferred``: once the control plane answers it opens the bundle (if it
  was not), records the layers of every rank that left a rank record, and commits, under the
  attempt's epoch (a fenced attempt's save is refused as ever);
- another rank's save is ``Deferred`` too: durable once the control plane says the bundle of
  this attempt at this position is complete (its manifest, which the commit writes to the
  store first, names the bundle to ask about). It never claims durable before the commit.

Training never waits on the control plane: the meetings are those of every save, on the
persist thread's own group.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from agent.catalog.base import Deferred, Upload
from agent.catalog.client import ControlPlane, Registration, no_answer
from agent.catalog.late import SaveCalls
from agent.catalog.manifests import versions
from agent.catalog.registration import Attempt
from agent.ranks.base import MEET_SECONDS, Ranks
from agent.save.policy import Position
from agent.save.upload import HeldBlobs
from ckpt.core.contract import Layer, LayerRecord, Manifest, RankRecord
from ckpt.core.errors import (
    CkptError,
    ControlPlaneError,
    RankError,
    SaveLostError,
    StoreAccessError,
    StoreError,
)
from ckpt.core.storage import ObjectStore, keys


class JobCatalog(Protocol):
    """What a job's commit uses of its control-plane catalog."""

    control: ControlPlane
    calls: SaveCalls
    attempt: Attempt
    ranks: Ranks
    store: ObjectStore
    run: str

    def held(self, force: frozenset[str], *, patience: float | None = None) -> HeldBlobs: ...

    def commit_once(
        self, bundle_id: int, attempt: Registration, *, patience: float | None = None
    ) -> Manifest | frozenset[str]: ...

    def other_store(self, problem: str) -> ControlPlaneError: ...

    def record(
        self,
        bundle_id: int,
        *,
        epoch: int,
        records: Mapping[Layer, LayerRecord],
        patience: float | None,
    ) -> None: ...

    def why_defer(self) -> str | None: ...

    def deferred(self, position: Position, finish: Callable[[], Manifest]) -> Deferred: ...


log = logging.getLogger("ckpt")

# Upload, record and commit; a round that finds blobs gone uploads them again.
COMMIT_ROUNDS = 3
# How long a save's calls retry a control plane that does not answer, and half of what the
# save waits for one call (``agent.catalog.late``) before it defers its commit: a due save
# may wait for the bytes of the one before, so this bounds what an outage's onset costs
# training; a busy control plane that answers later only moves a commit to the background.
ANSWER_SECONDS = 0.5
# A deferred commit retries each call for the client's window (2 minutes by default), this
# many times: an outage of up to half an hour costs no save; a longer one fails it.
DEFER_ROUNDS = 15
# How often a rank other than 0 looks in the store for the manifest of a deferred commit.
_LOOK_SECONDS = 0.5


@dataclass
class _Late:
    """Rank 0's part of a job's deferred commit: what is left to do."""

    position: Position
    bundle_id: int | None
    mine: dict[Layer, LayerRecord]
    in_store: frozenset[int]  # the ranks whose layers are in rank records, not recorded
    done: set[int] = field(default_factory=set)


class JobCommit:
    """Commits the bundles of one attempt of a job of many ranks."""

    def __init__(self, catalog: JobCatalog, *, closed: threading.Event) -> None:
        self._catalog = catalog
        self._control: ControlPlane = catalog.control
        self._ranks: Ranks = catalog.ranks
        self._store: ObjectStore = catalog.store
        self._run = catalog.run
        self._closed = closed

    def commit(self, upload: Upload, *, position: Position) -> Manifest | Deferred:
        attempt = self._catalog.attempt.current()
        bundle_id = self._ranks.from_first(
            lambda: self._open(attempt, position), timeout=MEET_SECONDS
        )
        force: frozenset[str] = frozenset()
        for _ in range(COMMIT_ROUNDS):
            records, in_store = self._record_round(bundle_id, attempt, position, upload, force)
            if bundle_id is None or in_store:
                return self._defer(attempt, position, bundle_id, records, in_store)
            outcome = self._ranks.from_first(
                functools.partial(self._commit_quickly, bundle_id, attempt), timeout=MEET_SECONDS
            )
            if outcome is None:
                return self._defer(attempt, position, bundle_id, records, frozenset())
            if isinstance(outcome, Manifest):
                return outcome
            if force and outcome <= force:  # written just now, and still not seen
                raise self._catalog.other_store(
                    f"the control plane does not find {len(outcome)} blob(s) this job has "
                    "just written"
                )
            log.warning(
                "bundle %d: %d blob(s) vanished; uploading them again", bundle_id, len(outcome)
            )
            force = outcome
        raise ControlPlaneError(
            f"bundle {bundle_id}: blobs kept vanishing through {COMMIT_ROUNDS} rounds of "
            "uploads (is garbage collection running with a grace period shorter than a save?)"
        )

    def _open(self, attempt: Registration, position: Position) -> int | None:
        """Rank 0 opens the bundle; None when the control plane does not answer in time, or
        the save should not try it (``why_defer``)."""
        if self._catalog.why_defer() is not None:
            return None
        try:
            return self._open_bundle(attempt, position, patience=ANSWER_SECONDS)
        except ControlPlaneError as err:
            if not no_answer(err):
                raise
            return None

    def _open_bundle(
        self, attempt: Registration, position: Position, *, patience: float | None
    ) -> int:
        return self._catalog.calls.answer(
            lambda: self._control.open_bundle(
                self._run,
                attempt=attempt,
                step=position.step,
                micro_step=position.micro_step,
                world_size=self._ranks.world_size,
                versions=versions(),
                patience=patience,
            ),
            patience=patience,
            what=f"opening the bundle of {position}",
        )

    def _record_round(
        self,
        bundle_id: int | None,
        attempt: Registration,
        position: Position,
        upload: Upload,
        force: frozenset[str],
    ) -> tuple[dict[Layer, LayerRecord], frozenset[int]]:
        """This rank uploads and records its layers (in a rank record when the control plane
        does not take them); then every rank learns whether all did, and which ranks' layers
        are in rank records."""
        failure: CkptError | None = None
        records: dict[Layer, LayerRecord] = {}
        in_store = bundle_id is None
        try:
            records = upload(self._catalog.held(force, patience=ANSWER_SECONDS))
            if bundle_id is not None:
                in_store = not self._record(bundle_id, attempt, records)
            if in_store:
                self._put_rank_record(position, records)
        except CkptError as err:
            failure = err
        outcomes = self._ranks.gather((failure is None, in_store), timeout=MEET_SECONDS)
        if not all(ok for ok, _ in outcomes):
            if failure is not None:
                raise failure
            raise RankError(f"run {self._run} {position}: another rank failed to save")
        return records, frozenset(rank for rank, (_, late) in enumerate(outcomes) if late)

    def _record(
        self, bundle_id: int, attempt: Registration, records: Mapping[Layer, LayerRecord]
    ) -> bool:
        """Record this rank's layers; False when the control plane did not answer in time, or
        stopped answering during the save."""
        if self._catalog.calls.silent:
            return False
        try:
            self._catalog.record(
                bundle_id, epoch=attempt.epoch, records=records, patience=ANSWER_SECONDS
            )
        except ControlPlaneError as err:
            if not no_answer(err):
                raise
            return False
        return True

    def _commit_quickly(
        self, bundle_id: int, attempt: Registration
    ) -> Manifest | frozenset[str] | None:
        """Rank 0's commit: the manifest, the blobs found missing, or None (no answer)."""
        if self._catalog.calls.silent:
            return None
        try:
            return self._catalog.commit_once(bundle_id, attempt, patience=ANSWER_SECONDS)
        except ControlPlaneError as err:
            if not no_answer(err):
                raise
            return None

    def _put_rank_record(self, position: Position, records: Mapping[Layer, LayerRecord]) -> None:
        record = RankRecord(rank=self._ranks.rank, layers=dict(records))
        key = keys.rank_record_key(self._run, position.step, position.micro_step, self._ranks.rank)
        self._store.put(key, [record.model_dump_json().encode()])

    def _defer(
        self,
        attempt: Registration,
        position: Position,
        bundle_id: int | None,
        records: dict[Layer, LayerRecord],
        in_store: frozenset[int],
    ) -> Deferred:
        log.warning(
            "run %s: %s is in the store (rank %d); its commit waits for the control plane",
            self._run,
            position,
            self._ranks.rank,
        )
        if self._ranks.rank != 0:
            return Deferred(position=position, finish=lambda: self._seen(attempt, position))
        late = _Late(position, bundle_id, records, in_store)
        return self._catalog.deferred(position, lambda: self._finish(attempt, late))

    def _finish(self, attempt: Registration, late: _Late) -> Manifest:
        """Rank 0, once the control plane answers: open, record what is in rank records,
        commit; each call retried for the client's window, ``DEFER_ROUNDS`` times."""
        for round_ in range(DEFER_ROUNDS):
            try:
                return self._advance(attempt, late)
            except ControlPlaneError as err:
                if not no_answer(err) or round_ == DEFER_ROUNDS - 1 or self._closed.is_set():
                    raise
                log.warning(
                    "run %s: %s still waits for its commit: %s", self._run, late.position, err
                )
        raise AssertionError("the last round raises")

    def _advance(self, attempt: Registration, late: _Late) -> Manifest:
        if late.bundle_id is None:
            late.bundle_id = self._open_bundle(attempt, late.position, patience=None)
        for rank in sorted(late.in_store - late.done):
            self._control.record_layers(
                late.bundle_id, rank=rank, epoch=attempt.epoch, records=self._layers_of(rank, late)
            )
            late.done.add(rank)
        outcome = self._catalog.commit_once(late.bundle_id, attempt)
        if isinstance(outcome, Manifest):
            return outcome
        raise SaveLostError(
            f"bundle {late.bundle_id}: {len(outcome)} blob(s) this job wrote during the outage "
            "are not accepted at its commit: collected meanwhile (a garbage-collection grace "
            "period shorter than the outage), or written before its bundle was opened under a "
            "run token (run isolation); the save is not kept"
        )

    def _layers_of(self, rank: int, late: _Late) -> Mapping[Layer, LayerRecord]:
        if rank == self._ranks.rank:
            return late.mine
        position = late.position
        key = keys.rank_record_key(self._run, position.step, position.micro_step, rank)
        return RankRecord.model_validate_json(self._store.get(key)).layers

    def _seen(self, attempt: Registration, position: Position) -> Manifest:
        """Another rank: wait until the control plane says rank 0 committed the bundle of this
        attempt at ``position`` (its manifest in the store names it), for as long as rank 0
        retries."""
        key = keys.manifest_key(self._run, position.step, position.micro_step)
        deadline = time.monotonic() + DEFER_ROUNDS * self._control.retry_seconds
        while not self._closed.wait(_LOOK_SECONDS):
            manifest = self._manifest(key)
            if manifest is not None and self._committed(manifest, attempt):
                return manifest
            if time.monotonic() > deadline:
                break
        raise ControlPlaneError(
            f"run {self._run} {position}: rank 0 did not commit the bundle in time", status=None
        )

    def _committed(self, manifest: Manifest, attempt: Registration) -> bool:
        """Whether ``manifest`` is this attempt's, and the control plane says it committed."""
        if manifest.catalog is None or manifest.catalog.epoch != attempt.epoch:
            return False  # another attempt's bundle at this position
        try:
            return self._control.committed(manifest.catalog.bundle_id)
        except ControlPlaneError as err:
            if not no_answer(err):
                raise
            return False

    def _manifest(self, key: str) -> Manifest | None:
        try:
            if self._store.size(key) is None:
                return None
            return Manifest.model_validate_json(self._store.get(key))
        except StoreAccessError:
            raise  # no credentials, or refused: looking again changes nothing
        except (StoreError, ValueError):
            return None  # not there yet, or being written
