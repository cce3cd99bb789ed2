"""Blob health: a blob found absent or damaged (by the scrubber, a restore, a commit) is
marked in the catalog, and every complete bundle that uses it, of any run, is quarantined
in the same transaction, each with the reason and an audit event. A damaged blob is never
held (``/v1/blobs/missing`` reports it, so the next save writes it again); the commit that
finds it whole again clears the damage.

Lock order: the blobs' rows (in hash order, as claims and commits take them), then the
bundles' (in id order). A commit holds its blobs' rows while it decides, so a blob marked
damaged either waits for that commit (and then quarantines its bundle) or is seen damaged
by it (which then reads the blob again).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime

from sqlalchemy.orm import Session

from service.bundles import repository
from service.completeness import BlobProblem
from service.events import service as events
from service.events.schemas import Action
from service.models import Blob, Bundle, BundleStatus, utcnow

log = logging.getLogger("ckpt.service")

_PHRASES = {
    BlobProblem.ABSENT: "is absent from the store",
    BlobProblem.WRONG_SIZE: "has the wrong size in the store",
    BlobProblem.WRONG_HASH: "does not match its SHA-256 in the store",
}


def trusted(blob: Blob | repository.Health) -> bool:
    """Whether the service found the blob whole (a commit, a read-back) and has not found it
    damaged since."""
    return blob.verified_at is not None and blob.damaged_at is None


def found_since(blobs: Iterable[repository.Health], moment: datetime) -> bool:
    """Whether any of these blobs was found damaged at or after ``moment`` (a read of the
    store that began then may have seen it whole just before)."""
    return any(blob.damaged_at is not None and blob.damaged_at >= moment for blob in blobs)


def _verified_since(blob: repository.Health, moment: datetime) -> bool:
    return blob.verified_at is not None and blob.verified_at >= moment


def describe(sha: str, problem: BlobProblem) -> str:
    """One blob's damage, in words."""
    return f"blob {sha} {_PHRASES.get(problem, problem.value)}"


def mark_damaged(
    session: Session,
    found: Mapping[str, BlobProblem],
    *,
    read_at: datetime,
    actor: str,
    found_by: str,
) -> list[Bundle]:
    """Mark these blobs damaged and quarantine every complete bundle using one; returns
    those bundles. ``found_by`` says how the damage was found (the reason names it).

    ``read_at``: when the read that found the damage began. A blob a commit read back intact
    since then was written again meanwhile (a save that found it missing): it is not marked.
    """
    rows = repository.lock_blobs(session, shas=found)
    damaged = {
        sha: problem
        for sha, problem in found.items()
        if sha not in rows or not _verified_since(rows[sha], read_at)
    }
    if not damaged:
        return []
    repository.mark_damaged(
        session, damage={sha: str(problem) for sha, problem in damaged.items()}, at=utcnow()
    )
    uses: dict[int, list[str]] = {}
    bundles: dict[int, Bundle] = {}
    for bundle, sha in repository.complete_users(session, shas=damaged):
        uses.setdefault(bundle.id, []).append(sha)
        bundles[bundle.id] = bundle
    for bundle_id, shas in uses.items():
        reason = "; ".join(describe(sha, damaged[sha]) for sha in shas) + f" ({found_by})"
        set_aside(session, bundles[bundle_id], actor=actor, reason=reason)
    return list(bundles.values())


def set_aside(session: Session, bundle: Bundle, *, actor: str, reason: str) -> None:
    """Quarantine a complete bundle: never resumable again (until an admin lifts it)."""
    assert bundle.status == BundleStatus.COMPLETE, "only a complete bundle is quarantined"
    bundle.status = BundleStatus.QUARANTINED
    bundle.reason = reason
    events.record(session, bundle, actor=actor, action=Action.QUARANTINED, reason=reason)
    log.error(
        "bundle %d (run id %d, step %d) quarantined by %s: %s",
        bundle.id,
        bundle.run_id,
        bundle.step,
        actor,
        reason,
    )
