"""Resumes that prove themselves: the replay (what the attempt before this one computed at
the positions this one trains again, from the fingerprints its ranks sent with their
heartbeats) and the verdict the resumed attempt reports on it."""

from __future__ import annotations

import logging

from service.auth.principal import Principal
from service.auth.service import require_read
from service.context import Context
from service.errors import InvalidRequestError, NotFoundError
from service.models import Attempt
from service.runs import fingerprints, repository
from service.runs.attempts import check_unfenced, locked_attempt
from service.runs.schemas import AttemptOut, Fingerprint, Replay, Verification
from service.runs.service import attempt_out

log = logging.getLogger("ckpt.runs")


def replay(
    context: Context, principal: Principal, *, attempt_id: int, rank: int, after: tuple[int, int]
) -> Replay:
    """Rank ``rank``'s fingerprints after the position ``after`` from the newest earlier
    attempt of the run that has any there; none: an empty replay."""
    with context.transaction() as session:
        attempt = repository.get_attempt(session, attempt_id=attempt_id)
        if attempt is None:
            raise NotFoundError(f"no attempt with id {attempt_id}")
        run = repository.get_run_by_id(session, run_id=attempt.run_id)
        require_read(principal, run.name)
        source = fingerprints.replay_source(
            session, run_id=run.id, before_epoch=attempt.epoch, rank=rank, after=after
        )
        if source is None:
            return Replay(from_attempt_id=None, fingerprints=[])
        found = fingerprints.after(session, attempt_id=source, rank=rank, start=after)
        return Replay(
            from_attempt_id=source,
            fingerprints=[
                Fingerprint(step=f.step, micro_step=f.micro_step, loss=f.loss, parts=f.parts)
                for f in found
            ],
        )


def verify(
    context: Context, principal: Principal, *, attempt_id: int, verification: Verification
) -> AttemptOut:
    """Record the attempt's verdict on its resume (a second report replaces the first);
    counted, and logged (a divergence loudly), at the first."""
    with context.transaction() as session:
        attempt, run, _ = locked_attempt(session, principal, attempt_id)
        check_unfenced(attempt, run)
        source = verification.from_attempt_id
        if source is not None:
            earlier = session.get(Attempt, source)
            if earlier is None or earlier.run_id != run.id or earlier.epoch >= attempt.epoch:
                raise InvalidRequestError(
                    f"from_attempt_id {source} is not an earlier attempt of run {run.name!r}: "
                    "send the from_attempt_id the replay answered"
                )
        first = attempt.verification is None
        attempt.verification = verification.model_dump(mode="json")
        # Not fenced, so no successor has registered: nothing is lost yet.
        out = attempt_out(attempt, run, steps_lost=None)
    if first:
        context.metrics.resume_verifications.labels(verdict=verification.verdict).inc()
        _log(run.name, attempt_id, verification)
    return out


def _log(run: str, attempt_id: int, verification: Verification) -> None:
    difference = verification.first_difference
    if difference is not None:
        log.warning(
            "run %s: attempt %d's resume diverged at step %d (micro step %d, rank %d): %s "
            "%s vs %s. %s",
            run,
            attempt_id,
            difference.step,
            difference.micro_step,
            difference.rank,
            difference.part,
            difference.got,
            difference.expected,
            verification.detail,
        )
    else:
        log.info(
            "run %s: attempt %d's resume is %s over %d steps",
            run,
            attempt_id,
            verification.verdict,
            verification.steps_compared,
        )
