"""A plain heartbeat on PostgreSQL is one statement in autocommit, one round trip
(``runs.beats.beat_at_once``), and writes what the full path writes: the same beats sent
through both leave the same attempt, ranks and run activity, answer the same and count
the same time in the metrics; every beat its checks turn away is refused as the full path
refuses it, having written nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import event, select, text

from service.auth.principal import Principal
from service.auth.service import hash_token
from service.models import Attempt, AttemptRank, Role, Run, RunActivity
from service.runs import beats
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import register, save
from tests.service.test_attempt_lock_order import HANG_GUARD, wait_until_one_waits
from tests.service.test_token_expiry import expire

TIME = {"restart_seconds": 1.5, "stall_seconds": 0.25, "train_seconds": 30.0, "steps_trained": 12}
LATER = {"restart_seconds": 1.5, "stall_seconds": 0.5, "train_seconds": 44.0, "steps_trained": 15}
# Beats of three ranks of an attempt resumed from step 10: steps forward and back, none,
# rank 0's time figures, the interval CKPT_EVERY=auto chose, and a step too far ahead.
BEATS: list[tuple[dict[str, Any], int]] = [
    ({"step": 12, "rank": 0, "time": TIME}, 200),
    ({"step": 13, "rank": 1}, 200),
    ({"rank": 2}, 200),
    ({"step": 15, "rank": 0, "interval_seconds": 60.0, "waste_seconds_per_hour": 7.5}, 200),
    ({"step": 14, "rank": 1}, 200),
    ({"step": 15 + 1000, "rank": 2}, 422),  # CKPT_MAX_STEP_ADVANCE=1000
    ({"step": 16, "rank": 0, "time": LATER}, 200),
]


@pytest.fixture(scope="module")
def postgres(make_module_server: MakeServer) -> Server:
    return make_module_server("postgres", max_step_advance=1000)


@contextmanager
def round_trips(server: Server) -> Iterator[list[int]]:
    """Count the round trips to the catalog in the block: each statement, and a transaction's
    ``BEGIN`` and ``COMMIT`` (none in autocommit)."""
    counted = [0]

    def statement(*_: Any) -> None:
        counted[0] += 1

    def begun(connection: Any) -> None:
        if not connection.connection.dbapi_connection.autocommit:
            counted[0] += 2

    engine = server.context.engine
    event.listen(engine, "before_cursor_execute", statement)
    event.listen(engine, "begin", begun)
    try:
        yield counted
    finally:
        event.remove(engine, "before_cursor_execute", statement)
        event.remove(engine, "begin", begun)


def created_token(client: httpx.Client, run: str, name: str = "trainer") -> dict[str, Any]:
    """A new run token of ``run``, as ``POST /v1/tokens`` answered (its ``id``, ``token``)."""
    answer = client.post("/v1/tokens", json={"role": "run", "run": run, "name": name})
    assert answer.status_code == 201, answer.text
    created: dict[str, Any] = answer.json()
    return created


def run_token(client: httpx.Client, run: str) -> str:
    return str(created_token(client, run)["token"])


def test_a_plain_heartbeat_is_one_round_trip(postgres: Server, run_name: str) -> None:
    with postgres.client() as admin:
        attempt = register(admin, run_name)
        token = run_token(admin, run_name)
    beat = f"/v1/attempts/{attempt['attempt_id']}/heartbeat"
    for body in ({"step": 1}, {"step": 2, "rank": 3, "time": TIME}, {"interval_seconds": 9.0}):
        with postgres.client(token) as trainer:
            trainer.post(beat, json={"step": 0})  # its token, read once and kept
            with round_trips(postgres) as counted:
                answer = trainer.post(beat, json=body)
        assert answer.status_code == 200, answer.text
        assert counted == [1], body
    with round_trips(postgres) as counted:  # fingerprints: the full path
        fingerprint = {"step": 3, "micro_step": 0, "loss": 1.0, "parts": {"params": "ab12"}}
        with postgres.client() as admin:
            answer = admin.post(beat, json={"step": 3, "fingerprints": [fingerprint]})
    assert answer.status_code == 200, answer.text
    assert counted[0] >= 5  # BEGIN, the locked select, the fingerprints', the writes, COMMIT


def test_a_token_not_kept_is_checked_in_the_same_statement(postgres: Server, run_name: str) -> None:
    """A rank beats every few seconds, and a process keeps a token it read for 2 s: most
    heartbeats come with a token it does not hold. The statement checks it (one round trip,
    not two) and the process keeps it after, as if it had read it."""
    with postgres.client() as admin:
        attempt = register(admin, run_name)
        created = created_token(admin, run_name, "t")
        token = created["token"]
    beat = f"/v1/attempts/{attempt['attempt_id']}/heartbeat"
    assert postgres.context.tokens.get(hash_token(token)) is None
    with postgres.client(token) as trainer, round_trips(postgres) as counted:
        answer = trainer.post(beat, json={"step": 1})
    assert answer.status_code == 200, answer.text
    assert counted == [1]
    assert postgres.context.tokens.get(hash_token(token)) == Principal(
        name="t", role=Role.RUN, run=run_name, token_id=created["id"]
    )


def test_a_token_revoked_while_its_heartbeat_waits_is_not_kept(
    postgres: Server, run_name: str
) -> None:
    """The statement finds the token as it was when the statement began. One revoked through
    the process while the statement waits for the attempt's lock is answered (it was asked
    before the revocation) and not kept after: its next request is refused."""
    with postgres.client() as admin:
        attempt = register(admin, run_name)
        created = created_token(admin, run_name, "w")
    token = created["token"]
    beat = f"/v1/attempts/{attempt['attempt_id']}/heartbeat"
    answers: list[httpx.Response] = []

    def send() -> None:
        with postgres.client(token) as trainer:
            answers.append(trainer.post(beat, json={"step": 1}, timeout=HANG_GUARD))

    engine = postgres.context.engine
    with engine.connect() as holder, engine.connect() as watcher:
        holder.execute(
            text("SELECT id FROM attempt WHERE id = :id FOR UPDATE"), {"id": attempt["attempt_id"]}
        )
        sending = threading.Thread(target=send)
        sending.start()
        wait_until_one_waits(watcher, "the heartbeat")  # for the attempt
        with postgres.client() as admin:
            admin.delete(f"/v1/tokens/{created['id']}").raise_for_status()
        holder.rollback()
        sending.join(HANG_GUARD)
    assert [answer.status_code for answer in answers] == [200]
    assert postgres.context.tokens.get(hash_token(token)) is None
    with postgres.client(token) as trainer:
        assert trainer.post(beat, json={"step": 2}).status_code == 401


def written(server: Server, run: str) -> dict[str, Any]:
    """The run's newest attempt, its ranks and its activity, but for ids and times; the times
    as which of them are the newest heartbeat's."""
    with server.context.transaction() as session:
        run_id = session.scalar(select(Run.id).where(Run.name == run))
        attempt = session.scalars(
            select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.epoch.desc())
        ).first()
        assert attempt is not None
        ranks = session.scalars(select(AttemptRank).where(AttemptRank.attempt_id == attempt.id))
        activity = session.get(RunActivity, run_id)
        assert activity is not None
        newest = attempt.heartbeat_at
        columns = {
            column.key: getattr(attempt, column.key)
            for column in Attempt.__table__.columns
            if column.key not in {"id", "run_id", "started_at", "heartbeat_at", "resumed_from_id"}
        }
        return {
            "attempt": columns,
            "ranks": sorted((rank.rank, rank.heartbeat_at == newest) for rank in ranks),
            "activity": {
                "state": activity.state,
                "active_at is the beat": activity.active_at == newest,
                "steps_computed": activity.steps_computed,
                "writes": activity.writes,
            },
        }


def seconds_counted(server: Server) -> dict[str, float]:
    counter = server.context.metrics.attempt_seconds
    return {part: counter.labels(part=part)._value.get() for part in ("restart", "stall", "train")}


def send(server: Server, run: str) -> tuple[list[Any], dict[str, Any], dict[str, float]]:
    """``BEATS`` sent to a new attempt of ``run`` resumed from step 10, each by a run token:
    the answers (but their times), what they wrote, and the time they counted."""
    with server.client() as admin:
        first = register(admin, run)
        save(admin, server.store, run, first, step=10)
        attempt = register(admin, run)
        token = run_token(admin, run)
    assert attempt["resume_from"]["step"] == 10
    counted = seconds_counted(server)
    answers = []
    with server.client(token) as trainer:
        for body, status in BEATS:
            answer = trainer.post(f"/v1/attempts/{attempt['attempt_id']}/heartbeat", json=body)
            assert answer.status_code == status, (body, answer.text)
            out = answer.json()
            if status == 200:
                out = {
                    k: v for k, v in out.items() if k not in {"id", "started_at", "heartbeat_at"}
                }
                out["run"] = out["run"] == run
                out.pop("resumed_from_id")
            answers.append(out)
    after = seconds_counted(server)
    return answers, written(server, run), {part: after[part] - counted[part] for part in after}


def test_both_paths_write_answer_and_count_the_same(
    postgres: Server, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    at_once = send(postgres, f"{run_name}-at-once")
    with monkeypatch.context() as patched:  # every beat down the full path
        patched.setattr(beats, "beat_at_once", lambda *_, **__: None)
        full = send(postgres, f"{run_name}-full")
    assert at_once == full
    answers, wrote, counted = at_once
    assert wrote["attempt"]["last_step"] == 16
    assert wrote["attempt"]["train_seconds"] == 44.0
    assert wrote["attempt"]["interval_seconds"] == 60.0
    assert wrote["ranks"] == [(0, True), (1, False), (2, False)]
    assert wrote["activity"]["steps_computed"] == 10 + 6  # the first attempt's, this one's
    assert counted == {"restart": 1.5, "stall": 0.5, "train": 44.0}
    assert "CKPT_MAX_STEP_ADVANCE" in answers[5]["message"]


def test_what_its_checks_turn_away_is_refused_as_before_and_writes_nothing(
    postgres: Server, run_name: str
) -> None:
    with postgres.client() as admin:
        old = register(admin, run_name)
        token = run_token(admin, run_name)
        other = run_token(admin, f"{run_name}-other")
        reader = admin.post("/v1/tokens", json={"role": "read", "name": "r"}).json()["token"]
        revoked = created_token(admin, run_name, "v")
        admin.delete(f"/v1/tokens/{revoked['id']}").raise_for_status()
        expired = created_token(admin, run_name, "e")
        expire(postgres, expired["id"])
        admin.post(f"/v1/attempts/{old['attempt_id']}/heartbeat", json={"step": 4})
        before = written(postgres, run_name)
        beat = f"/v1/attempts/{old['attempt_id']}/heartbeat"
        for who, body, status, said in [
            (other, {"step": 5}, 403, "may not write run"),  # a token of another run
            (reader, {"step": 5}, 403, "read-only"),
            (revoked["token"], {"step": 5}, 401, "unknown or revoked token"),
            (expired["token"], {"step": 5}, 401, "expired at"),
            ("no-such-token", {"step": 5}, 401, "unknown or revoked token"),
            (token, {"step": 5000}, 422, "CKPT_MAX_STEP_ADVANCE"),  # too far ahead
        ]:
            with postgres.client(who) as client:
                answer = client.post(beat, json=body)
            assert answer.status_code == status, answer.text
            assert said in answer.json()["message"], answer.text
        with postgres.client(token) as client:
            assert client.post("/v1/attempts/999999999/heartbeat", json={}).status_code == 404
        with postgres.client("no-such-token") as client:  # who, before what
            assert client.post("/v1/attempts/999999999/heartbeat", json={}).status_code == 401
        assert written(postgres, run_name) == before
        register(admin, run_name)  # fences the old attempt
        fenced = written(postgres, run_name)
        with postgres.client(token) as client:
            answer = client.post(beat, json={"step": 5})
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"] == "fenced"
        assert written(postgres, run_name) == fenced
