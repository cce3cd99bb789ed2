"""Who may write to a bundle: the bundle, its run and attempt loaded in lock order and
authorized for writing, and the epoch fence that turns away every attempt but the run's
current one."""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.auth.principal import Principal
from service.auth.service import require_write
from service.bundles import repository
from service.context import Context
from service.errors import FencedError, NotFoundError
from service.models import Attempt, Bundle, Role, Run
from service.runs import repository as runs_repository
from service.sql import Lock


def for_write(
    session: Session,
    principal: Principal,
    bundle_id: int,
    *,
    lock: Lock,
    bundle_lock: Lock | None = None,
) -> tuple[Bundle, Run, Attempt | None]:
    """The bundle, its run and attempt, authorized for writing; rows locked run first (the
    bundle with ``bundle_lock`` when given, else ``lock``)."""
    found = repository.get_bundle(session, bundle_id=bundle_id)
    if found is None:
        raise NotFoundError(f"no bundle with id {bundle_id}")
    run = runs_repository.get_run_by_id(session, run_id=found.run_id, lock=lock)
    require_write(principal, run.name)
    bundle = repository.get_bundle(session, bundle_id=bundle_id, lock=bundle_lock or lock)
    assert bundle is not None
    attempt = (
        runs_repository.get_attempt(session, attempt_id=bundle.attempt_id)
        if bundle.attempt_id is not None
        else None
    )
    return bundle, run, attempt


def check_epoch(context: Context, run: Run, *, attempt: Attempt | None, claimed: int) -> None:
    """Fencing: only the run's current attempt, naming its own epoch, may write."""
    if attempt is not None and attempt.epoch == run.epoch == claimed:
        return
    context.metrics.fenced.inc()
    raise FencedError(
        f"epoch {claimed} is fenced: run {run.name!r} is at epoch {run.epoch} (a newer attempt "
        "registered, or the run was rolled back). Stop writing; this attempt's saves cannot "
        "move the run's head.",
        run_epoch=run.epoch,
    )


def check_run_epoch(
    context: Context, principal: Principal, run: Run, *, claimed: int | None
) -> None:
    """Fencing for a write that names no attempt of its own (a quarantine): a run token must
    send the run's current epoch; an admin is never fenced."""
    if principal.role is Role.ADMIN or (claimed is not None and claimed == run.epoch):
        return
    context.metrics.fenced.inc()
    sent = "no epoch" if claimed is None else f"epoch {claimed}"
    raise FencedError(
        f"{sent} is fenced: run {run.name!r} is at epoch {run.epoch}. Only the run's current "
        "attempt, sending its epoch, may quarantine its bundles",
        run_epoch=run.epoch,
    )
