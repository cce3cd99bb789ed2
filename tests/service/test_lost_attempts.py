"""Attempts whose heartbeats lapse are marked lost; each ending's steps lost are counted.

The rule of steps lost is a pure function (``service.lineage.steps_lost``), tested over
every case first; then the catalog over the API on both databases, with ``mark_lost``
called directly at a chosen ``now`` so nothing sleeps; then the server's periodic task,
and the migration that lets the catalog say "lost".
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from alembic import command
from sqlalchemy import Engine, text, update
from sqlalchemy.exc import IntegrityError

from service.db import alembic_config, make_engine, upgrade
from service.lineage import AttemptNode, steps_lost, steps_lost_by_attempt, steps_lost_exact
from service.models import Attempt, AttemptRank, EndReason, utcnow
from service.runs.attempts import mark_lost
from service.runs.schemas import ReportedEnd
from service.settings import Settings
from tests.service.conftest import MakeServer, Server, create_pg_database, drop_pg_database
from tests.service.helpers import register, save

LOST_AFTER = timedelta(seconds=60)  # the default


# The rule, over plain data.

REASONS = [None, *EndReason]
LAST_STEPS = [None, 0, 34, 35, 37]
# A successor: none yet, a fresh start, or one that resumed from a bundle at step 35.
SUCCESSORS = [None, "fresh", 35]


def attempt_node(
    epoch: int,
    *,
    reason: str | None = EndReason.PREEMPTED,
    last_step: int | None = None,
    resumed_step: int | None = None,
) -> AttemptNode:
    return AttemptNode(
        id=100 + epoch,
        epoch=epoch,
        last_step=last_step,
        end_reason=reason,
        resumed_step=resumed_step,
    )


@pytest.mark.parametrize(
    ("reason", "last_step", "successor"), list(itertools.product(REASONS, LAST_STEPS, SUCCESSORS))
)
def test_steps_lost_over_every_case(
    reason: str | None, last_step: int | None, successor: int | str | None
) -> None:
    ended = attempt_node(1, reason=reason, last_step=last_step)
    after = (
        None
        if successor is None
        else attempt_node(2, reason=None, resumed_step=None if successor == "fresh" else 35)
    )
    known = reason not in (None, "finished") and last_step is not None and after is not None
    if not known:
        expected = None
    elif successor == "fresh":
        expected = last_step
    else:
        expected = {0: 0, 34: 0, 35: 0, 37: 2}[last_step]  # type: ignore[index]
    assert steps_lost(ended, after) == expected


def test_the_issue_example() -> None:
    """Heartbeat at step 37, bundles at 30 and 35, the successor resumes from 35: 2 lost."""
    ended = attempt_node(1, last_step=37)
    assert steps_lost(ended, attempt_node(2, resumed_step=35)) == 2
    assert steps_lost(ended, attempt_node(2, resumed_step=None)) == 37  # started fresh
    # Resumed from a later bundle than the step last reported (a save committed after the
    # last heartbeat): nothing is lost, never a negative count.
    assert steps_lost(ended, attempt_node(2, resumed_step=40)) == 0


def test_a_successor_comes_after_the_attempt() -> None:
    with pytest.raises(AssertionError):
        steps_lost(attempt_node(2, last_step=10), attempt_node(1))


def test_steps_lost_by_attempt_pairs_each_with_the_next_epoch() -> None:
    assert steps_lost_by_attempt([]) == {}
    one = attempt_node(1, last_step=37)
    # Epoch 3 follows 1 after a rollback (which took epoch 2 without an attempt).
    three = attempt_node(3, reason=EndReason.LOST, last_step=50, resumed_step=30)
    four = attempt_node(4, reason=EndReason.FAILED, last_step=60, resumed_step=45)
    five = attempt_node(5, reason=None, last_step=70, resumed_step=55)
    # In any order: the function sorts by epoch.
    assert steps_lost_by_attempt([five, three, one, four]) == {
        one.id: 7,
        three.id: 5,
        four.id: 5,
        five.id: None,  # still running
    }
    assert steps_lost_by_attempt([one]) == {one.id: None}  # no successor yet


def test_an_attempt_can_report_every_reason_but_lost() -> None:
    assert set(get_args(ReportedEnd)) == {str(r) for r in EndReason} - {EndReason.LOST}


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_lost_after_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="lost_after_seconds must be a positive"):
        Settings(lost_after_seconds=bad)


def test_lost_after_from_the_environment_and_the_check_interval() -> None:
    assert Settings.from_env({}).lost_after_seconds == 60
    assert Settings.from_env({}).lost_check_seconds == 30
    settings = Settings.from_env({"CKPT_LOST_AFTER_SECONDS": "1.5"})
    assert settings.lost_after_seconds == 1.5
    assert settings.lost_check_seconds == 0.75
    assert Settings(lost_after_seconds=600).lost_check_seconds == 30
    with pytest.raises(ValueError, match="CKPT_LOST_AFTER_SECONDS"):
        Settings.from_env({"CKPT_LOST_AFTER_SECONDS": "soon"})


# The catalog, over the API.


def lineage_attempts(client: httpx.Client, run: str) -> dict[int, dict[str, Any]]:
    response = client.get(f"/v1/runs/{run}/lineage")
    assert response.status_code == 200, response.text
    return {a["id"]: a for a in response.json()["attempts"]}


def get_run(client: httpx.Client, run: str) -> dict[str, Any]:
    response = client.get(f"/v1/runs/{run}")
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


def heartbeat(client: httpx.Client, attempt_id: int, step: int | None = None) -> httpx.Response:
    body = {} if step is None else {"step": step}
    return client.post(f"/v1/attempts/{attempt_id}/heartbeat", json=body)


def end(client: httpx.Client, attempt_id: int, **body: Any) -> httpx.Response:
    return client.post(f"/v1/attempts/{attempt_id}/end", json=body)


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


def backdate(server: Server, attempt_id: int, *, seconds: float) -> None:
    """Pretend the attempt registered ``seconds`` ago."""
    with server.context.transaction() as session:
        session.execute(
            update(Attempt)
            .where(Attempt.id == attempt_id)
            .values(started_at=utcnow() - timedelta(seconds=seconds))
        )


def test_a_silent_attempt_is_lost_after_lost_after_and_not_before(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        before = utcnow()
        attempt_id = register(client, run_name)["attempt_id"]
        after = utcnow()

        assert mark_lost(server.context, now=before + LOST_AFTER - timedelta(seconds=1)) == []
        assert lineage_attempts(client, run_name)[attempt_id]["end_reason"] is None

        now = after + LOST_AFTER + timedelta(seconds=1)
        assert mark_lost(server.context, now=now) == [attempt_id]
        lost = lineage_attempts(client, run_name)[attempt_id]
        assert lost["end_reason"] == "lost"
        assert datetime.fromisoformat(lost["ended_at"]) == now
        assert lost["final_save_committed"] is None
        assert lost["steps_lost"] is None  # no successor yet
        # Once is enough: a later pass leaves it alone.
        assert mark_lost(server.context, now=now + timedelta(hours=1)) == []
        assert metric(client, "ckpt_attempts_lost_total") == 1


def test_a_heartbeat_keeps_an_attempt_alive(server: Server, run_name: str) -> None:
    with server.client() as client:
        beating = register(client, f"{run_name}-beating")["attempt_id"]
        silent = register(client, f"{run_name}-silent")["attempt_id"]
        for attempt_id in (beating, silent):
            backdate(server, attempt_id, seconds=3600)
        beat_at = utcnow()
        assert heartbeat(client, beating, step=5).status_code == 200

        assert mark_lost(server.context) == [silent]  # registered an hour ago, never beat
        assert mark_lost(server.context, now=beat_at + LOST_AFTER - timedelta(seconds=1)) == []
        assert mark_lost(server.context, now=utcnow() + LOST_AFTER + timedelta(seconds=1)) == [
            beating
        ]
        assert metric(client, "ckpt_attempts_lost_total") == 2


def test_an_attempt_is_lost_when_any_of_its_ranks_goes_silent(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        attempt_id = register(client, run_name)["attempt_id"]
        for rank in (0, 1):
            beat = client.post(
                f"/v1/attempts/{attempt_id}/heartbeat", json={"step": 3, "rank": rank}
            )
            assert beat.status_code == 200, beat.text
        with server.context.transaction() as session:  # rank 1's last beat: two minutes ago
            session.execute(
                update(AttemptRank)
                .where(AttemptRank.attempt_id == attempt_id, AttemptRank.rank == 1)
                .values(heartbeat_at=utcnow() - 2 * LOST_AFTER)
            )
        assert (
            client.post(f"/v1/attempts/{attempt_id}/heartbeat", json={"step": 4}).status_code == 200
        )
        assert mark_lost(server.context) == [attempt_id]  # rank 0 beats on; rank 1 died
        # Rank 0 beating on does not bring back an attempt one of whose ranks is silent.
        assert (
            client.post(f"/v1/attempts/{attempt_id}/heartbeat", json={"step": 5}).status_code == 200
        )
        assert mark_lost(server.context) == []
        lineage = client.get(f"/v1/runs/{run_name}/lineage").json()
        assert lineage["attempts"][0]["end_reason"] == "lost"
        # The silent rank beating again brings it back: its own old beat no longer counts.
        back = client.post(f"/v1/attempts/{attempt_id}/heartbeat", json={"step": 5, "rank": 1})
        assert back.status_code == 200, back.text
        assert (back.json()["end_reason"], back.json()["ended_at"]) == (None, None)
        refused = client.post(f"/v1/attempts/{attempt_id}/heartbeat", json={"rank": 16384})
        assert refused.status_code == 422


def test_an_ended_attempt_is_never_lost(server: Server, run_name: str) -> None:
    with server.client() as client:
        for reason in get_args(ReportedEnd):
            attempt_id = register(client, f"{run_name}-{reason}")["attempt_id"]
            assert end(client, attempt_id, reason=reason).status_code == 200
        assert mark_lost(server.context, now=utcnow() + timedelta(days=30)) == []
        assert metric(client, "ckpt_attempts_lost_total") == 0


def test_a_lost_attempt_that_reports_its_end_shows_that_end(server: Server, run_name: str) -> None:
    with server.client() as client:
        attempt_id = register(client, run_name)["attempt_id"]
        assert mark_lost(server.context, now=utcnow() + 2 * LOST_AFTER) == [attempt_id]

        ended = end(client, attempt_id, reason="preempted", final_save_committed=True, step=40)
        assert ended.status_code == 200, ended.text
        out = ended.json()
        assert (out["end_reason"], out["final_save_committed"], out["last_step"]) == (
            "preempted",
            True,
            40,
        )
        assert datetime.fromisoformat(out["ended_at"]) <= utcnow()  # now, not the lost verdict
        assert lineage_attempts(client, run_name)[attempt_id] == out
        # Everything else about ending stays: a retry is accepted, another reason is not,
        # and nobody may report "lost".
        assert end(client, attempt_id, reason="preempted", final_save_committed=True).json() == out
        assert end(client, attempt_id, reason="failed").status_code == 409
        refused = end(client, register(client, run_name)["attempt_id"], reason="lost")
        assert refused.status_code == 422, refused.text


def test_a_lost_attempt_that_heartbeats_is_alive_again(server: Server, run_name: str) -> None:
    with server.client() as client:
        first = register(client, run_name)["attempt_id"]
        assert mark_lost(server.context, now=utcnow() + 2 * LOST_AFTER) == [first]
        beat = heartbeat(client, first, step=12)
        assert beat.status_code == 200, beat.text
        assert (beat.json()["end_reason"], beat.json()["ended_at"]) == (None, None)

        # Once a successor registered, a lost attempt is fenced: its heartbeat is refused
        # and it stays lost.
        assert mark_lost(server.context, now=utcnow() + 2 * LOST_AFTER) == [first]
        register(client, run_name)
        assert heartbeat(client, first, step=13).status_code == 409
        assert lineage_attempts(client, run_name)[first]["end_reason"] == "lost"


def preempted_at_37(client: httpx.Client, server: Server, run: str) -> int:
    """Attempt 1 commits bundles at steps 30 and 35 and heartbeats step 37."""
    first = register(client, run)
    save(client, server.store, run, first, step=30)
    save(client, server.store, run, first, step=35)
    assert heartbeat(client, first["attempt_id"], step=37).status_code == 200
    attempt_id: int = first["attempt_id"]
    return attempt_id


def test_steps_lost_when_the_successor_resumes(server: Server, run_name: str) -> None:
    with server.client() as client:
        first = preempted_at_37(client, server, run_name)
        assert end(client, first, reason="preempted").json()["steps_lost"] is None  # no successor
        assert get_run(client, run_name)["steps_lost_total"] == 0

        second = register(client, run_name)
        assert second["resume_from"]["step"] == 35

        attempts = lineage_attempts(client, run_name)
        assert attempts[first]["steps_lost"] == 2
        assert attempts[second["attempt_id"]]["steps_lost"] is None  # still running
        assert get_run(client, run_name)["steps_lost_total"] == 2
        listed = client.get("/v1/runs", params={"prefix": run_name}).json()["runs"]
        assert [r["steps_lost_total"] for r in listed] == [2]
        assert metric(client, "ckpt_steps_lost_total") == 2
        # A retried end answers with the same figure.
        assert end(client, first, reason="preempted").json()["steps_lost"] == 2


def test_steps_lost_when_the_successor_starts_fresh(server: Server, run_name: str) -> None:
    with server.client() as client:
        first = preempted_at_37(client, server, run_name)
        assert end(client, first, reason="failed").status_code == 200
        second = register(client, run_name, resume=False)
        assert second["resume_from"] is None
        assert lineage_attempts(client, run_name)[first]["steps_lost"] == 37
        assert get_run(client, run_name)["steps_lost_total"] == 37
        assert metric(client, "ckpt_steps_lost_total") == 37


def test_a_finished_attempt_loses_nothing(server: Server, run_name: str) -> None:
    with server.client() as client:
        first = preempted_at_37(client, server, run_name)
        assert end(client, first, reason="finished", step=37).status_code == 200
        second = register(client, run_name)["attempt_id"]
        attempts = lineage_attempts(client, run_name)
        assert attempts[first]["steps_lost"] is None
        assert attempts[second]["steps_lost"] is None
        assert get_run(client, run_name)["steps_lost_total"] == 0
        assert metric(client, "ckpt_steps_lost_total") == 0


def test_an_attempt_that_reported_no_step_has_unknown_steps_lost(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        first = register(client, run_name)["attempt_id"]
        assert end(client, first, reason="preempted").status_code == 200
        register(client, run_name)
        assert lineage_attempts(client, run_name)[first]["steps_lost"] is None
        assert get_run(client, run_name)["steps_lost_total"] == 0


def test_steps_lost_of_a_lost_attempt(server: Server, run_name: str) -> None:
    """Lost before its successor registers: the registration makes the figure known."""
    with server.client() as client:
        first = preempted_at_37(client, server, run_name)
        assert mark_lost(server.context, now=utcnow() + 2 * LOST_AFTER) == [first]
        assert metric(client, "ckpt_steps_lost_total") == 0
        register(client, run_name)
        assert lineage_attempts(client, run_name)[first]["steps_lost"] == 2
        assert metric(client, "ckpt_steps_lost_total") == 2


def test_a_zombie_lost_after_its_successor_registered(server: Server, run_name: str) -> None:
    """The successor registers first (the figure is unknown: the attempt has not ended);
    marking it lost makes it known; the zombie's own end, at a later step, raises it."""
    with server.client() as client:
        first = preempted_at_37(client, server, run_name)
        second = register(client, run_name)["attempt_id"]
        assert lineage_attempts(client, run_name)[first]["steps_lost"] is None
        assert metric(client, "ckpt_steps_lost_total") == 0

        # The successor heartbeats; only the silent zombie is lost.
        assert heartbeat(client, second, step=35).status_code == 200
        backdate(server, first, seconds=3600)
        with server.context.transaction() as session:
            session.execute(update(Attempt).where(Attempt.id == first).values(heartbeat_at=None))
        assert mark_lost(server.context) == [first]
        assert lineage_attempts(client, run_name)[first]["steps_lost"] == 2
        assert metric(client, "ckpt_steps_lost_total") == 2

        ended = end(client, first, reason="preempted", step=38)
        assert ended.status_code == 200, ended.text
        assert (ended.json()["end_reason"], ended.json()["steps_lost"]) == ("preempted", 3)
        assert get_run(client, run_name)["steps_lost_total"] == 3
        assert metric(client, "ckpt_steps_lost_total") == 3
        assert metric(client, "ckpt_attempts_lost_total") == 1


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_the_server_marks_lost_attempts_periodically(
    backend: str, make_server: MakeServer, run_name: str
) -> None:
    server = make_server(backend, lost_after_seconds=1)
    with server.client() as client:
        attempt_id = register(client, run_name)["attempt_id"]
        deadline = time.monotonic() + 10
        while lineage_attempts(client, run_name)[attempt_id]["end_reason"] != "lost":
            assert time.monotonic() < deadline, "the periodic task never marked it lost"
            time.sleep(0.1)
        assert metric(client, "ckpt_attempts_lost_total") == 1


# The migration.


@pytest.fixture(params=["postgres", "sqlite"])
def migrated_to_0002(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A database at the revision before lost attempts, with an attempt that saved a
    bundle and a successor that resumed from it."""
    url = (
        f"sqlite:///{tmp_path / 'catalog.db'}"
        if request.param == "sqlite"
        else create_pg_database()
    )
    upgrade(url, "2026_11_29_0002")
    engine = make_engine(url)
    at = {"at": utcnow()}
    with engine.begin() as connection:
        run = connection.execute
        run(text("INSERT INTO run (id, name, created_at, epoch) VALUES (1, 'r', :at, 2)"), at)
        run(text("INSERT INTO attempt (id, run_id, epoch, started_at) VALUES (1, 1, 1, :at)"), at)
        run(
            text(
                "INSERT INTO bundle (id, run_id, attempt_id, step, world_size, status, pinned, "
                "created_at, versions) VALUES (1, 1, 1, 5, 1, 'complete', false, :at, '{}')"
            ),
            at,
        )
        run(
            text(
                "INSERT INTO attempt (id, run_id, epoch, started_at, resumed_from_id) "
                "VALUES (2, 1, 2, :at, 1)"
            ),
            at,
        )
    try:
        yield engine
    finally:
        engine.dispose()
        if request.param == "postgres":
            drop_pg_database(url)


def set_reason(engine: Engine, reason: str) -> None:
    with engine.begin() as connection:
        connection.execute(text("UPDATE attempt SET end_reason = :r WHERE id = 1"), {"r": reason})


def links(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as connection:
        bundles = connection.execute(text("SELECT id, attempt_id FROM bundle")).all()
        attempts = connection.execute(
            text("SELECT id, resumed_from_id FROM attempt ORDER BY id")
        ).all()
    return [tuple(row) for row in [*bundles, *attempts]]


def test_the_migration_allows_lost_and_keeps_the_rows(migrated_to_0002: Engine) -> None:
    engine = migrated_to_0002
    url = engine.url.render_as_string(hide_password=False)
    before = links(engine)
    assert before == [(1, 1), (1, None), (2, 1)]
    with pytest.raises(IntegrityError):
        set_reason(engine, "lost")

    upgrade(url)

    # SQLite copies the attempt table: the bundle still knows which attempt made it.
    assert links(engine) == before
    set_reason(engine, "lost")
    with pytest.raises(IntegrityError):
        set_reason(engine, "bored")

    command.downgrade(alembic_config(url), "2026_11_29_0002")

    assert links(engine) == before
    with engine.connect() as connection:
        reason = connection.execute(text("SELECT end_reason FROM attempt WHERE id = 1")).scalar()
    assert reason == "failed"  # the old schema's nearest word
    with pytest.raises(IntegrityError):
        set_reason(engine, "lost")


@pytest.mark.parametrize(
    ("reason", "exact"),
    [("preempted", True), ("failed", True), ("finished", True), ("lost", False)],
)
def test_steps_lost_are_a_lower_bound_only_for_an_attempt_marked_lost(
    reason: str, exact: bool
) -> None:
    # A reported end carries the step the attempt stopped at; a lost attempt's last step
    # came with its last heartbeat, and it may have trained past it.
    assert steps_lost_exact(reason) is exact


def test_a_commit_after_the_last_heartbeat_raises_the_floor(server: Server, run_name: str) -> None:
    """Killed after committing step 12, its last heartbeat at step 5: the attempt reached 12
    (its bundle says so), so a successor that starts fresh counts at least 12 steps lost."""
    with server.client() as client:
        first = register(client, run_name)
        assert heartbeat(client, first["attempt_id"], step=5).status_code == 200
        save(client, server.store, run_name, first, step=12)
        assert lineage_attempts(client, run_name)[first["attempt_id"]]["last_step"] == 12
        assert mark_lost(server.context, now=utcnow() + 2 * LOST_AFTER) == [first["attempt_id"]]
        with server.context.transaction() as session:  # the bundle at 12 rotted: none resumable
            session.execute(text("UPDATE bundle SET status = 'quarantined'"))
        register(client, run_name)
        lost = lineage_attempts(client, run_name)[first["attempt_id"]]
        assert (lost["steps_lost"], lost["steps_lost_exact"]) == (12, False)
