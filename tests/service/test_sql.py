"""The SQL idioms of service/sql.py, on PostgreSQL and SQLite."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, select

from service.models import Attempt, Run, utcnow
from service.sql import detached, ids_in, take_changes
from tests.service.conftest import MakeServer


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_ids_in_matches_exactly_the_ids_given_however_many(
    make_server: MakeServer, backend: str
) -> None:
    server = make_server(backend)
    with server.context.transaction() as session:
        session.add_all(Run(name=f"run-{i}", created_at=utcnow()) for i in range(30))
    with server.context.transaction() as session:
        every = sorted(session.scalars(select(Run.id)))
        for wanted in ([], [every[3]], every[::2], [*every, 10**12]):
            found = session.scalars(select(Run.id).where(ids_in(session, Run.id, wanted)))
            assert sorted(found) == sorted(set(wanted) & set(every))


def test_a_detached_row_gives_exactly_what_changed_and_no_session_writes_it() -> None:
    started = utcnow()
    values = {"id": 7, "run_id": 3, "epoch": 2, "started_at": started, "last_step": 10}
    attempt = detached(Attempt, values | {"heartbeat_at": started, "pod": "p"})
    assert inspect(attempt).session is None
    assert attempt.last_step == 10 and attempt.pod == "p"
    assert take_changes(attempt) == {}
    attempt.last_step = 11  # changed
    attempt.epoch = 2  # set to what it was: not a change
    attempt.heartbeat_at = None  # cleared: a change
    attempt.node = "n"  # not read, now set
    assert take_changes(attempt) == {"last_step": 11, "heartbeat_at": None, "node": "n"}
    assert take_changes(attempt) == {}  # taken: marked as written
    assert attempt.last_step == 11 and attempt.heartbeat_at is None
