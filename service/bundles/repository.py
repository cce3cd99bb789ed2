from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import and_, bindparam, or_, select, text, update
from sqlalchemy.orm import Session

from service.models import (
    Blob,
    Bundle,
    BundleStatus,
    Layer,
    LayerBlob,
    RunActivity,
    Save,
    UTCDateTime,
    utcnow,
)
from service.sql import Lock, ids_in, insert, locked, one_of, plain_words

# Rows per statement: Postgres takes at most 65535 bind parameters per query.
BATCH = 1000
T = TypeVar("T")


def get_bundle(session: Session, *, bundle_id: int, lock: Lock = Lock.NONE) -> Bundle | None:
    return session.scalar(locked(select(Bundle).where(Bundle.id == bundle_id), lock))


def find_bundle(session: Session, *, attempt_id: int, position: tuple[int, int]) -> Bundle | None:
    """The attempt's bundle at this (step, micro step)."""
    step, micro_step = position
    return session.scalar(
        select(Bundle).where(
            Bundle.attempt_id == attempt_id, Bundle.step == step, Bundle.micro_step == micro_step
        )
    )


def latest_of_attempt(
    session: Session,
    *,
    attempt_id: int,
    statuses: Collection[str],
    below: tuple[int, int] | None = None,
) -> Bundle | None:
    """The attempt's newest bundle in these statuses (before position ``below``)."""
    query = select(Bundle).where(Bundle.attempt_id == attempt_id, Bundle.status.in_(statuses))
    if below is not None:
        step, micro_step = below
        query = query.where(
            or_(Bundle.step < step, and_(Bundle.step == step, Bundle.micro_step < micro_step))
        )
    newest = (Bundle.step.desc(), Bundle.micro_step.desc(), Bundle.id.desc())
    return session.scalar(query.order_by(*newest).limit(1))


def insert_bundle(session: Session, **values: object) -> bool:
    """Insert a pending bundle unless its (attempt, step, micro step) exists; whether it was
    inserted."""
    result = session.execute(
        insert(session, Bundle)
        .values(status=BundleStatus.PENDING, pinned=False, created_at=utcnow(), **values)
        .on_conflict_do_nothing(index_elements=["attempt_id", "step", "micro_step"])
        .returning(Bundle.id)
    )
    # rowcount is -1 on some drivers for INSERT .. ON CONFLICT; a returned row is not.
    inserted = result.first() is not None
    if inserted:
        _count_bundle(session, run_id=values["run_id"])
    return inserted


def layers_of(session: Session, *, bundle_id: int) -> list[Layer]:
    return list(
        session.scalars(
            select(Layer).where(Layer.bundle_id == bundle_id).order_by(Layer.rank, Layer.id)
        )
    )


def layer_ids(session: Session, *, bundle_id: int) -> dict[tuple[int, str], int]:
    """The bundle's recorded layers' rows, by rank and layer (ids only: no record)."""
    rows = session.execute(
        select(Layer.rank, Layer.layer, Layer.id).where(Layer.bundle_id == bundle_id)
    )
    return {(rank, layer): layer_id for rank, layer, layer_id in rows}


def put_save(
    session: Session,
    *,
    bundle_id: int,
    run_id: int,
    rank: int,
    figures: Mapping[str, float | None],
) -> bool:
    """Store a rank's save figures, replacing any it reported before; whether they are new.
    ``run_id`` is the bundle's run (the dashboard sums a run's saves by it)."""
    values = {**figures, "reported_at": utcnow()}
    # Not ON CONFLICT DO UPDATE: the caller must know an insert from a replace, and only
    # Postgres can tell them apart in RETURNING. A racing insert makes this one do nothing.
    inserted = session.execute(
        insert(session, Save)
        .values(bundle_id=bundle_id, run_id=run_id, rank=rank, **values)
        .on_conflict_do_nothing(index_elements=["bundle_id", "rank"])
        .returning(Save.id)
    ).first()
    if inserted is None:
        session.execute(
            update(Save).where(Save.bundle_id == bundle_id, Save.rank == rank).values(**values)
        )
    return inserted is not None


def get_save(session: Session, *, bundle_id: int, rank: int) -> Save | None:
    return session.scalar(select(Save).where(Save.bundle_id == bundle_id, Save.rank == rank))


def saves_of(session: Session, *, bundle_id: int) -> list[Save]:
    return list(
        session.scalars(select(Save).where(Save.bundle_id == bundle_id).order_by(Save.rank))
    )


def claim_blobs(session: Session, *, sizes: Mapping[str, int]) -> None:
    """Insert blobs not in the catalog yet; (re)start the GC grace period of all of them.

    Rows are touched in hash order so that concurrent claims never deadlock.
    """
    if not sizes:
        return
    now = utcnow()
    ordered = sorted(sizes)
    if session.get_bind().dialect.name == "postgresql":
        shas = plain_words(ordered)
        session.execute(
            _CLAIM, {"shas": shas, "sizes": [sizes[sha] for sha in ordered], "now": now}
        )
        return
    for start in range(0, len(ordered), BATCH):
        statement = insert(session, Blob).values(
            [
                {"sha256": sha, "size": sizes[sha], "created_at": now, "claimed_at": now}
                for sha in ordered[start : start + BATCH]
            ]
        )
        session.execute(
            statement.on_conflict_do_update(
                index_elements=["sha256"], set_={"claimed_at": statement.excluded.claimed_at}
            )
        )


# PostgreSQL: the rows as two arrays, one statement however many, compiled once (a
# multi-row VALUES is built and bound row by row: 1.2 ms of CPU for 12 blobs, this 0.27).
_CLAIM = text(
    """
    INSERT INTO blob (sha256, size, created_at, claimed_at)
    SELECT sha, size, :now, :now
    FROM unnest(CAST(:shas AS varchar[]), CAST(:sizes AS bigint[])) AS claimed(sha, size)
    ORDER BY sha
    ON CONFLICT (sha256) DO UPDATE SET claimed_at = excluded.claimed_at
    """
).bindparams(bindparam("now", type_=UTCDateTime()))


def blobs_by_sha(session: Session, *, shas: Collection[str]) -> dict[str, Blob]:
    """The catalog's rows of these blobs (those it has). Read in any order: nothing is
    locked (a ``sorted`` of 10,000 would hold the GIL 2 ms)."""
    found: dict[str, Blob] = {}
    ordered = list(shas)
    for start in range(0, len(ordered), BATCH):
        chunk = ordered[start : start + BATCH]
        found.update(
            (b.sha256, b)
            for b in session.scalars(select(Blob).where(one_of(session, Blob.sha256, chunk)))
        )
    return found


class Health(NamedTuple):
    """What a commit needs of a blob's catalog row."""

    verified_at: datetime | None
    damaged_at: datetime | None
    size: int  # what the catalog says: a record's, until a commit finds the stored one


def lock_blobs(session: Session, *, shas: Collection[str]) -> dict[str, Health]:
    """These blobs' catalog rows, locked for update in hash order (as claims lock them: an
    UPDATE alone would lock in scan order and could deadlock with a claim), and their
    health."""
    found: dict[str, Health] = {}
    ordered = sorted(shas)
    for start in range(0, len(ordered), BATCH):
        chunk = ordered[start : start + BATCH]
        rows = session.execute(
            select(Blob.sha256, Blob.verified_at, Blob.damaged_at, Blob.size)
            .where(one_of(session, Blob.sha256, chunk))
            .order_by(Blob.sha256)
            .with_for_update()
        )
        found.update(
            (sha, Health(verified, damaged, size)) for sha, verified, damaged, size in rows
        )
    return found


def mark_verified(
    session: Session,
    *,
    sizes: Mapping[str, int],
    hashed: Collection[str],
    at: datetime,
    locked: Mapping[str, Health],
) -> None:
    """Record that these blobs were found whole with these sizes (and the ``hashed`` ones
    with their bytes matching their SHA-256): any damage found before is gone (they were
    written again). The caller holds the rows' locks: ``locked`` is what ``lock_blobs``
    answered.

    One statement marks them all (and the hashed ones with it, when that is all of them);
    a size is written only where the catalog's differs (a record's that the store did not
    bear out): a statement per distinct size cost a real bundle, whose tensors' blobs
    have as many sizes, a round trip each.
    """
    resized: dict[int, list[str]] = {}
    for sha, size in sorted(sizes.items()):
        row = locked.get(sha)
        if row is not None and row.size != size:
            resized.setdefault(size, []).append(sha)
    values: dict[str, Any] = {"verified_at": at, "damaged_at": None, "damage": None}
    changes: list[tuple[list[str], dict[str, Any]]] = []
    if set(hashed) == set(sizes):
        changes.append((sorted(sizes), {**values, "hashed_at": at}))
    else:
        changes += [(sorted(sizes), values), (sorted(hashed), {"hashed_at": at})]
    changes += [(shas, {"size": size}) for size, shas in resized.items()]
    for shas, change in changes:
        for start in range(0, len(shas), BATCH):
            session.execute(
                update(Blob)
                .where(one_of(session, Blob.sha256, shas[start : start + BATCH]))
                .values(change)
                .execution_options(synchronize_session=False)
            )


def mark_hashed(session: Session, *, shas: Collection[str], at: datetime) -> None:
    """Record that these blobs were read back and their bytes hash to their names, unless
    found damaged meanwhile (a rewrite and a commit clear that, not a read). The rows are
    locked first, in hash order: an UPDATE alone locks them in scan order, and deadlocked
    with a record claiming the same blobs."""
    lock_blobs(session, shas=shas)
    ordered = sorted(shas)
    for start in range(0, len(ordered), BATCH):
        session.execute(
            update(Blob)
            .where(one_of(session, Blob.sha256, ordered[start : start + BATCH]))
            .where(Blob.damaged_at.is_(None))
            .values(hashed_at=at)
            .execution_options(synchronize_session=False)
        )


def mark_damaged(session: Session, *, damage: Mapping[str, str], at: datetime) -> None:
    """Record that these blobs were found absent or damaged (``damage``: the problem): they
    are not verified any more. The caller holds their row locks."""
    ordered = sorted(damage)
    for start in range(0, len(ordered), BATCH):
        session.execute(
            update(Blob),
            [
                {
                    "sha256": sha,
                    "damaged_at": at,
                    "damage": damage[sha],
                    "verified_at": None,
                    "hashed_at": None,
                }
                for sha in ordered[start : start + BATCH]
            ],
        )


def complete_users(session: Session, *, shas: Collection[str]) -> list[tuple[Bundle, str]]:
    """Each complete bundle, of any run, that references one of these blobs, with the blob;
    the bundles locked for update, in id order."""
    pairs: set[tuple[int, str]] = set()
    for chunk in _chunks(sorted(shas)):
        rows = session.execute(
            select(Layer.bundle_id, LayerBlob.blob_sha256)
            .join(LayerBlob, LayerBlob.layer_id == Layer.id)
            .where(one_of(session, LayerBlob.blob_sha256, chunk))
            .distinct()
        )
        pairs.update((bundle_id, sha) for bundle_id, sha in rows)
    bundles: dict[int, Bundle] = {}
    for ids in _chunks(sorted({bundle_id for bundle_id, _ in pairs})):
        found = session.scalars(
            select(Bundle)
            .where(ids_in(session, Bundle.id, ids), Bundle.status == BundleStatus.COMPLETE)
            .order_by(Bundle.id)
            .with_for_update()
        )
        bundles.update((bundle.id, bundle) for bundle in found)
    return [(bundles[i], sha) for i, sha in sorted(pairs) if i in bundles]


def _chunks(values: list[T]) -> list[list[T]]:
    """``values`` in statements of at most ``BATCH`` parameters each."""
    return [values[start : start + BATCH] for start in range(0, len(values), BATCH)]


def referenced_by_runs(
    session: Session, *, run_ids: Collection[int], shas: Collection[str], statuses: Collection[str]
) -> set[str]:
    """Those of these blobs that a layer of a bundle of these runs, in these statuses,
    references. Read in any order: nothing is locked."""
    found: set[str] = set()
    ordered = list(shas)
    for start in range(0, len(ordered), BATCH):
        found.update(
            session.scalars(
                select(LayerBlob.blob_sha256)
                .join(Layer, Layer.id == LayerBlob.layer_id)
                .join(Bundle, Bundle.id == Layer.bundle_id)
                .where(
                    one_of(session, LayerBlob.blob_sha256, ordered[start : start + BATCH]),
                    ids_in(session, Bundle.run_id, run_ids),
                    Bundle.status.in_(statuses),
                )
                .distinct()
            )
        )
    return found


def add_bundle(session: Session, **values: object) -> Bundle:
    bundle = Bundle(pinned=False, created_at=utcnow(), **values)
    session.add(bundle)
    session.flush()
    _count_bundle(session, run_id=bundle.run_id)
    return bundle


def _count_bundle(session: Session, *, run_id: object) -> None:
    """One more bundle in the run's ``run_activity`` (the dashboard's count)."""
    session.execute(
        update(RunActivity)
        .where(RunActivity.run_id == run_id)
        .values(bundles=RunActivity.bundles + 1)
    )


def run_positions(
    session: Session, *, run_id: int, statuses: Collection[str]
) -> dict[tuple[int, int], Bundle]:
    """The run's bundles in these statuses by (step, micro step) (the newest id wins a
    shared position)."""
    rows = session.scalars(
        select(Bundle)
        .where(Bundle.run_id == run_id, Bundle.status.in_(statuses))
        .order_by(Bundle.id)
    )
    return {(bundle.step, bundle.micro_step): bundle for bundle in rows}
