"""A commit finds its blobs' catalog rows through the primary key, whatever the blob
table's size.

PostgreSQL's default price of a random page (4, a spinning disk's) made the lock and the
update of a commit's 1,000 blob rows scan the whole blob table until it held 100,000-150,000
rows: 13 ms each at 60,000 rows and growing with every commit, against 5 ms through the
index.
The control plane's connections price a random page at 1.1 (``service.db``).
"""

from __future__ import annotations

import hashlib

from sqlalchemy.orm import Session

from service.bundles import repository
from service.db import make_engine
from service.models import utcnow
from tests.service.conftest import Catalogs
from tests.ui.plans import Plan, explain, nodes, recorded, shown

ROWS = 60_000  # at 4, a sequential scan: up to 100,000 rows here, a bitmap scan from 150,000


def test_a_commits_blob_rows_are_found_through_the_primary_key(catalogs: Catalogs) -> None:
    url = catalogs.postgres()
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            connection.exec_driver_sql(
                "INSERT INTO blob (sha256, size, created_at, claimed_at) "
                "SELECT encode(sha256(int8send(n)), 'hex'), 4096, now(), now() "
                f"FROM generate_series(1, {ROWS}) AS n"
            )
            connection.exec_driver_sql("ANALYZE blob")
        shas = {hashlib.sha256(n.to_bytes(8, "big")).hexdigest() for n in range(1, 1001)}
        with (
            Session(engine) as session,
            recorded(engine, kinds=("SELECT", "UPDATE")) as statements,
        ):
            locked = repository.lock_blobs(session, shas=shas)
            repository.mark_verified(
                session, sizes=dict.fromkeys(shas, 4096), hashed=shas, at=utcnow(), locked=locked
            )
            session.rollback()
        assert len(locked) == 1000
        plans = {
            statement.split()[0]: Plan(
                "a commit",
                statement,
                explain(engine, statement, parameters, prefer_indexes=False),
            )
            for statement, parameters in statements
        }
    finally:
        engine.dispose()
        catalogs.give_back(url)
    assert set(plans) == {"SELECT", "UPDATE"}
    for plan in plans.values():
        scans = [
            node["Node Type"]
            for node in nodes(plan.plan)
            if node.get("Relation Name") == "blob" and "Scan" in node["Node Type"]
        ]
        assert scans and "Seq Scan" not in scans, shown(plan)
