"""Roll forward: a new attempt commits the bundle its dead predecessor wrote but never
committed, before it chooses where to resume.

A trainer killed after every rank recorded its layers (so every blob is in the store) but
before its commit leaves a pending bundle that is whole. When the next attempt registers to
resume, the control plane commits that bundle first, under the predecessor's own epoch, by
the commit's full check (every rank's layers recorded, every blob in the store with its
size, and its SHA-256 where the store kept one): nothing is committed that the predecessor
could not have committed itself. Only the newest attempt's bundles qualify (an older one was
fenced by it, or by a rollback that chose an older head on purpose), and only one newer than
the run's head. The bundle stays the predecessor's; its ``committed`` event says who
committed it and why.
"""

from __future__ import annotations

import logging

from service.auth.principal import Principal
from service.bundles import repository as bundles_repository
from service.bundles.commit import commit_bundle
from service.bundles.schemas import Commit
from service.context import Context
from service.errors import ServiceError
from service.models import BundleStatus
from service.runs import repository
from service.runs.service import resumable_bundle

log = logging.getLogger("ckpt.runs")


def roll_forward(context: Context, principal: Principal, *, name: str) -> int | None:
    """Commit the newest attempt's newest pending bundle when it is whole and newer than the
    resumable bundle; the bundle's id, or None when there is none or it is not whole."""
    with context.transaction() as session:
        run = repository.get_run(session, name=name)
        if run is None:
            return None
        predecessor = repository.last_attempt(session, run_id=run.id)
        if predecessor is None or predecessor.epoch != run.epoch:
            return None  # fenced since (a rollback): its bundles are not the run's to keep
        pending = bundles_repository.latest_of_attempt(
            session, attempt_id=predecessor.id, statuses=[BundleStatus.PENDING]
        )
        start = resumable_bundle(session, run)
        if pending is None or (
            start is not None
            and (pending.step, pending.micro_step) <= (start.step, start.micro_step)
        ):
            return None
        bundle_id, attempt_id, epoch = pending.id, predecessor.id, predecessor.epoch
    reason = (
        f"rolled forward: attempt {attempt_id} wrote it whole but never committed it; "
        "committed when the next attempt registered"
    )
    try:
        commit_bundle(
            context, principal, bundle_id=bundle_id, request=Commit(epoch=epoch), reason=reason
        )
    except ServiceError as err:
        log.info("run %s: bundle %d is not rolled forward: %s", name, bundle_id, err)
        return None
    log.info("run %s: bundle %d of attempt %d rolled forward", name, bundle_id, attempt_id)
    return bundle_id
