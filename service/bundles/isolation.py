"""Run isolation: which blobs a run token may count on without writing them.

A run token learns about, and may reference without writing, only the blobs that its own
run, or a run of its dedup group (``run.dedup_group``, set by an admin), has *committed*:
blobs referenced by a layer of a bundle of the group that became complete (complete,
quarantined since, or deleted by retention). ``/v1/blobs/missing`` reports every other blob
missing, whether the store holds it or not, so the agent uploads it.

A commit by a run token that references a blob the group never committed must find it
written since the bundle was opened: the store object's modification time (a file's mtime,
S3's LastModified) is at most ``CLOCK_SLACK`` before the bundle's creation. Only a write
proves that the run holds the bytes; re-reading and hashing the blob would prove only that
the store holds them, which is what another run's blob does. Ownership therefore only
grows through commits that passed this check (or an admin's). Admin and read tokens are
not limited.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from service.auth.principal import Principal
from service.bundles import repository
from service.models import BundleStatus, Role, Run
from service.runs import repository as runs_repository

# Timestamps of the store and of the control plane may disagree a little: S3 keeps whole
# seconds, filesystems may round, clocks drift within what NTP allows.
CLOCK_SLACK = timedelta(seconds=5)

# Bundles whose commit proved (or an admin vouched) that the run held their blobs.
COMMITTED = (BundleStatus.COMPLETE, BundleStatus.QUARANTINED, BundleStatus.DELETED)


def limited(principal: Principal) -> bool:
    """Whether run isolation applies to this caller: run tokens only."""
    return principal.role is Role.RUN


def owned(session: Session, run: Run, *, shas: Collection[str]) -> set[str]:
    """Those of ``shas`` that ``run`` or a run of its dedup group has committed."""
    run_ids = runs_repository.group_run_ids(session, run=run)
    return repository.referenced_by_runs(session, run_ids=run_ids, shas=shas, statuses=COMMITTED)


def written_since(modified: float, opened_at: datetime) -> bool:
    """Whether an object last written at ``modified`` (epoch seconds, the store's clock) was
    written after a bundle opened at ``opened_at``, give or take ``CLOCK_SLACK``."""
    return modified >= (opened_at - CLOCK_SLACK).timestamp()
