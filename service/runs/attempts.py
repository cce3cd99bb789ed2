"""Attempts of a run, from registration to their end: registration (with fencing and the
resume decision), heartbeats, the end report, marking silent attempts lost, and counting
the steps each ended attempt lost."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ckpt.core.goodput import redo_seconds
from service import lineage
from service.auth.principal import Principal
from service.auth.service import Bearer, require_write
from service.bulk import with_json
from service.context import Context
from service.errors import ConflictError, FencedError, InvalidRequestError, NotFoundError
from service.metrics import Metrics
from service.models import Attempt, Bundle, EndReason, Role, Run, utcnow
from service.runs import beats, fingerprints, repository
from service.runs.activity import beat_activity, refresh_activity
from service.runs.roll_forward import roll_forward
from service.runs.schemas import (
    AttemptCreate,
    AttemptEnd,
    AttemptNotice,
    AttemptOut,
    AttemptRegistered,
    AttemptTime,
    Heartbeat,
)
from service.runs.service import attempt_node, attempt_out, resumable_bundle, resume_json

log = logging.getLogger("ckpt.runs")


def register_attempt(
    context: Context, principal: Principal, *, name: str, request: AttemptCreate
) -> str:
    """Register a new attempt of the run (creating the run if need be) and decide what it
    resumes from. Its epoch fences every older attempt. Returns the JSON of an
    ``AttemptRegistered`` (``resume_from``: ``runs.service.resume_json``)."""
    require_write(principal, name)
    if request.resume:
        roll_forward(context, principal, name=name)
    with context.transaction() as session:
        run, _ = repository.ensure_run(session, name=name)
        run.epoch += 1
        start = resumable_bundle(session, run) if request.resume else None
        previous = repository.last_attempt(session, run_id=run.id)
        attempt = repository.add_attempt(
            session,
            run=run,
            pod=request.pod,
            node=request.node,
            pool=request.pool,
            resumed_from_id=start.id if start else None,
        )
        refresh_activity(session, run_ids=[run.id])
        context.metrics.attempts.inc()
        if previous is not None:  # an ended predecessor's steps lost are known now
            _count_steps_lost(
                context.metrics, previous, before=None, after=_steps_lost(session, previous)
            )
        registered = AttemptRegistered(
            attempt_id=attempt.id,
            run=run.name,
            epoch=attempt.epoch,
            resume_from=None,
            store=context.store.url,
        )
        return with_json(registered, resume_from=resume_json(session, start))


def heartbeat(context: Context, token: Bearer, *, attempt_id: int, beat: Heartbeat) -> AttemptOut:
    """Record a heartbeat of one rank. A plain one (an attempt training unfenced, a step
    within reach, no fingerprints) is one statement on PostgreSQL (``beats.beat_at_once``),
    which checks the token too unless the token cache holds it; any other, or one that
    statement's checks turn away, takes the full path, which says why."""
    changes = _beat_changes(beat)
    principal = token.cached()
    at_once = _beat_at_once(
        context, token, principal, attempt_id=attempt_id, beat=beat, changes=changes
    )
    if at_once is not None:
        return at_once
    principal = principal or token.read()
    with context.transaction() as session:
        attempt, run, start = locked_attempt(session, principal, attempt_id, to_beat=True)
        check_unfenced(attempt, run)
        if beat.step is not None:
            _check_advance(attempt, beat.step, start=start, limit=context.settings.max_step_advance)
        _apply_beat(context.metrics, attempt, beat, changes)
        if beat.fingerprints:
            fingerprints.keep(
                session,
                attempt_id=attempt.id,
                rank=beat.rank,
                rows=[f.model_dump() for f in beat.fingerprints],
                ring=context.settings.fingerprint_ring,
            )
        lost_after = timedelta(seconds=context.settings.lost_after_seconds)
        silent_since = changes["heartbeat_at"] - lost_after
        if attempt.end_reason == EndReason.LOST and not repository.rank_silent(
            session, attempt_id=attempt.id, silent_since=silent_since, beating=beat.rank
        ):  # it was alive after all (a partition), every rank of it
            attempt.ended_at = attempt.end_reason = None
        # Not fenced: the run's newest attempt, and no successor has registered, so nothing
        # is lost yet.
        beat_activity(session, attempt, start=start, rank=beat.rank)
        return attempt_out(attempt, run, steps_lost=None)


def _beat_at_once(
    context: Context,
    token: Bearer,
    principal: Principal | None,
    *,
    attempt_id: int,
    beat: Heartbeat,
    changes: dict[str, Any],
) -> AttemptOut | None:
    """The heartbeat in one statement (``beats.beat_at_once``), if it is plain, by a
    token that may write (``principal``; None: a token the statement checks), on
    PostgreSQL, and its checks pass; else None, nothing written."""
    if beat.fingerprints or context.engine.dialect.name != "postgresql":
        return None
    token_hash = writer = None
    if principal is None:
        token_hash = token.token_hash
    elif principal.role is Role.RUN and principal.run:
        writer = principal.run
    elif principal.role is not Role.ADMIN:
        return None
    read_at = time.monotonic()  # of the token, when the statement checks it
    with context.read() as session:  # autocommit: the statement is its own transaction
        found = beats.beat_at_once(
            session,
            attempt_id=attempt_id,
            writer=writer,
            token_hash=token_hash,
            changes=changes,
            rank=beat.rank,
            advance_limit=context.settings.max_step_advance,
        )
    if found is None:
        return None
    run, attempt, token_row = found
    if token_row is not None:
        token.remember(token_row, read_at=read_at)
    _apply_beat(context.metrics, attempt, beat, changes)
    return attempt_out(attempt, run, steps_lost=None)


def _beat_changes(beat: Heartbeat) -> dict[str, Any]:
    """The attempt's columns a heartbeat sets, to what."""
    changes: dict[str, Any] = {"heartbeat_at": utcnow()}
    if beat.step is not None:
        changes["last_step"] = beat.step
    if beat.time is not None:
        changes |= _time_columns(beat.time)
    if beat.interval_seconds is not None:
        changes["interval_seconds"] = beat.interval_seconds
        changes["waste_seconds_per_hour"] = beat.waste_seconds_per_hour
    return changes


def _apply_beat(
    metrics: Metrics, attempt: Attempt, beat: Heartbeat, changes: dict[str, Any]
) -> None:
    """Set a heartbeat's ``changes`` on the attempt as it was, counting the time they add."""
    if beat.time is not None:
        _count_time(metrics, attempt, beat.time)
    for name, value in changes.items():
        setattr(attempt, name, value)


def end_attempt(
    context: Context, principal: Principal, *, attempt_id: int, end: AttemptEnd
) -> AttemptOut:
    """Record how an attempt ended (accepted from fenced attempts too: it is history). An
    attempt marked lost that reports its end was alive after all: its report replaces the
    verdict."""
    with context.transaction() as session:
        attempt, run, start = locked_attempt(session, principal, attempt_id)
        if attempt.ended_at is not None and attempt.end_reason != EndReason.LOST:
            if attempt.end_reason == end.reason:
                return attempt_out(attempt, run, steps_lost=_steps_lost(session, attempt))
            raise ConflictError(f"attempt {attempt_id} already ended ({attempt.end_reason})")
        if end.step is not None:
            _check_advance(attempt, end.step, start=start, limit=context.settings.max_step_advance)
        before = _steps_lost(session, attempt)
        attempt.ended_at = utcnow()
        attempt.end_reason = end.reason
        attempt.final_save_committed = end.final_save_committed or (
            end.reason == "finished" and _newest_committed(session, attempt)
        )
        if end.time is not None:
            _account(context.metrics, attempt, end.time)
        if end.step is not None:
            attempt.last_step = end.step
        after = _steps_lost(session, attempt)
        refresh_activity(session, run_ids=[run.id])
        _count_steps_lost(context.metrics, attempt, before=before, after=after)
        return attempt_out(attempt, run, steps_lost=after)


def notice(
    context: Context, principal: Principal, *, attempt_id: int, notice: AttemptNotice
) -> AttemptOut:
    """Record the first notice of a coming preemption the attempt read (accepted after the
    attempt was fenced or ended too: it is history); a later one is logged, not kept."""
    text = f"{notice.cloud} {notice.kind}" + (f": {notice.detail}" if notice.detail else "")
    with context.transaction() as session:
        attempt, run, start = locked_attempt(session, principal, attempt_id)
        if notice.step is not None and attempt.ended_at is None:
            limit = context.settings.max_step_advance
            _check_advance(attempt, notice.step, start=start, limit=limit)
            attempt.last_step = max(attempt.last_step or 0, notice.step)
        first = attempt.notice_at is None
        if first:
            attempt.notice_at, attempt.notice = utcnow(), text
            context.metrics.notices.labels(cloud=notice.cloud, kind=notice.kind).inc()
        out = attempt_out(attempt, run, steps_lost=_steps_lost(session, attempt))
    log.warning(
        "run %s: attempt %d (epoch %d) reports %s notice: %s",
        run.name,
        attempt.id,
        attempt.epoch,
        "a" if first else "another",
        text,
    )
    return out


def mark_lost(context: Context, *, now: datetime | None = None) -> list[int]:
    """End as lost every attempt that has not ended and whose last heartbeat (or, without
    one, its registration), or the last heartbeat of any of its ranks, is older than
    ``lost_after_seconds`` at ``now``; one transaction.
    Returns their ids. The server runs it periodically; tests pass a ``now`` of their own.
    """
    now = now or utcnow()
    silent_since = now - timedelta(seconds=context.settings.lost_after_seconds)
    with context.transaction() as session:
        lost = repository.mark_lost(session, silent_since=silent_since, now=now)
        steps = [_steps_lost(session, attempt) for attempt in lost]
    context.metrics.attempts_lost.inc(len(lost))
    for attempt, lost_steps in zip(lost, steps, strict=True):
        _count_steps_lost(context.metrics, attempt, before=None, after=lost_steps)
        log.warning(
            "attempt %d (run %d, epoch %d) is lost: no heartbeat for %.0f s (last step %s)",
            attempt.id,
            attempt.run_id,
            attempt.epoch,
            context.settings.lost_after_seconds,
            attempt.last_step,
        )
    return [attempt.id for attempt in lost]


def locked_attempt(
    session: Session, principal: Principal, attempt_id: int, *, to_beat: bool = False
) -> tuple[Attempt, Run, int]:
    """The attempt locked for a change, its run share-locked (the run first, as every other
    write locks), and the step it resumed from (0: it started fresh). One statement. With
    ``to_beat``, read into no session (``beats.get_attempt_to_beat``)."""
    get = beats.get_attempt_to_beat if to_beat else repository.get_attempt_to_change
    found = get(session, attempt_id=attempt_id)
    if found is None:
        raise NotFoundError(f"no attempt with id {attempt_id}")
    run, attempt, start = found
    require_write(principal, run.name)
    return attempt, run, start


def check_unfenced(attempt: Attempt, run: Run) -> None:
    """Refuse a write of a fenced attempt: a newer one registered, or the run rolled back."""
    if attempt.epoch != run.epoch:
        raise FencedError(
            f"attempt {attempt.id} (epoch {attempt.epoch}) is fenced: run {run.name!r} is at "
            f"epoch {run.epoch}; stop writing and exit",
            run_epoch=run.epoch,
        )


def _check_advance(attempt: Attempt, step: int, *, start: int, limit: int) -> None:
    """A reported step at most ``limit`` ahead of what the attempt is known to have reached:
    its last reported step, else the step it resumed from (``start``), else 0. Steps feed
    counters (steps lost), so a typo or a hostile client must not inflate them."""
    known = max(attempt.last_step or 0, start)
    if step > known + limit:
        raise InvalidRequestError(
            f"step {step} is more than {limit} steps (CKPT_MAX_STEP_ADVANCE) ahead of step "
            f"{known}, the last this attempt reported or resumed from: report the step "
            "training has reached, at least every CKPT_MAX_STEP_ADVANCE steps"
        )


def _newest_committed(session: Session, attempt: Attempt) -> bool:
    """Whether the attempt's newest bundle committed: a finished attempt's final save
    (``Checkpointer.end("finished")`` waits for the save in flight but reports no flag of
    its own, so a finished attempt read "not committed" beside a committed bundle). A
    preempted attempt's flag is its agent's: whether the save after the signal committed."""
    newest = session.scalar(
        select(Bundle.committed_at)
        .where(Bundle.attempt_id == attempt.id)
        .order_by(Bundle.step.desc())
        .limit(1)
    )
    return newest is not None


def _steps_lost(session: Session, attempt: Attempt) -> int | None:
    """The attempt's steps lost, as the catalog stands in this transaction."""
    successor = repository.next_attempt(session, run_id=attempt.run_id, epoch=attempt.epoch)

    def step_of(bundle_id: int) -> int | None:
        bundle = session.get(Bundle, bundle_id)
        return bundle.step if bundle else None

    return lineage.steps_lost(
        attempt_node(attempt, step_of),
        attempt_node(successor, step_of) if successor else None,
    )


PARTS = ("restart", "stall", "train")  # an attempt's time figures: <part>_seconds


def _account(metrics: Metrics, attempt: Attempt, time: AttemptTime) -> None:
    """Keep the attempt's latest time figures; count what they add in the metrics."""
    _count_time(metrics, attempt, time)
    for name, value in _time_columns(time).items():
        setattr(attempt, name, value)


def _time_columns(time: AttemptTime) -> dict[str, Any]:
    """The attempt's columns that keep its time figures, set to ``time``'s."""
    columns: dict[str, Any] = {
        f"{part}_seconds": getattr(time, f"{part}_seconds") for part in PARTS
    }
    return columns | {"steps_trained": time.steps_trained}


def _count_time(metrics: Metrics, attempt: Attempt, time: AttemptTime) -> None:
    """Count in the metrics what the attempt's new time figures add to those it has."""
    for part in PARTS:
        now = getattr(time, f"{part}_seconds")
        before = getattr(attempt, f"{part}_seconds") or 0.0
        if now > before:
            metrics.attempt_seconds.labels(part=part).inc(now - before)


def _count_steps_lost(
    metrics: Metrics, attempt: Attempt, *, before: int | None, after: int | None
) -> None:
    """Count what a change made newly known (a lost attempt that reports its end may have
    reported a later step): the steps lost, and the time they took."""
    if after is not None and after > (before or 0):
        metrics.steps_lost.inc(after - (before or 0))
        train, trained = attempt.train_seconds or 0.0, attempt.steps_trained or 0
        redo = redo_seconds(train_seconds=train, steps_trained=trained, steps_lost=after)
        redo -= redo_seconds(train_seconds=train, steps_trained=trained, steps_lost=before)
        if redo > 0:
            metrics.attempt_seconds.labels(part="redo").inc(redo)
