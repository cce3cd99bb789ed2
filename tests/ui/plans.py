"""The SQL behind the dashboard's pages, and PostgreSQL's plans for it.

``page_plans`` serves the app in this process on a seeded database, signs in (or, for the
API, sends the admin token), requests each page while recording every SELECT its engine
runs, then asks PostgreSQL to ``EXPLAIN`` each one (its parameters bound client-side, so
the plan is the one for those values).
``bad_scans`` names the scans of ``bundle`` that no index drives: a sequential scan, or an
index walked whole (no index condition). With ``prefer_indexes`` the planner may use neither
sequential scans nor hash or merge joins (which read a whole side): on a small table too,
the plan then shows a scan without an index condition only where no index can serve.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
from sqlalchemy import Engine, event

from service.app import create_app
from service.context import Context
from service.settings import Settings
from tests.service.conftest import serve
from tests.ui.signin import signed_in_client

TABLE = "bundle"
INDEXES = {f"pk_{TABLE}"}  # and every ix_bundle_..., uq_bundle_... (the naming convention)
TOKEN = "plans-admin-token-0123456789"


@dataclass(frozen=True)
class Plan:
    path: str  # the page that ran it
    statement: str
    plan: dict[str, Any]  # EXPLAIN (FORMAT JSON)'s top node

    def bad_scans(self) -> list[str]:
        return list(_bad_scans(self.plan))

    def text(self) -> str:
        return "\n".join(_lines(self.plan, depth=0))


# Printed shorter: long lists of bound values in a statement, arrays of ids inlined in a plan.
_BIND_LIST = re.compile(r"(%\(\w+\)s(::\w+)?, ){3,}")
_ARRAY = re.compile(r"'\{([^}']{30})[^}']+\}'")


def shown(plan: Plan) -> str:
    """The statement and its plan for printing, long lists of values shortened (bound ones
    in the statement, ids inlined in the plan)."""
    statement = _BIND_LIST.sub("..., ", plan.statement)
    return statement + "\n" + _ARRAY.sub(r"'{\1...}'", plan.text())


@contextmanager
def recorded(
    engine: Engine, *, kinds: tuple[str, ...] = ("SELECT", "WITH")
) -> Iterator[list[tuple[str, Any]]]:
    """Every statement of these ``kinds`` ``engine`` runs meanwhile, with its parameters."""
    seen: list[tuple[str, Any]] = []

    def before(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(kinds):
            seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", before)


PREFER_INDEXES = ("enable_seqscan", "enable_hashjoin", "enable_mergejoin")


def explain(
    engine: Engine, statement: str, parameters: Any, *, prefer_indexes: bool
) -> dict[str, Any]:
    """PostgreSQL's plan of ``statement``, its parameters inlined by psycopg."""
    with engine.connect() as connection:
        raw = connection.connection.driver_connection
        assert isinstance(raw, psycopg.Connection)
        with psycopg.ClientCursor(raw) as cursor:
            for setting in PREFER_INDEXES if prefer_indexes else ():
                cursor.execute(f"SET LOCAL {setting} = off")
            cursor.execute("EXPLAIN (FORMAT JSON) " + statement, parameters or None)
            row = cursor.fetchone()
        connection.rollback()
    assert row is not None
    found = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    top: dict[str, Any] = found[0]["Plan"]
    return top


def page_plans(
    database_url: str,
    paths: Iterable[str],
    *,
    store: Path,
    prefer_indexes: bool = False,
    api: bool = False,
) -> list[Plan]:
    """The plan of every SELECT each page of ``paths`` ran, served from ``database_url``
    (``api``: paths of the REST API, asked with the admin token)."""
    settings = Settings(
        database_url=database_url,
        store=str(store),
        admin_token=TOKEN,
        admin_token_file=str(store.parent / "admin-token"),
        auto_migrate=False,
        gc_interval_seconds=0,
        scrub_interval_seconds=0,
        lost_after_seconds=10**6,
    )
    context = Context.create(settings)
    url, stop = serve(create_app(settings, context=context))
    try:
        statements: list[tuple[str, str, Any]] = []
        with _client(url, api=api) as client:
            for path in paths:
                with recorded(context.engine) as seen:
                    answer = client.get(path)
                assert answer.status_code == 200, (path, answer.status_code)
                statements += [(path, statement, params) for statement, params in seen]
        return [
            Plan(
                path,
                statement,
                explain(context.engine, statement, params, prefer_indexes=prefer_indexes),
            )
            for path, statement, params in statements
        ]
    finally:
        stop()
        context.close()


@contextmanager
def _client(url: str, *, api: bool) -> Iterator[httpx.Client]:
    if not api:
        with signed_in_client(url, TOKEN) as client:
            yield client
        return
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=bearer, timeout=60) as client:
        yield client


def nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A plan's node and every node below it."""
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


def _bad_scans(top: dict[str, Any]) -> Iterator[str]:
    for node in nodes(top):
        kind = node["Node Type"]
        index = str(node.get("Index Name", ""))
        on_bundle = (
            node.get("Relation Name") == TABLE
            or index in INDEXES
            or index.startswith(tuple(f"{kind}_{TABLE}_" for kind in ("ix", "uq")))
        )
        if not on_bundle:
            continue
        if kind == "Seq Scan":
            yield f"Seq Scan on {TABLE}"
        elif "Index" in kind and "Index Cond" not in node:
            yield f"{kind} using {node.get('Index Name')} with no index condition"


def _lines(node: dict[str, Any], *, depth: int) -> Iterator[str]:
    what = [node["Node Type"]]
    if "Relation Name" in node:
        what.append(f"on {node['Relation Name']}")
    if "Index Name" in node:
        what.append(f"using {node['Index Name']}")
    for key in ("Index Cond", "Recheck Cond", "Hash Cond", "Merge Cond", "Join Filter", "Filter"):
        if key in node:
            what.append(f"[{key}: {node[key]}]")
    rows = f"(rows={node.get('Plan Rows')})"
    yield f"{'  ' * depth}-> {' '.join(what)} {rows}"
    for child in node.get("Plans", []):
        yield from _lines(child, depth=depth + 1)
