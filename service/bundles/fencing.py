"""Who may write to a bundle: the bundle, its run and attempt loaded in lock order and
authorized for writing, and the epoch fence that turns away every attempt but the run's
current one."""

from __future__ import annotations

import functools

from sqlalchemy import Select, bindparam, select
from sqlalchemy.orm import Session

from service.auth.principal import Principal
from service.auth.service import require_write
from service.context import Context
from service.errors import FencedError, NotFoundError
from service.models import Attempt, Bundle, Role, Run
from service.sql import Lock, locked_of


def for_write(
    session: Session,
    principal: Principal,
    bundle_id: int,
    *,
    lock: Lock,
    bundle_lock: Lock | None = None,
) -> tuple[Bundle, Run, Attempt | None]:
    """The bundle, its run and attempt, authorized for writing; rows locked run first (the
    bundle with ``bundle_lock`` when given, else ``lock``). One statement: it was four (the
    bundle, its run locked, the bundle locked, the attempt), a fifth of a record's CPU."""
    found = session.execute(
        _bundle_to_write(lock, bundle_lock or lock), {"bundle_id": bundle_id}
    ).first()
    if found is None:
        raise NotFoundError(f"no bundle with id {bundle_id}")
    run, bundle, attempt = found
    require_write(principal, run.name)
    return bundle, run, attempt


# Built once per pair of locks (building one costs more CPU than running it). The run is
# locked first, as every write locks (first in the FROM list and the FOR clauses; SQLite has
# no row locks: BEGIN IMMEDIATE). The attempt is read, not locked.
@functools.cache
def _bundle_to_write(lock: Lock, bundle_lock: Lock) -> Select[Run, Bundle, Attempt]:
    statement = (
        select(Run, Bundle, Attempt)
        .select_from(Run)
        .join(Bundle, Bundle.run_id == Run.id)
        .outerjoin(Attempt, Attempt.id == Bundle.attempt_id)
        .where(Bundle.id == bindparam("bundle_id"))
    )
    clauses = locked_of((lock, Run), (bundle_lock, Bundle))
    return statement.suffix_with(clauses, dialect="postgresql") if clauses else statement


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
