"""Store-only: the manifests in the store are the catalog.

A bundle is committed by writing its manifest last; the newest valid, complete manifest is
the one to resume from. A process that resumed the run owns every later position: a bundle
there was skipped by the resume (incomplete, unreadable, damaged) or belongs to the branch
the resume abandoned, and is saved again, replacing it. Without a control plane there are
no attempts and no fencing: one job per run name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping

import torch

from agent.attempt.notices import Notice
from agent.catalog.base import Upload
from agent.catalog.manifests import latest_manifest, usable_manifest, write_manifest
from agent.ranks.base import MEET_SECONDS, Ranks
from agent.save.policy import Position
from agent.save.upload import HeldBlobs
from ckpt.core.contract import BlobRef, Layer, LayerRecord, Manifest, RankRecord, SaveFigures
from ckpt.core.errors import BundleExistsError, CkptError, RankError, StoreError
from ckpt.core.storage import ObjectStore, keys
from ckpt.core.threads import parallel


class StoreCatalog:
    """The catalog of one run kept in the store alone."""

    def __init__(self, store: ObjectStore, *, run: str, ranks: Ranks) -> None:
        self._store, self._run, self._ranks = store, run, ranks
        self._resumed_at: Position | None = None  # where this process continues the run
        self._verified: set[str] = set()  # blobs known to be intact in the store

    def resumable(self, run: str, *, own: bool, step: int | None = None) -> Manifest | None:
        def find() -> Manifest | None:
            below = None if step is None else (step + 1, 0)
            found = latest_manifest(self._store, run, below=below)
            return found if step is None or (found and found.step == step) else None

        return self._ranks.from_first(find, timeout=MEET_SECONDS)

    def fall_back(
        self, run: str, manifest: Manifest, *, own: bool, reason: str, blob: str
    ) -> Manifest | None:
        # The rotten bundle stays until the resumed run reaches its position again and
        # replaces it (``check_save``).
        return self._ranks.from_first(
            lambda: latest_manifest(self._store, run, below=manifest.position),
            timeout=MEET_SECONDS,
        )

    def verified(self, blobs: Iterable[str]) -> None:
        self._verified.update(blobs)

    def check_save(self, position: Position) -> None:
        if self._resumed_at is not None and position > self._resumed_at:
            return
        key = keys.manifest_key(self._run, position.step, position.micro_step)
        if self._store.size(key) is None or usable_manifest(self._store, self._run, key) is None:
            return  # nothing to resume from there: replace it
        raise BundleExistsError(
            f"run {self._run} already has a bundle at {position} that this process did not "
            "resume from; saving would replace it. Resume the run first (all layers), or "
            "warm-start a new run: resume(from_run=..., layers=[...])"
        )

    def resumed(self, position: Position) -> None:
        self._resumed_at = position

    def commit(self, upload: Upload, *, position: Position) -> Manifest:
        """Every rank uploads its layers (and, in a job of many ranks, writes its rank record
        next to the manifest); once every rank has, rank 0 writes the manifest, last."""
        failure: CkptError | None = None
        try:
            records = upload(store_held(self._store, self._verified))
            self._verified.update(b.sha256 for record in records.values() for b in record.blobs)
            if self._ranks.world_size > 1:
                self._put_rank_record(position, records)
        except CkptError as err:
            failure = err
        if not self._ranks.all_ok(failure is None, timeout=MEET_SECONDS):
            if failure is not None:
                raise failure
            raise RankError(f"run {self._run} {position}: another rank failed to save")
        return self._ranks.from_first(
            lambda: write_manifest(
                self._store,
                run=self._run,
                position=(position.step, position.micro_step),
                world_size=self._ranks.world_size,
                ranks=self._rank_records(position, records),
            ),
            timeout=MEET_SECONDS,
        )

    def _put_rank_record(self, position: Position, records: Mapping[Layer, LayerRecord]) -> None:
        record = RankRecord(rank=self._ranks.rank, layers=dict(records))
        key = keys.rank_record_key(self._run, position.step, position.micro_step, self._ranks.rank)
        self._store.put(key, [record.model_dump_json().encode()])

    def _rank_records(
        self, position: Position, mine: Mapping[Layer, LayerRecord]
    ) -> dict[int, Mapping[Layer, LayerRecord]]:
        """Every rank's records: this rank's, and the others' from their rank records."""
        found: dict[int, Mapping[Layer, LayerRecord]] = {self._ranks.rank: mine}
        for rank in range(self._ranks.world_size):
            if rank not in found:
                key = keys.rank_record_key(self._run, position.step, position.micro_step, rank)
                data = self._store.get(key)
                found[rank] = RankRecord.model_validate_json(data).layers
        return found

    def report(self, bundle_id: int | None, *, rank: int, figures: SaveFigures) -> None:
        return None  # the figures are logged; there is no catalog to keep them

    def end(
        self, reason: str, *, final_save_committed: bool, step: int, patience: float | None
    ) -> None:
        return None  # no attempts without a control plane

    def notice(self, notice: Notice, *, step: int) -> None:
        return None  # logged; no attempts without a control plane

    def preemption_rate(self) -> float | None:
        return None  # no attempts without a control plane

    def interval(self, seconds: float, waste_seconds_per_hour: float | None) -> None:
        return None  # logged

    def account(self, figures: Callable[[], dict[str, float | int] | None]) -> None:
        return None  # no attempts without a control plane

    def close(self) -> None:
        return None


def store_held(store: ObjectStore, verified: set[str]) -> HeldBlobs:
    """Ask the store itself which blobs it holds intact.

    Every blob's presence and size are checked at each save (something else may have
    deleted it). ``verified`` holds blobs this process wrote or checked: a blob the store
    holds that is not among them is read back and hashed once before it is trusted, so a
    damaged blob is rewritten rather than referenced again. Blobs found intact join
    ``verified``; the caller adds those it writes once their writes succeed.
    """

    def held(blobs: list[BlobRef]) -> set[str]:
        intact = parallel(lambda blob: _stored_intact(store, blob, verified), blobs)
        found = {blob.sha256 for blob, ok in zip(blobs, intact, strict=True) if ok}
        verified.update(found)
        return found

    return held


def _stored_intact(store: ObjectStore, blob: BlobRef, verified: set[str]) -> bool:
    """Whether the store holds ``blob`` with the right size (and SHA-256, unless verified)."""
    key = keys.blob_key(blob.sha256)
    if store.size(key) != blob.size:
        return False
    if blob.sha256 in verified:
        return True
    buffer = torch.empty(blob.size, dtype=torch.uint8).numpy().data
    try:
        store.read_into(key, buffer)
    except StoreError:
        return False
    return hashlib.sha256(buffer).hexdigest() == blob.sha256
