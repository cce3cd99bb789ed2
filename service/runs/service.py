"""Runs: create, list, read and change their retention; roll back; the lineage and the
latest-resumable query. Also how catalog rows read as lineage nodes and as API models,
shared with ``attempts.py`` (the attempts of a run) and the bundles service."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.orm import Session, defer, load_only

from service import lineage
from service.auth.principal import Principal
from service.auth.service import require_admin, require_read, require_write
from service.context import Context
from service.errors import ConflictError, NotFoundError
from service.lineage import AttemptNode, Node
from service.models import Attempt, Bundle, BundleStatus, Role, Rollback, Run
from service.runs import repository
from service.runs.figures import RunFigures, run_figures
from service.runs.goodput import run_time_spent, time_out, time_spent
from service.runs.schemas import (
    AttemptOut,
    BundleRef,
    Edge,
    Lineage,
    LineageBundle,
    ResumeEdge,
    RollbackEvent,
    RollbackOut,
    RollbackRequest,
    RunCreate,
    RunGoodput,
    RunOut,
    RunPage,
    RunPatch,
    Verification,
)
from service.sql import Lock


def create_run(context: Context, principal: Principal, request: RunCreate) -> RunOut:
    require_write(principal, request.name)
    with context.transaction() as session:
        run, created = repository.ensure_run(
            session, name=request.name, keep_last=request.keep_last, keep_every=request.keep_every
        )
        if not created:
            raise ConflictError(f"run {request.name!r} exists; PATCH it to change its retention")
        return run_out(session, run)


def get_run(context: Context, principal: Principal, *, name: str) -> RunOut:
    require_read(principal, name)
    with context.transaction() as session:
        return run_out(session, _run(session, name))


PAGE_STEP = 100  # runs a step of a page of runs (list_runs)


def list_runs(
    context: Context, principal: Principal, *, after: str | None, limit: int, prefix: str | None
) -> RunPage:
    if principal.role is Role.RUN:  # a run token sees its own run only
        assert principal.run is not None
        prefix_ok = prefix is None or principal.run.startswith(prefix)
        after_ok = after is None or principal.run > after
        names = [principal.run] if prefix_ok and after_ok else []
    with context.read() as session:
        if principal.role is Role.RUN:
            runs = [r for name in names if (r := repository.get_run(session, name=name))]
            return RunPage(runs=run_outs(session, runs), next=None)
        # A step at a time: a bulk request pauses between statements (service.yielding).
        page: list[RunOut] = []
        while True:
            step = min(PAGE_STEP, limit - len(page))
            runs = repository.page_runs(session, after=after, limit=step + 1, prefix=prefix)
            page += run_outs(session, runs[:step])
            if len(page) == limit or len(runs) <= step:
                return RunPage(runs=page, next=page[-1].name if len(runs) > step else None)
            after = page[-1].name


def patch_run(context: Context, principal: Principal, *, name: str, patch: RunPatch) -> RunOut:
    """Change the run's retention policy, or (an admin) its dedup group."""
    require_write(principal, name)
    if "dedup_group" in patch.model_fields_set:
        require_admin(principal)
    with context.transaction() as session:
        run = _run(session, name, lock=Lock.UPDATE)
        for field in patch.model_fields_set:
            setattr(run, field, getattr(patch, field))
        return run_out(session, run)


def rollback(
    context: Context, principal: Principal, *, name: str, request: RollbackRequest
) -> RollbackOut:
    """Make an older complete bundle the head. Bumps the epoch: every attempt is fenced, and
    the next one resumes from that bundle."""
    require_write(principal, name)
    with context.transaction() as session:
        run = _run(session, name, lock=Lock.UPDATE)
        target = session.get(Bundle, request.bundle_id)
        if target is None or target.run_id != run.id:
            raise NotFoundError(f"run {name!r} has no bundle {request.bundle_id}")
        if target.status != BundleStatus.COMPLETE:
            raise ConflictError(
                f"bundle {target.id} is {target.status}; only a complete bundle can become the head"
            )
        previous = run.head_bundle_id
        run.epoch += 1
        run.head_bundle_id = target.id
        repository.add_rollback(session, run=run, from_bundle_id=previous, to_bundle_id=target.id)
        return RollbackOut(
            run=run.name, epoch=run.epoch, from_bundle_id=previous, head=_ref(target)
        )


def resumable(context: Context, principal: Principal, *, name: str) -> str:
    """The run's resume point, as the JSON of a ``ResumePoint`` (``resume_json``)."""
    require_read(principal, name)
    with context.read() as session:
        found = repository.get_run_and_head(session, name=name)
        if found is None:
            raise NotFoundError(f"no run named {name!r}")
        run, head, head_manifest = found
        start = resumable_bundle(session, run, head=head)
        if start is None:
            raise NotFoundError(
                f"run {name!r} has no resumable bundle yet: no bundle of its live branch is "
                "complete (every rank's six layers recorded and every blob verified)"
            )
        return resume_json(session, start, manifest=head_manifest if start is head else None)


def run_goodput(context: Context, principal: Principal, *, name: str) -> RunGoodput:
    """The run's time over all its attempts that reported theirs, and its goodput."""
    require_read(principal, name)
    with context.transaction() as session:
        run = _run(session, name)
        reported, spent = run_time_spent(session, run)
    out = time_out(spent)
    assert out is not None
    return RunGoodput(run=run.name, attempts=reported, time=out)


def get_lineage(context: Context, principal: Principal, *, name: str) -> Lineage:
    require_read(principal, name)
    with context.read() as session:
        run = _run(session, name)
        bundles = repository.lineage_bundles(session, run_id=run.id, columns=BUNDLE_FIELDS)
        nodes = {b.id: node(b) for b in bundles}
        attempts = repository.run_attempts(session, run_id=run.id)
        steps = {b.id: b.step for b in bundles}
        return _lineage(
            run,
            bundles=bundles,
            live=lineage.ancestry(run.head_bundle_id, nodes),
            start=lineage.resumable(run.head_bundle_id, nodes),
            attempts=attempts,
            lost=lineage.steps_lost_by_attempt(attempt_node(a, steps.get) for a in attempts),
            rollbacks=repository.run_rollbacks(session, run_id=run.id),
            forks=lineage.forks(nodes.values()),
        )


def lineage_page(
    context: Context, principal: Principal, *, name: str, limit: int, before: int | None
) -> Lineage:
    """A page of the lineage: the run's ``limit`` newest bundles older than ``before``, with
    the live branch, attempts, edges, rollbacks and forks that concern them. Its cost grows
    with the page, not with the run (the live branch is walked in SQL down to the page)."""
    require_read(principal, name)
    with context.read() as session:
        run = _run(session, name)
        rows = repository.lineage_bundles(
            session, run_id=run.id, columns=BUNDLE_FIELDS, before=before, limit=limit + 1
        )
        more = len(rows) > limit
        bundles = rows[len(rows) - limit :] if more else rows  # oldest first
        ids = [b.id for b in bundles]
        low = ids[0] if ids else (before or 0)
        live = repository.live_branch_from(session, head_id=run.head_bundle_id, low=low)
        in_page = set(ids)
        return _lineage(
            run,
            bundles=bundles,
            live=[i for i in live if before is None or i < before],
            start=lineage.resumable(run.head_bundle_id, catalog_nodes(session)),
            attempts=repository.page_attempts(
                session,
                run_id=run.id,
                attempt_ids={b.attempt_id for b in bundles if b.attempt_id is not None},
                bundle_ids=ids,
            ),
            lost=lineage.steps_lost_by_attempt(repository.attempt_nodes(session, run_id=run.id)),
            rollbacks=[
                r
                for r in repository.run_rollbacks(session, run_id=run.id)
                if r.to_bundle_id in in_page or r.from_bundle_id in in_page
            ],
            forks=repository.forks_among(session, run_id=run.id, parent_ids=ids),
            next_before=ids[0] if more else None,
        )


def _lineage(
    run: Run,
    *,
    bundles: list[Row[Any]],
    live: list[int],
    start: Node | None,
    attempts: list[Attempt],
    lost: Mapping[int, int | None],
    rollbacks: list[Rollback],
    forks: list[int],
    next_before: int | None = None,
) -> Lineage:
    """The lineage (or a page of it) from the rows it is made of."""
    on_live_branch = set(live)
    return Lineage(
        run=run.name,
        epoch=run.epoch,
        head_id=run.head_bundle_id,
        resumable_id=start.id if start else None,
        live_branch=live,
        attempts=[attempt_out(a, run, steps_lost=lost[a.id]) for a in attempts],
        bundles=[LineageBundle(**b._mapping, live=b.id in on_live_branch) for b in bundles],
        parent_edges=[Edge(parent=b.parent_id, child=b.id) for b in bundles if b.parent_id],
        resume_edges=[
            ResumeEdge(bundle=a.resumed_from_id, attempt=a.id)
            for a in attempts
            if a.resumed_from_id is not None
        ],
        rollbacks=[
            RollbackEvent(
                from_bundle_id=r.from_bundle_id,
                to_bundle_id=r.to_bundle_id,
                epoch=r.epoch,
                created_at=r.created_at,
            )
            for r in rollbacks
        ],
        forks=forks,
        next_before=next_before,
    )


# Shared with the attempts and bundles services.


_NODE_COLUMNS = (Bundle.step, Bundle.status, Bundle.parent_id, Bundle.attempt_id)


def node(bundle: Bundle | Row[Any]) -> Node:
    return Node(
        id=bundle.id,
        step=bundle.step,
        status=bundle.status,
        parent_id=bundle.parent_id,
        attempt_id=bundle.attempt_id,
    )


def catalog_nodes(session: Session) -> Callable[[int], Node | None]:
    """Look bundles up one by one (the session caches them): walks from the head read only
    the bundles they pass, not the whole run, and of those only what a node holds (not the
    manifest: a commit of 1,000 blobs spent 13% of its time decoding the head's)."""
    options = [load_only(*_NODE_COLUMNS)]

    def lookup(bundle_id: int) -> Node | None:
        bundle = session.get(Bundle, bundle_id, options=options)
        return node(bundle) if bundle else None

    return lookup


_NO_MANIFEST = [defer(Bundle.manifest)]


def resumable_bundle(session: Session, run: Run, *, head: Bundle | None = None) -> Bundle | None:
    """The newest complete bundle of the run's live branch (the walk loads each bundle it
    passes once, but its manifest, read when asked for: ``head``, when the caller read it
    already, is not read again)."""
    passed = {head.id: head} if head else {}

    def lookup(bundle_id: int) -> Node | None:
        bundle = passed.get(bundle_id) or session.get(Bundle, bundle_id, options=_NO_MANIFEST)
        if bundle is None:
            return None
        passed[bundle_id] = bundle  # held: the session's identity map holds it weakly
        return node(bundle)

    found = lineage.resumable(run.head_bundle_id, lookup)
    return passed[found.id] if found else None


def run_out(session: Session, run: Run) -> RunOut:
    return run_outs(session, [run])[0]


def run_outs(session: Session, runs: Sequence[Run]) -> list[RunOut]:
    """The runs as the API shows them: a constant number of queries however many (a page
    of runs costs what one run does)."""
    figures = run_figures(session, run_ids=[run.id for run in runs])
    return [_run_out(run, figures[run.id]) for run in runs]


def _run_out(run: Run, figures: RunFigures) -> RunOut:
    head, start = figures.head, figures.resumable
    return RunOut(
        name=run.name,
        created_at=run.created_at,
        epoch=run.epoch,
        head=BundleRef(id=head.id, step=head.step, status=head.status) if head else None,
        resumable=BundleRef(id=start.id, step=start.step, status=start.status) if start else None,
        keep_last=run.keep_last,
        keep_every=run.keep_every,
        dedup_group=run.dedup_group,
        num_bundles=figures.bundles,
        steps_lost_total=figures.steps_lost,
        steps_lost_total_exact=figures.steps_lost_exact,
    )


def attempt_out(attempt: Attempt, run: Run, *, steps_lost: int | None) -> AttemptOut:
    return AttemptOut(
        id=attempt.id,
        run=run.name,
        epoch=attempt.epoch,
        pod=attempt.pod,
        node=attempt.node,
        started_at=attempt.started_at,
        heartbeat_at=attempt.heartbeat_at,
        last_step=attempt.last_step,
        ended_at=attempt.ended_at,
        end_reason=attempt.end_reason,
        final_save_committed=attempt.final_save_committed,
        resumed_from_id=attempt.resumed_from_id,
        fenced=attempt.epoch != run.epoch,
        state=lineage.attempt_state(attempt.end_reason, fenced=attempt.epoch != run.epoch),
        steps_lost=steps_lost,
        steps_lost_exact=None
        if steps_lost is None
        else lineage.steps_lost_exact(attempt.end_reason),
        notice_at=attempt.notice_at,
        notice=attempt.notice,
        pool=attempt.pool,
        interval_seconds=attempt.interval_seconds,
        waste_seconds_per_hour=attempt.waste_seconds_per_hour,
        time=time_out(time_spent(attempt, steps_lost=steps_lost)),
        verification=Verification.model_validate(attempt.verification)
        if attempt.verification
        else None,
    )


def attempt_node(attempt: Attempt, step_of: Callable[[int], int | None]) -> AttemptNode:
    """The attempt as the steps-lost rule sees it; ``step_of`` gives a bundle's step."""
    resumed = attempt.resumed_from_id
    return AttemptNode(
        id=attempt.id,
        epoch=attempt.epoch,
        last_step=attempt.last_step,
        end_reason=attempt.end_reason,
        resumed_step=step_of(resumed) if resumed is not None else None,
    )


def resume_json(session: Session, bundle: Bundle | None, *, manifest: str | None = None) -> str:
    """What an attempt resumes from, as the JSON of a ``ResumePoint`` (``null``: it starts
    fresh), its manifest as the catalog holds it (``manifest``, when the caller read it):
    checked when its bundle committed, and the client checks it again. Parsed, checked and
    written out again, a 64-rank job's manifest (8 MB, 77,000 tensors) held the GIL for
    0.7 s of every registration and ``/resumable`` (docs/performance.md)."""
    if bundle is None:
        return "null"
    if manifest is None:
        manifest = repository.manifest_text(session, bundle_id=bundle.id)
    assert manifest is not None, "a complete bundle has a manifest"
    position = f'"bundle_id":{bundle.id},"step":{bundle.step},"micro_step":{bundle.micro_step}'
    return f'{{{position},"manifest":{manifest}}}'


def _run(session: Session, name: str, *, lock: Lock = Lock.NONE) -> Run:
    run = repository.get_run(session, name=name, lock=lock)
    if run is None:
        raise NotFoundError(f"no run named {name!r}")
    return run


def _ref(bundle: Bundle) -> BundleRef:
    return BundleRef(id=bundle.id, step=bundle.step, status=bundle.status)


# A lineage bundle's columns: all it shows but ``live``, which the walk from the head says.
BUNDLE_FIELDS = [name for name in LineageBundle.model_fields if name != "live"]
