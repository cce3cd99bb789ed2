"""The scrubber: re-read and re-hash stored blobs, so that a blob that rots or disappears
after its bundle was committed is found before an agent relies on it, and a blob a commit
only size-checked (commits never read bytes) gets its bytes hashed (``hashed_at``).

One pass reads the blobs of each run's resumable bundle first, then of the other complete
bundles, newest first; each blob once, at most ``CKPT_SCRUB_BYTES_PER_SECOND`` on average.
A blob found absent, of the wrong size or not matching its SHA-256 is marked damaged,
bundle by bundle as the pass goes (``bundles/damage.py``): every complete bundle using it
is quarantined, so ``/resumable`` moves back to the newest bundle that is still whole, and
the next save writes the blob again.

A store that fails to answer (a ``StoreError``, as opposed to "no such object") ends the
pass, and nothing is marked for the bundle being read. So does a store that holds none of
what a bundle lists, not even its manifest, before the pass has found anything present: an
unmounted directory looks like that, and must not quarantine every bundle there is.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

from pydantic import BaseModel
from sqlalchemy.orm import Session

from ckpt.core.contract import LayerRecord
from ckpt.core.errors import StoreError
from ckpt.core.storage import keys
from service import completeness
from service.bundles import damage
from service.bundles import repository as bundles_repository
from service.bundles.blobs import read_back
from service.completeness import BlobProblem
from service.context import Context
from service.errors import StoreUnavailableError
from service.events.schemas import System
from service.maintenance.service import Task, exclusive
from service.models import Bundle, BundleStatus, utcnow
from service.runs import repository as runs_repository
from service.runs.service import resumable_bundle
from service.scrub import repository

log = logging.getLogger("ckpt.scrub")


class DamagedBlob(BaseModel):
    sha256: str
    problem: BlobProblem


class ScrubReport(BaseModel):
    skipped: bool = False  # another replica was scrubbing
    stopped: bool = False  # the server stopped: the pass ended early
    bundles: int = 0  # bundles whose every blob was checked
    blobs: int = 0  # blobs read
    bytes: int = 0  # bytes read
    damaged: list[DamagedBlob] = []
    quarantined: list[int] = []  # bundles set aside for a damaged blob


def scrub(context: Context, *, halt: threading.Event | None = None) -> ScrubReport:
    """One pass of the scrubber; ``halt`` (set when the server stops) ends it early.

    Raises:
        StoreUnavailableError: the store failed to answer; the pass ended there.
    """
    report = ScrubReport()
    with exclusive(context, Task.SCRUB) as current:
        if current is None:
            report.skipped = True
            return report
        pass_ = _Pass(context, report, halt or threading.Event())
        try:
            pass_.run()
        finally:
            current.outcome = report.model_dump_json()
            context.metrics.scrub_passes.inc()
    log.info("scrub: %s", report.model_dump_json())
    return report


class _Pass:
    """The state of one pass: which blobs it has read, whether any was present."""

    def __init__(self, context: Context, report: ScrubReport, halt: threading.Event) -> None:
        self.context, self.report, self.halt = context, report, halt
        self.seen: set[str] = set()
        self.found_present = False
        self.pacer = _Pacer(context.settings.scrub_bytes_per_second, halt)

    def run(self) -> None:
        for bundle_id in self._order():
            if self.halt.is_set():
                self.report.stopped = True
                return
            self._bundle(bundle_id)

    def _order(self) -> list[int]:
        """Each run's resumable bundle, then every other complete bundle, newest first."""
        with self.context.transaction() as session:
            first = [
                found.id
                for run in repository.runs(session)
                if (found := resumable_bundle(session, run)) is not None
            ]
            rest = repository.complete_bundle_ids(session)
        listed = set(first)
        return first + [bundle_id for bundle_id in rest if bundle_id not in listed]

    def _bundle(self, bundle_id: int) -> None:
        with self.context.transaction() as session:
            bundle = bundles_repository.get_bundle(session, bundle_id=bundle_id)
            if bundle is None or bundle.status != BundleStatus.COMPLETE:
                return  # changed since the pass began
            sizes = _blob_sizes(session, bundle)
            run = runs_repository.get_run_by_id(session, run_id=bundle.run_id).name
        found: dict[str, BlobProblem] = {}
        intact: list[str] = []
        read_at = utcnow()
        for sha, size in sizes.items():
            if sha in self.seen:
                continue
            if not self.pacer.wait(size):
                self.report.stopped = True
                return
            problem = self._read(sha, size)
            if problem is not None:
                found[sha] = problem
            else:
                intact.append(sha)
        if BlobProblem.ABSENT in found.values() and not self.found_present:
            self._check_store_answers(run, bundle)
        self._mark(found, read_at=read_at)
        if intact:  # a commit only checked their sizes: their bytes are known good now
            with self.context.transaction() as session:
                bundles_repository.mark_hashed(session, shas=intact, at=read_at)
        self.report.bundles += 1

    def _read(self, sha: str, size: int) -> BlobProblem | None:
        # A StoreUnavailableError ends the pass.
        stored = read_back(self.context.store, sha, metrics=self.context.metrics, by="scrubber")
        self.seen.add(sha)
        self.found_present |= stored.size is not None
        metrics = self.context.metrics
        self.report.blobs += 1
        self.report.bytes += stored.size or 0
        metrics.scrub_blobs.inc()
        metrics.scrub_bytes.inc(stored.size or 0)
        return completeness.blob_problem(size, stored)

    def _check_store_answers(self, run: str, bundle: Bundle) -> None:
        """Before the first "absent" of a pass that has found nothing present: the store must
        at least hold the bundle's manifest, or it is taken for unmounted."""
        try:
            manifest = self.context.store.size(
                keys.manifest_key(run, bundle.step, bundle.micro_step)
            )
        except StoreError as err:
            raise StoreUnavailableError(f"the scrubber cannot read the store: {err}") from err
        if manifest is None:
            raise StoreUnavailableError(
                f"the store holds none of the blobs read so far, nor the manifest of bundle "
                f"{bundle.id} (run {run!r}, step {bundle.step}): it looks unmounted or emptied. "
                "The scrubber marked nothing; check CKPT_STORE"
            )
        self.found_present = True

    def _mark(self, found: dict[str, BlobProblem], *, read_at: datetime) -> None:
        if not found:
            return
        with self.context.transaction() as session:
            quarantined = damage.mark_damaged(
                session,
                found,
                read_at=read_at,
                actor=System.SCRUBBER,
                found_by="found by the scrubber",
            )
            ids = [bundle.id for bundle in quarantined]
        self.report.damaged += [DamagedBlob(sha256=sha, problem=p) for sha, p in found.items()]
        self.report.quarantined += ids
        self.context.metrics.scrub_damaged.inc(len(found))
        log.error("scrub: %d blob(s) damaged, bundles %s quarantined", len(found), ids)


def _blob_sizes(session: Session, bundle: Bundle) -> dict[str, int]:
    """Each blob of the bundle and the size its layers record, in rank and layer order."""
    sizes: dict[str, int] = {}
    for row in bundles_repository.layers_of(session, bundle_id=bundle.id):
        for blob in LayerRecord.model_validate(row.record).blobs:
            sizes.setdefault(blob.sha256, blob.size)
    return sizes


class _Pacer:
    """Keeps reads at ``rate`` bytes a second on average (0: as fast as the store answers)."""

    def __init__(self, rate: float, halt: threading.Event) -> None:
        self.rate, self.halt = rate, halt
        self.started = time.monotonic()
        self.booked = 0

    def wait(self, nbytes: int) -> bool:
        """Wait until ``nbytes`` more may be read; False when halted meanwhile."""
        self.booked += nbytes
        if self.rate > 0:
            delay = self.started + self.booked / self.rate - time.monotonic()
            if delay > 0:
                return not self.halt.wait(delay)
        return not self.halt.is_set()
