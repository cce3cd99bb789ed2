"""The API description against the server: schemathesis generates requests from
``/openapi.json`` (valid and invalid ones, and sequences that follow the links it infers) and
sends them to a real ``ckpt server`` process on PostgreSQL, over HTTP.

Every answer must be documented: no server error, no status code the route does not
document, every body and header as documented, and no route that answers without a token
when it declares the bearer scheme. The number of cases is bounded (``--max-examples``, a
fixed seed) so that the run stays well under a minute.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_process import ServerProcess, ckpt_server
from tests.service.conftest import create_pg_database

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "ignored_auth",
)


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory, pg_databases: list[str]
) -> Iterator[ServerProcess]:
    """``ckpt server`` on a fresh PostgreSQL database (dropped at the end of the session),
    without a rate limit, so that the generated requests reach the routes (a 429 is
    documented, but would test nothing)."""
    database_url = create_pg_database()
    pg_databases.append(database_url)
    env = {"CKPT_RATE_LIMIT_PER_SECOND": "0"}
    with ckpt_server(tmp_path_factory.mktemp("st"), database_url=database_url, env=env) as server:
        yield server


def schemathesis(
    server: ServerProcess, token: str, report: Path, *, max_examples: int, phases: str
) -> dict[str, Any]:
    """``st run`` against ``server`` with ``token``; returns its JSON report."""
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json"),
        *("--header", f"Authorization: Bearer {token}"),
        *("--checks", ",".join(CHECKS)),
        *("--phases", phases),
        *("--max-examples", str(max_examples)),
        *("--seed", "20261130"),
        "--no-shrink",
        *("--generation-database", "none"),  # each run alike: nothing replayed from the last
        # One worker: with several, CPython 3.11's ast.parse, which Hypothesis calls to
        # describe its filters, can fail across threads ("AST constructor recursion depth
        # mismatch"), an error of the run rather than of the server.
        *("--workers", "1"),
        *("--request-timeout", "30"),
        *("--warnings", "off"),
        *("--report", "json", "--report-json-path", str(report)),
    ]
    # In its own folder: no schemathesis.toml applies, and its crash cache stays out of the tree.
    done = subprocess.run(
        command, cwd=report.parent, capture_output=True, text=True, timeout=300, check=False
    )
    assert report.exists(), done.stdout[-5000:] + done.stderr[-5000:]
    result: dict[str, Any] = json.loads(report.read_text())
    assert result["failures"] == [] and result["errors"] == [], done.stdout[-20000:]
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
    return result


def assert_every_operation_tested(result: dict[str, Any]) -> None:
    operations = result["operations"]
    assert operations["tested"] == operations["total"] > 20, operations
    assert result["complete"], result["stop_reason"]


def test_the_api_as_an_admin(live: ServerProcess, tmp_path: Path) -> None:
    result = schemathesis(
        live,
        live.token,
        tmp_path / "admin.json",
        max_examples=15,
        phases="examples,coverage,fuzzing,stateful",
    )
    assert_every_operation_tested(result)
    assert result["test_cases"]["generated"] > 500, result["test_cases"]


def test_the_api_as_a_run_token(live: ServerProcess, tmp_path: Path) -> None:
    """A run token: most routes answer 403 or 404 for the runs schemathesis makes up, and
    those answers must be documented too."""
    with live.client() as admin:
        created = admin.post(
            "/v1/tokens", json={"role": "run", "run": "schemathesis", "name": "schemathesis"}
        )
    assert created.status_code == 201, created.text
    result = schemathesis(
        live,
        created.json()["token"],
        tmp_path / "run.json",
        max_examples=5,
        phases="coverage,fuzzing",
    )
    assert_every_operation_tested(result)
    with httpx.Client(timeout=60, base_url=live.url) as anonymous:
        assert anonymous.get("/healthz").status_code == 200  # still up
