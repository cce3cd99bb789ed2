"""A large catalog, written straight into the database in bulk (for the dashboard's
benchmark and its query-plan test): runs of several attempts each, one very long run.

Rows go in through the service's tables with multi-row INSERTs, ids chosen here; on
PostgreSQL the foreign-key triggers are off while they do (``session_replication_role``),
so rows that point at each other (a run at its head bundle, an attempt at the bundle it
resumed from) go in once, with their final values. On SQLite, pass an engine that does not
enforce foreign keys (``sqlalchemy.create_engine``'s, not the service's). Nothing here is a
real bundle: no blob is in any store.

Each run's attempts split its bundles between them; each attempt resumes from the last
bundle of the one before, which ended preempted or lost (the last attempt ends as the run's
state says, or still runs). In the long run every 100th attempt follows a rollback: it
resumes one bundle earlier, which leaves the bundle after it on an abandoned branch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, Table, insert, text

from ckpt.core.contract import MANIFEST_FORMAT
from service import lineage, models

STATES = ("training", "preempted", "lost", "finished", "failed")
VERSIONS = {"ckpt": "0.1.0", "python": "3.11", "torch": "2.13.0"}
EVERY = 10  # steps between bundles
CHUNK = 5_000  # rows per INSERT batch
MB = 1 << 20


@dataclass(frozen=True)
class Shape:
    runs: int = 5_000
    bundles_per_run: int = 50
    attempts_per_run: int = 5
    big_attempts: int = 1_000
    big_bundles: int = 10_000
    big_run: str = "big"


@dataclass
class Rows:
    """The rows of every table, and the next id of each."""

    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    ids: dict[str, Iterator[int]] = field(default_factory=dict)

    def add(self, table: str, **row: Any) -> int:
        row_id: int = next(self.ids.setdefault(table, itertools.count(1)))
        self.tables.setdefault(table, []).append({"id": row_id, **row})
        return row_id


def run_name(index: int) -> str:
    return f"run-{index:05d}"


def state_of(index: int) -> str:
    """The state of run ``index`` (from its newest attempt): each state in turn."""
    return STATES[index % len(STATES)]


def build(shape: Shape, *, now: datetime | None = None) -> Rows:
    """Every row of the catalog ``shape`` describes; the long run is the newest."""
    now = now or datetime.now(UTC)
    rows = Rows()
    start = now - timedelta(seconds=shape.runs * 60 + shape.big_attempts * 60)
    for index in range(shape.runs):
        add_run(
            rows,
            name=run_name(index),
            state=state_of(index),
            attempts=shape.attempts_per_run,
            bundles=shape.bundles_per_run,
            start=start + timedelta(seconds=index * 60),
        )
    if shape.big_bundles:
        add_run(
            rows,
            name=shape.big_run,
            state="training",
            attempts=shape.big_attempts,
            bundles=shape.big_bundles,
            start=now - timedelta(seconds=shape.big_attempts * 60),
            rollback_every=100,
        )
    return rows


def add_run(
    rows: Rows,
    *,
    name: str,
    state: str,
    attempts: int,
    bundles: int,
    start: datetime,
    rollback_every: int = 0,
) -> None:
    run_id = rows.add("run", name=name, created_at=start, epoch=attempts, head_bundle_id=None)
    run = rows.tables["run"][-1]
    per_attempt = max(1, bundles // attempts)
    parent: int | None = None
    for epoch in range(1, attempts + 1):
        first = (epoch - 1) * per_attempt
        count = per_attempt if epoch < attempts else bundles - first
        began = start + timedelta(seconds=epoch * 50 / attempts)
        if rollback_every and epoch % rollback_every == 0 and parent is not None:
            parent = _roll_back(rows, run_id=run_id, head=parent, epoch=epoch, at=began)
        last = epoch == attempts
        ended = state if last else ("preempted", "lost")[epoch % 2]
        attempt_id = rows.add(
            "attempt",
            run_id=run_id,
            epoch=epoch,
            pod=f"{name}-pod-{epoch}",
            node=f"node-{epoch % 7}",
            started_at=began,
            heartbeat_at=began,
            last_step=(first + count) * EVERY + 7,
            ended_at=None if ended == "training" else began,
            end_reason=None if ended == "training" else ended,
            final_save_committed=ended == "preempted",
            resumed_from_id=parent,
        )
        pending_last = last and state == "training"
        for offset in range(count):
            status = "pending" if pending_last and offset == count - 1 else "complete"
            if (first + offset) % 97 == 96:
                status = "quarantined"
            parent = _add_bundle(
                rows,
                run=name,
                run_id=run_id,
                attempt_id=attempt_id,
                parent=parent,
                step=(first + offset + 1) * EVERY,
                status=status,
                at=began,
            )
            if status == "complete":
                run["head_bundle_id"] = parent
    rows.tables.setdefault("run_activity", []).append(
        _activity(rows, run_id=run_id, state=state, attempts=attempts)
        | {"bundles": bundles, "writes": 0}
    )


def _activity(rows: Rows, *, run_id: int, state: str, attempts: int) -> dict[str, Any]:
    """The run's row of ``run_activity``, as ``runs.activity.refresh_activity`` keeps it."""
    found = rows.tables["attempt"][-attempts:]
    bundles = rows.tables["bundle"]

    def start(attempt: dict[str, Any]) -> int:
        resumed = attempt["resumed_from_id"]
        return int(bundles[resumed - 1]["step"]) if resumed else 0

    nodes = [
        lineage.AttemptNode(
            id=a["id"],
            epoch=a["epoch"],
            last_step=a["last_step"],
            end_reason=a["end_reason"],
            resumed_step=start(a),
        )
        for a in found
    ]
    computed = [max(0, a["last_step"] - start(a)) for a in found]
    newest = found[-1]
    return {
        "run_id": run_id,
        "state": state,
        "active_at": newest["ended_at"] or newest["heartbeat_at"],
        "attempts": attempts,
        "preemptions": sum(a["end_reason"] == "preempted" for a in found),
        "steps_lost": sum(n or 0 for n in lineage.steps_lost_by_attempt(nodes).values()),
        "steps_computed": sum(computed),
        "earlier_steps_computed": sum(computed[:-1]),
    }


def _add_bundle(
    rows: Rows,
    *,
    run: str,
    run_id: int,
    attempt_id: int,
    parent: int | None,
    step: int,
    status: str,
    at: datetime,
) -> int:
    bundle_id = rows.add(
        "bundle",
        run_id=run_id,
        attempt_id=attempt_id,
        parent_id=parent,
        step=step,
        world_size=1,
        status=status,
        reason="a blob failed verification" if status == "quarantined" else None,
        pinned=step % 1000 == 0,
        created_at=at,
        committed_at=None if status == "pending" else at,
        versions=VERSIONS,
        # A valid manifest of no rank's layers (so /resumable answers): real ones list
        # every layer's blobs and are larger.
        manifest=None
        if status == "pending"
        else {
            "format": MANIFEST_FORMAT,
            "run": run,
            "step": step,
            "world_size": 1,
            "created_at": at.isoformat(),
            "versions": VERSIONS,
            "ranks": [],
        },
    )
    if status != "pending":
        rows.add(
            "save",
            bundle_id=bundle_id,
            run_id=run_id,
            rank=0,
            stall_seconds=0.05 + (step % 13) / 100,
            persist_seconds=0.5 + (step % 7) / 10,
            payload_bytes=64 * MB,
            new_bytes=(step % 5 + 1) * MB,
            reported_at=at,
        )
    return bundle_id


def _roll_back(rows: Rows, *, run_id: int, head: int, epoch: int, at: datetime) -> int:
    """Roll ``head`` back to its parent: the head is left on an abandoned branch."""
    target = rows.tables["bundle"][head - 1]["parent_id"] or head
    rows.add(
        "rollback",
        run_id=run_id,
        from_bundle_id=head,
        to_bundle_id=target,
        epoch=epoch,
        created_at=at,
    )
    return int(target)


ORDER = ("run", "attempt", "run_activity", "bundle", "save", "rollback")
KEYED_BY_RUN = {"run_activity"}  # no id of its own


def write(engine: Engine, rows: Rows) -> dict[str, int]:
    """Insert ``rows`` in one transaction; returns the count of each table."""
    with engine.begin() as connection:
        postgres = connection.dialect.name == "postgresql"
        if postgres:
            connection.execute(text("SET LOCAL session_replication_role = replica"))
        for name in ORDER:
            table: Table = models.Base.metadata.tables[name]
            for chunk in _chunks(rows.tables.get(name, []), CHUNK):
                connection.execute(insert(table), chunk)
        if postgres:
            _advance_sequences(connection)
    if postgres:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("VACUUM ANALYZE"))
    return {name: len(rows.tables.get(name, [])) for name in ORDER}


def _advance_sequences(connection: Connection) -> None:
    for name in set(ORDER) - KEYED_BY_RUN:
        connection.execute(
            text(
                f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                f"(SELECT coalesce(max(id), 0) + 1 FROM {name}), false)"
            )
        )


def _chunks(items: list[dict[str, Any]], size: int) -> Iterable[list[dict[str, Any]]]:
    for begin in range(0, len(items), size):
        yield items[begin : begin + size]


def seed(engine: Engine, shape: Shape) -> dict[str, int]:
    """Write the catalog ``shape`` describes into ``engine``'s (migrated, empty) database."""
    return write(engine, build(shape))
