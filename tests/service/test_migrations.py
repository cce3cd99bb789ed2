"""The Alembic migrations and ``service.models`` agree, on PostgreSQL and on SQLite, and the
migrations go down and up again cleanly."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Column, Connection, Engine, Integer, MetaData, String, inspect, select, text
from sqlalchemy.orm import Session

from service.db import alembic_config, make_engine, schema_revision, upgrade
from service.models import Base
from service.runs.activity import refresh_activity
from tests.service.conftest import create_pg_database, drop_pg_database

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture(params=["postgres", "sqlite"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: a new PostgreSQL database or a new SQLite file."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'catalog.db'}"
        return
    url = create_pg_database()
    try:
        yield url
    finally:
        drop_pg_database(url)


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    try:
        yield engine
    finally:
        engine.dispose()


def diff(engine: Engine, metadata: MetaData = Base.metadata) -> list[Any]:
    """What autogenerate would change to bring the database to ``metadata``."""
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return list(compare_metadata(context, metadata))


def tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def model_tables() -> set[str]:
    return set(Base.metadata.tables)


def head_revision(url: str) -> str:
    heads = ScriptDirectory.from_config(alembic_config(url)).get_heads()
    assert len(heads) == 1, f"the migrations must have one head, not {heads}"
    return heads[0]


def copy_of_models() -> MetaData:
    metadata = MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(metadata)
    return metadata


def test_a_fresh_database_starts_at_no_revision(database_url: str, engine: Engine) -> None:
    assert tables(engine) == set()
    assert schema_revision(engine) == (None, head_revision(database_url))
    # Not upgraded yet, the agreement check sees every model table as missing.
    added = {change[1].name for change in diff(engine) if change[0] == "add_table"}
    assert added == model_tables()


def test_migrations_and_models_agree(database_url: str, engine: Engine) -> None:
    upgrade(database_url)
    assert tables(engine) == model_tables() | {"alembic_version"}
    assert diff(engine) == []
    head = head_revision(database_url)
    assert schema_revision(engine) == (head, head)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    url = create_pg_database()
    try:
        yield url
    finally:
        drop_pg_database(url)


def test_postgresql_leaves_room_for_a_blobs_commit_and_compresses_manifests_with_lz4(
    postgres_url: str,
) -> None:
    # A blob's row is updated once, by its bundle's commit: with half of each page free the
    # update stays on the page (a heap-only tuple, no new primary-key entry). SQLite has
    # neither setting.
    upgrade(postgres_url)
    engine = make_engine(postgres_url)
    try:
        with engine.connect() as connection:
            options = connection.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = 'blob'")
            ).scalar()
            lz4 = connection.execute(
                text(
                    "SELECT 'lz4' = ANY(enumvals) FROM pg_settings "
                    "WHERE name = 'default_toast_compression'"
                )
            ).scalar()
            compression = {
                table: connection.execute(
                    text(
                        "SELECT attcompression FROM pg_attribute "
                        "WHERE attrelid = CAST(:table AS regclass) AND attname = :column"
                    ),
                    {"table": table, "column": column},
                ).scalar()
                for table, column in (("bundle", "manifest"), ("layer", "record"))
            }
    finally:
        engine.dispose()
    assert options == ["fillfactor=50"]
    if lz4:
        assert compression == {"bundle": "l", "layer": "l"}


def test_the_agreement_check_sees_an_extra_column(database_url: str, engine: Engine) -> None:
    upgrade(database_url)
    metadata = copy_of_models()
    assert diff(engine, metadata) == []  # the copy alone changes nothing
    metadata.tables["run"].append_column(Column("extra", Integer, nullable=True))
    changes = diff(engine, metadata)
    assert len(changes) == 1, changes
    kind, schema, table, column = changes[0]
    assert (kind, schema, table, column.name) == ("add_column", None, "run", "extra")


def test_the_agreement_check_sees_a_changed_type(database_url: str, engine: Engine) -> None:
    upgrade(database_url)
    metadata = copy_of_models()
    metadata.tables["bundle"].c.world_size.type = String(32)
    changes = diff(engine, metadata)
    assert len(changes) == 1, changes
    (change,) = changes[0]  # column modifications come grouped in a list
    assert change[0] == "modify_type"
    assert (change[2], change[3]) == ("bundle", "world_size")


def test_the_agreement_check_sees_a_table_the_models_lack(
    database_url: str, engine: Engine
) -> None:
    upgrade(database_url)
    metadata = copy_of_models()
    metadata.remove(metadata.tables["token"])
    changes = diff(engine, metadata)
    assert [(change[0], change[1].name) for change in changes] == [("remove_table", "token")]


def test_upgrading_twice_is_a_no_op(database_url: str, engine: Engine) -> None:
    upgrade(database_url)
    run = Base.metadata.tables["run"]
    with engine.begin() as connection:
        connection.execute(run.insert().values(name="kept", created_at=NOW, epoch=3))
    before = schema_revision(engine)

    upgrade(database_url)

    assert schema_revision(engine) == before
    assert tables(engine) == model_tables() | {"alembic_version"}
    assert diff(engine) == []
    with engine.connect() as connection:
        rows = connection.execute(select(run.c.name, run.c.epoch, run.c.created_at)).all()
    assert [tuple(row) for row in rows] == [("kept", 3, NOW)]


def test_downgrade_to_base_and_upgrade_again(database_url: str, engine: Engine) -> None:
    head = head_revision(database_url)
    upgrade(database_url)
    assert schema_revision(engine) == (head, head)

    command.downgrade(alembic_config(database_url), "base")

    assert tables(engine) <= {"alembic_version"}
    assert schema_revision(engine) == (None, head)

    upgrade(database_url)

    assert tables(engine) == model_tables() | {"alembic_version"}
    assert diff(engine) == []
    assert schema_revision(engine) == (head, head)


def test_saves_get_their_bundles_run(database_url: str, engine: Engine) -> None:
    """The migration that gives each save its run fills it in from the save's bundle."""
    command.upgrade(alembic_config(database_url), "2026_11_30_0006")
    run, bundle, save = (Base.metadata.tables[name] for name in ("run", "bundle", "save"))
    with engine.begin() as connection:
        for run_id in (1, 2):
            connection.execute(
                run.insert().values(id=run_id, name=f"run-{run_id}", created_at=NOW, epoch=1)
            )
        for bundle_id, run_id in ((10, 1), (11, 2), (12, 2)):
            connection.execute(
                bundle.insert().values(
                    id=bundle_id,
                    run_id=run_id,
                    step=bundle_id,
                    world_size=2,
                    status="complete",
                    pinned=False,
                    created_at=NOW,
                    versions={},
                )
            )
        for save_id, (bundle_id, rank) in enumerate(((10, 0), (10, 1), (11, 0), (12, 1))):
            connection.execute(
                save.insert().values(
                    id=save_id + 1,
                    bundle_id=bundle_id,
                    rank=rank,
                    stall_seconds=0.1,
                    persist_seconds=1.0,
                    payload_bytes=100,
                    new_bytes=10,
                    reported_at=NOW,
                )
            )

    upgrade(database_url)

    assert diff(engine) == []
    with engine.connect() as connection:
        rows = connection.execute(select(save.c.bundle_id, save.c.rank, save.c.run_id)).all()
    assert sorted(tuple(row) for row in rows) == [(10, 0, 1), (10, 1, 1), (11, 0, 2), (12, 1, 2)]


def test_runs_get_their_state_activity_and_figures(database_url: str, engine: Engine) -> None:
    """The migration that keeps each run's state, activity and attempt figures fills them in
    from the run's attempts (a run without one is new, active when it was created), as the
    service itself computes them."""
    command.upgrade(alembic_config(database_url), "2026_11_30_0007")
    run, attempt, bundle = (Base.metadata.tables[name] for name in ("run", "attempt", "bundle"))
    later = NOW + timedelta(minutes=5)
    with engine.begin() as connection:
        for run_id in (1, 2, 3):
            connection.execute(
                run.insert().values(id=run_id, name=f"run-{run_id}", created_at=NOW, epoch=2)
            )
        connection.execute(
            bundle.insert().values(
                id=10,
                run_id=1,
                step=20,
                world_size=1,
                status="complete",
                pinned=False,
                created_at=NOW,
                versions={},
            )
        )
        attempts = [  # (id, run, epoch, heartbeat, ended, reason, last step, resumed from)
            (1, 1, 1, NOW, NOW, "preempted", 30, None),
            (2, 1, 2, later, None, None, 50, 10),
            (3, 2, 1, NOW, None, None, None, None),
            (4, 2, 2, NOW, later, "lost", None, None),
        ]
        for id_, run_id, epoch, beat, ended, reason, last_step, resumed in attempts:
            connection.execute(
                attempt.insert().values(
                    id=id_,
                    run_id=run_id,
                    epoch=epoch,
                    started_at=NOW,
                    heartbeat_at=beat,
                    ended_at=ended,
                    end_reason=reason,
                    last_step=last_step,
                    resumed_from_id=resumed,
                )
            )

    upgrade(database_url)

    assert diff(engine) == []
    activity = Base.metadata.tables["run_activity"]
    # run 1: epoch 1 lost steps 20 to 30; computed 30 + 30 (60), 30 before the newest
    expected = [
        (1, "training", later, 2, 1, 10, 60, 30, 1),
        (2, "lost", later, 2, 0, 0, 0, 0, 0),
        (3, "new", NOW, 0, 0, 0, 0, 0, 0),
    ]
    with engine.connect() as connection:
        rows = connection.execute(select(activity).order_by(activity.c.run_id)).all()
    assert [(*row[:-1],) for row in rows] == expected
    assert {row.writes for row in rows} == {0}
    with Session(engine) as session, session.begin():
        refresh_activity(session, run_ids=[1, 2, 3])
    with engine.connect() as connection:
        rows = connection.execute(select(activity).order_by(activity.c.run_id)).all()
    assert [(*row[:-1],) for row in rows] == expected
    assert {row.writes for row in rows} == {1}


def _one_bundle(connection: Connection, *, world_size: int) -> None:
    """Run 1, its attempt 1 and its complete bundle 10 at step 6, in the schema as it is."""
    tables = Base.metadata.tables
    connection.execute(tables["run"].insert().values(id=1, name="run-1", created_at=NOW, epoch=1))
    connection.execute(tables["attempt"].insert().values(id=1, run_id=1, epoch=1, started_at=NOW))
    connection.execute(
        tables["bundle"]
        .insert()
        .values(
            id=10,
            run_id=1,
            attempt_id=1,
            step=6,
            world_size=world_size,
            status="complete",
            pinned=False,
            created_at=NOW,
            versions={},
        )
    )


def test_bundles_keep_their_layers_and_saves_and_are_at_micro_step_zero(
    database_url: str, engine: Engine
) -> None:
    """The migration that names a bundle by (step, micro step) rebuilds the bundle table
    (SQLite copies it): every bundle and what references it stays, at micro step 0."""
    command.upgrade(alembic_config(database_url), "2026_12_03_0013")
    bundle, layer = Base.metadata.tables["bundle"], Base.metadata.tables["layer"]
    with engine.begin() as connection:
        _one_bundle(connection, world_size=1)
        connection.execute(
            layer.insert().values(
                bundle_id=10, rank=0, layer="weights", payload_bytes=1, record={}, recorded_at=NOW
            )
        )

    upgrade(database_url)

    assert diff(engine) == []
    later = {
        "run_id": 1,
        "attempt_id": 1,
        "step": 6,
        "world_size": 1,
        "status": "complete",
        "pinned": False,
        "created_at": NOW,
        "versions": {},
    }
    with engine.begin() as connection:
        connection.execute(bundle.insert().values(id=11, micro_step=2, **later))
        rows = connection.execute(select(bundle.c.id, bundle.c.micro_step)).all()
        layers = connection.execute(select(layer.c.bundle_id)).all()
    assert sorted(tuple(row) for row in rows) == [(10, 0), (11, 2)]
    assert [tuple(row) for row in layers] == [(10,)]


def test_saves_reported_before_the_tax_have_none_and_keep_it_through_a_downgrade(
    database_url: str, engine: Engine
) -> None:
    """The migration that adds the save tax leaves every earlier save's figures as they were,
    without a tax; going down drops the tax and keeps the save."""
    command.upgrade(alembic_config(database_url), "2026_12_05_0016")
    save = Base.metadata.tables["save"]
    figures = {"stall_seconds": 0.1, "persist_seconds": 1.0, "payload_bytes": 100, "new_bytes": 10}
    with engine.begin() as connection:
        _one_bundle(connection, world_size=2)
        connection.execute(
            save.insert().values(bundle_id=10, run_id=1, rank=0, reported_at=NOW, **figures)
        )

    upgrade(database_url)

    assert diff(engine) == []
    with engine.begin() as connection:
        connection.execute(
            save.insert().values(
                bundle_id=10, run_id=1, rank=1, reported_at=NOW, tax_seconds=0.5, **figures
            )
        )
        rows = connection.execute(
            select(save.c.rank, save.c.stall_seconds, save.c.tax_seconds).order_by(save.c.rank)
        ).all()
    assert [tuple(row) for row in rows] == [(0, 0.1, None), (1, 0.1, 0.5)]

    command.downgrade(alembic_config(database_url), "2026_12_05_0016")

    columns = {column["name"] for column in inspect(engine).get_columns("save")}
    assert "tax_seconds" not in columns
    indexes = {
        index["name"]: index["column_names"] for index in inspect(engine).get_indexes("save")
    }
    assert "tax_seconds" not in indexes["ix_save_run_figures"]
    with engine.connect() as connection:
        kept = connection.execute(text("SELECT rank FROM save ORDER BY rank")).all()
    assert [tuple(row) for row in kept] == [(0,), (1,)]
