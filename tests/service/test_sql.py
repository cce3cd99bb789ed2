"""The SQL idioms of service/sql.py, on PostgreSQL and SQLite."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from service.models import Run, utcnow
from service.sql import ids_in
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
