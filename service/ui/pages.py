"""What each dashboard page shows: the rules between the routes (``endpoints.py``, which
hand each request's one transaction in) and the SQL (``queries.py``, ``window.py``, the
domains' repositories)."""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ckpt.core.contract import RESTORE_ORDER, Imported, Layer
from service import completeness, lineage
from service.auth.principal import Principal
from service.auth.service import require_read
from service.bundles import repository as bundles_repository
from service.bundles.damage import trusted
from service.bundles.service import accepted_missing, imported_of
from service.errors import NotFoundError
from service.models import (
    Attempt,
    Blob,
    Bundle,
    BundleEvent,
    BundleStatus,
    Role,
    Run,
    RunActivity,
    Save,
)
from service.runs import repository as runs_repository
from service.runs.goodput import run_time_spent, time_spent
from service.runs.service import resumable_bundle
from service.ui import queries
from service.ui.drawing import WIDTH, draw_lineage
from service.ui.marks import draw_legend
from service.ui.queries import RunFigures, RunListing
from service.ui.saves import draw_saves
from service.ui.window import run_window

MAX_RANKS_SHOWN = 256  # of a bundle's completeness matrix
MAX_BLOBS_SHOWN = 500
MAX_LAYERS_NAMED = 6  # of the layers that hold one blob


@dataclass(frozen=True)
class RunsPage:
    runs: list[tuple[RunListing, RunFigures]]
    page: int
    has_next: bool
    prefix: str
    state: str


@dataclass(frozen=True)
class AttemptRow:
    attempt: Attempt
    number: int  # 1 for the run's first attempt
    state: str  # lineage.attempt_state
    steps_lost: int | None
    goodput: float | None  # None before its agent reported time

    @property
    def steps_lost_exact(self) -> bool:
        """False: ``steps_lost`` is a lower bound (the attempt was marked lost)."""
        return lineage.steps_lost_exact(self.attempt.end_reason)


@dataclass(frozen=True)
class RunPage:
    listing: RunListing
    figures: RunFigures
    lineage_svg: str
    legend_svg: str
    saves_svg: str
    attempts: list[AttemptRow]  # newest first
    goodput: float | None  # goodput (time) over every attempt, as GET .../goodput says
    hidden_lanes: int
    hidden_bundles: int


@dataclass(frozen=True)
class BlobView:
    sha256: str
    size: int
    state: str  # verified, size-checked, unverified, absent, wrong_size, wrong_hash, unknown
    layers: tuple[str, ...] = ()  # "rank 0 weights": the first layers that hold it
    more_layers: int = 0  # how many others hold it too (a header many layers share)


@dataclass(frozen=True)
class BundlePage:
    bundle: Bundle
    run: Run
    epoch: int | None
    attempt_number: int | None  # 1 for the run's first attempt
    state: str  # the run's
    ranks: list[tuple[int, list[tuple[str, int | None]]]]  # rank -> (layer, payload bytes)
    layer_bytes: dict[str, int]  # each layer's payload over the ranks shown
    missing: str  # in words; empty when nothing is
    blobs: list[BlobView]
    num_blobs: int
    saves: list[Save]
    new_run_command: str | None
    resume_command: str | None
    resume_note: str
    imported: str  # in words, for a bundle ``ckpt import`` made; empty for a save's
    layers: list[str] = field(default_factory=lambda: [layer.value for layer in RESTORE_ORDER])


def runs_page(
    session: Session, principal: Principal, *, prefix: str, state: str, page: int
) -> RunsPage:
    only = principal.run if principal.role is Role.RUN else None
    listings, has_next = queries.list_runs(
        session, prefix=prefix or None, state=state or None, only=only, page=page
    )
    found = queries.figures(session, listings=listings)
    return RunsPage(
        runs=[(listing, found[listing.id]) for listing in listings],
        page=page,
        has_next=has_next,
        prefix=prefix,
        state=state,
    )


def run_page(session: Session, principal: Principal, *, name: str) -> RunPage:
    run = _run(session, principal, name)
    listing = queries.run_listing(session, run=run)
    window = run_window(session, run, attempts=listing.attempts, bundles=listing.bundles)
    figures = queries.figures(session, listings=[listing], with_bytes=False)[run.id]
    hidden = window.picture.hidden
    _, spent = run_time_spent(session, run)
    return RunPage(
        listing=listing,
        figures=figures,
        lineage_svg=draw_lineage(window.picture),
        legend_svg=draw_legend(width=WIDTH),
        saves_svg=draw_saves(window.saves),
        attempts=[
            _attempt_row(run, lane.number, a, window.steps_lost[a.id])
            for lane, a in reversed(list(zip(window.picture.lanes, window.attempts, strict=True)))
        ],
        goodput=spent.goodput,
        hidden_lanes=hidden.lanes if hidden else 0,
        hidden_bundles=hidden.bundles if hidden else 0,
    )


def _attempt_row(run: Run, number: int, attempt: Attempt, steps_lost: int | None) -> AttemptRow:
    spent = time_spent(attempt, steps_lost=steps_lost)
    state = lineage.attempt_state(attempt.end_reason, fenced=attempt.epoch != run.epoch)
    return AttemptRow(attempt, number, state, steps_lost, spent.goodput if spent else None)


def bundle_page(
    session: Session, principal: Principal, *, name: str, bundle_id: int, server_url: str
) -> BundlePage:
    run = _run(session, principal, name)
    bundle = _bundle(session, run, bundle_id)
    layers = bundles_repository.layers_of(session, bundle_id=bundle.id)
    recorded = {(row.rank, Layer(row.layer)): int(row.record["payload_bytes"]) for row in layers}
    sizes: dict[str, int] = {}
    holders: dict[str, dict[str, None]] = {}  # sha -> the layers that hold it, in order
    for row in layers:
        for blob in row.record.get("blobs", []):
            sizes[blob["sha256"]] = int(blob["size"])
            holders.setdefault(blob["sha256"], {})[f"rank {row.rank} {row.layer}"] = None
    shown = list(sizes.items())[:MAX_BLOBS_SHOWN]
    known = bundles_repository.blobs_by_sha(session, shas=[sha for sha, _ in shown])
    attempt = session.get(Attempt, bundle.attempt_id) if bundle.attempt_id else None
    resumable = resumable_bundle(session, run)
    listing = queries.run_listing(session, run=run)
    saves = bundles_repository.saves_of(session, bundle_id=bundle.id)
    command, note = resume_command(
        run.name, bundle, resumable_id=resumable.id if resumable else None, server_url=server_url
    )
    imported = imported_of(bundle)
    missing = completeness.missing_layers(
        world_size=bundle.world_size, recorded=set(recorded), accepted=accepted_missing(imported)
    )
    ranks = _matrix(bundle.world_size, recorded)
    return BundlePage(
        bundle=bundle,
        run=run,
        epoch=attempt.epoch if attempt else None,
        attempt_number=_attempt_number(session, attempt) if attempt else None,
        state=listing.state,
        ranks=ranks,
        layer_bytes={
            layer.value: sum(cells[i][1] or 0 for _, cells in ranks)
            for i, layer in enumerate(RESTORE_ORDER)
        },
        missing=missing_words(missing),
        blobs=[_blob(sha, size, known.get(sha), layers=list(holders[sha])) for sha, size in shown],
        num_blobs=len(sizes),
        saves=saves,
        new_run_command=new_run_command(run.name, bundle, server_url=server_url),
        resume_command=command,
        resume_note=note,
        imported=imported_words(imported),
    )


def imported_words(imported: Imported | None) -> str:
    """How ``ckpt import`` made the bundle, in words; empty for a save's bundle."""
    if imported is None:
        return ""
    source = f"Imported from {imported.format} ({imported.source})"
    if not imported.partial:
        return source
    lacks = ", ".join(layer.value for layer in imported.missing)
    return f"{source}, partial: it has no {lacks} layer, so its resume is not bit-exact"


def _attempt_number(session: Session, attempt: Attempt) -> int:
    """The attempt's number in its run: how many attempts came up to it (an index range of
    ``attempt (run_id, epoch)``)."""
    count = session.scalar(
        select(func.count())
        .select_from(Attempt)
        .where(Attempt.run_id == attempt.run_id, Attempt.epoch <= attempt.epoch)
    )
    return int(count or 0)


def missing_words(missing: list[completeness.Part], *, ranks: int = 8) -> str:
    """The unrecorded parts in words, rank by rank: "rank 0: optimizer, rng; rank 1: all"."""
    by_rank: dict[int, list[str]] = {}
    for part in missing:
        by_rank.setdefault(part.rank, []).append(part.layer.value)
    words = [
        f"rank {rank}: {'all six layers' if len(layers) == len(RESTORE_ORDER) else ', '.join(layers)}"
        for rank, layers in list(by_rank.items())[:ranks]
    ]
    more = len(by_rank) - ranks
    return "; ".join(words) + (f"; and {more} more ranks" if more > 0 else "")


def _matrix(
    world_size: int, recorded: dict[tuple[int, Layer], int]
) -> list[tuple[int, list[tuple[str, int | None]]]]:
    """Each rank's layers (the first ``MAX_RANKS_SHOWN`` ranks): its payload bytes, None
    while unrecorded."""
    return [
        (rank, [(layer.value, recorded.get((rank, layer))) for layer in RESTORE_ORDER])
        for rank in range(min(world_size, MAX_RANKS_SHOWN))
    ]


def _blob(sha256: str, size: int, blob: Blob | None, *, layers: list[str]) -> BlobView:
    """A blob, the first ``MAX_LAYERS_NAMED`` of the layers that hold it, and what the
    catalog knows of its copy in the store."""
    if blob is None:
        state = "unknown"
    elif blob.damaged_at is not None:
        state = blob.damage or "damaged"
    elif blob.hashed_at is not None:
        state = "verified"  # its bytes hashed to its name
    else:
        state = "size-checked" if trusted(blob) else "unverified"
    named = tuple(layers[:MAX_LAYERS_NAMED])
    return BlobView(sha256, size, state, layers=named, more_layers=len(layers) - len(named))


def new_run_command(run: str, bundle: Bundle, *, server_url: str) -> str | None:
    """The shell command that starts a new run from ``bundle`` (``CKPT_FROM_RUN`` /
    ``CKPT_FROM_STEP``); None when it cannot be resumed from."""
    if bundle.status != BundleStatus.COMPLETE:
        return None
    return (
        f"CKPT_SERVER={shlex.quote(server_url)} "
        f"CKPT_RUN={shlex.quote(f'{run}-from-{bundle.step}')} "
        f"CKPT_FROM_RUN={shlex.quote(run)} CKPT_FROM_STEP={bundle.step} "
        "ckpt launch -- python train.py"
    )


def resume_command(
    run: str, bundle: Bundle, *, resumable_id: int | None, server_url: str
) -> tuple[str | None, str]:
    """The shell command that continues the run itself from ``bundle``, and a note on it.

    A run always resumes from its live branch's newest complete bundle: for that bundle the
    command is the job's launch; for an older complete one, a rollback to it first (the run's
    next attempt then resumes from it). Other bundles cannot be resumed from.
    """
    launch = (
        f"CKPT_SERVER={shlex.quote(server_url)} CKPT_RUN={shlex.quote(run)} "
        "ckpt launch -- python train.py"
    )
    if bundle.status != BundleStatus.COMPLETE:
        return None, f"a {bundle.status} bundle cannot be resumed from: only a complete one"
    if bundle.id == resumable_id:
        return launch, "the run's next attempt resumes from this bundle (replace train.py)"
    rollback = (
        f'curl -fsS -X POST -H "Authorization: Bearer $CKPT_TOKEN" '
        f"-H 'Content-Type: application/json' -d '{{\"bundle_id\": {bundle.id}}}' "
        f"{shlex.quote(f'{server_url}/v1/runs/{run}/rollback')}"
    )
    note = (
        "rolls the run back to this bundle (a write token), then its next attempt resumes from it"
    )
    return f"{rollback} && {launch}", note


def manifest(
    session: Session, principal: Principal, *, name: str, bundle_id: int
) -> dict[str, Any]:
    bundle = _bundle(session, _run(session, principal, name), bundle_id)
    if bundle.manifest is None:
        raise NotFoundError(f"bundle {bundle_id} is {bundle.status}: it has no manifest")
    return bundle.manifest


def live_version(session: Session, principal: Principal, *, name: str) -> str:
    """A short digest of everything the run page shows: it changes when any of it does."""
    run = _run(session, principal, name)
    activity = session.get(RunActivity, run.id)  # kept by every write to attempts
    last_event = session.scalar(
        select(func.max(BundleEvent.id)).where(BundleEvent.run_id == run.id)
    )
    facts = (run.epoch, run.head_bundle_id, activity.writes if activity else 0, last_event)
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:16]


def _run(session: Session, principal: Principal, name: str) -> Run:
    require_read(principal, name)
    run = runs_repository.get_run(session, name=name)
    if run is None:
        raise NotFoundError(f"no run named {name!r}")
    return run


def _bundle(session: Session, run: Run, bundle_id: int) -> Bundle:
    bundle = bundles_repository.get_bundle(session, bundle_id=bundle_id)
    if bundle is None or bundle.run_id != run.id:
        raise NotFoundError(f"run {run.name!r} has no bundle {bundle_id}")
    return bundle
