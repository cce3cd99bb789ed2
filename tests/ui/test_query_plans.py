"""The dashboard's SQL uses indexes: every scan of ``bundle`` behind its pages is driven by
an index, on PostgreSQL, for a catalog small enough to seed in a second (the benchmark,
``bench/dashboard.py``, checks the same at full size: 5,000 runs and a run of 10,000
bundles). The planner is told to avoid sequential scans and hash and merge joins, so on a
small table too the plan shows a scan without an index condition only where no index can
serve."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db import make_engine, upgrade
from service.models import RunActivity
from service.runs.activity import refresh_activity
from tests.service.conftest import create_pg_database, drop_pg_database
from tests.ui.plans import page_plans
from tests.ui.seed import Shape, seed

SMALL = Shape(runs=2000, bundles_per_run=10, attempts_per_run=3, big_attempts=100, big_bundles=1000)


@pytest.fixture
def database() -> Iterator[str]:
    """A throwaway PostgreSQL database (the test is skipped without a server, unless
    CKPT_REQUIRE_POSTGRES is set)."""
    url = create_pg_database()
    yield url
    drop_pg_database(url)


def test_no_page_scans_bundles_without_an_index(tmp_path: Path, database: str) -> None:
    url = database
    upgrade(url)
    engine = make_engine(url)
    seed(engine, SMALL)
    engine.dispose()
    paths = [
        "/ui/",
        "/ui/?state=lost",
        "/ui/?prefix=run-001",
        "/ui/?page=4",
        f"/ui/runs/{SMALL.big_run}",
        f"/ui/runs/{SMALL.big_run}/live",
        "/ui/runs/run-00007",
        "/ui/runs/run-00007/bundles/75",  # runs are seeded in order, 10 bundles each
    ]
    plans = page_plans(url, paths, store=tmp_path / "store", prefer_indexes=True)
    assert {plan.path for plan in plans} == set(paths)
    bad = {
        f"{plan.path}: {scan}\n{plan.statement}\n{plan.text()}"
        for plan in plans
        for scan in plan.bad_scans()
    }
    assert bad == set(), "\n\n".join(sorted(bad))


def test_no_api_read_scans_bundles_without_an_index(tmp_path: Path, database: str) -> None:
    """The API's hot reads too; a page of a long lineage among them, which walked the whole
    primary key back from the catalog's newest bundle before ``bundle (run_id, id)``."""
    upgrade(database)
    engine = make_engine(database)
    seed(engine, SMALL)
    engine.dispose()
    big = f"/v1/runs/{SMALL.big_run}"
    paths = [
        "/v1/runs/run-00007/resumable",
        "/v1/runs?limit=50",
        "/v1/runs?limit=50&after=run-00005",
        "/v1/runs/run-00007",
        "/v1/runs/run-00007/lineage",
        f"{big}/lineage",
        f"{big}/lineage?limit=100",
        f"{big}/lineage?limit=100&before=20500",
    ]
    plans = page_plans(database, paths, store=tmp_path / "store", prefer_indexes=True, api=True)
    assert {plan.path for plan in plans} == set(paths)
    bad = {
        f"{plan.path}: {scan}\n{plan.statement}\n{plan.text()}"
        for plan in plans
        for scan in plan.bad_scans()
    }
    assert bad == set(), "\n\n".join(sorted(bad))


def test_the_seeded_figures_are_the_services(database: str) -> None:
    """The seed writes each run's ``run_activity`` row itself (in bulk); the service, asked
    to compute them from the attempts, finds the same: the benchmark measures real rows."""
    upgrade(database)
    engine = make_engine(database)
    seed(engine, Shape(runs=40, big_attempts=250, big_bundles=1200))
    activity = RunActivity.__table__
    figures = select(*(c for c in activity.c if c.name != "writes")).order_by(activity.c.run_id)
    with engine.connect() as connection:
        seeded = connection.execute(figures).all()
    with Session(engine) as session, session.begin():
        refresh_activity(session, run_ids=[row.run_id for row in seeded])
    with engine.connect() as connection:
        computed = connection.execute(figures).all()
    engine.dispose()
    assert len(seeded) == 41
    assert computed == seeded
