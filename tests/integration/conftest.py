"""Fixtures the integration tests share."""

from __future__ import annotations

from typing import Any

import pytest

from tests.service.conftest import create_pg_database, drop_pg_database


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> Any:
    """A control plane's catalog: its embedded SQLite (None), then a fresh PostgreSQL
    database, dropped after the test."""
    if request.param == "sqlite":
        yield None
        return
    url = create_pg_database()
    yield url
    drop_pg_database(url)
