"""The authorization matrix: every endpoint of the app against every kind of caller.

Each principal gets a fresh control plane with one run (a complete bundle, a pending bundle,
a live attempt) and another run; the test walks the whole table in order (the writes that
fence the live attempt come last) and reports every wrong cell at once.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from ckpt.core.contract import RESTORE_ORDER
from service.models import Base, Token
from tests.service.conftest import Server
from tests.service.helpers import make_layer, open_bundle, record, register, save

PRINCIPALS = ["none", "garbage", "revoked", "read", "other", "own", "admin"]
UNAUTHENTICATED = {"none", "garbage", "revoked"}


class Access(enum.Enum):
    OPEN = "open to everyone, no token needed"
    ANY = "any valid token"
    READ = "reads the run: admin, read tokens and the run's own token"
    WRITE = "writes the run: admin and the run's own token"
    WRITER = "any token that may write some run"
    ADMIN = "admin only"


ALLOWED: dict[Access, set[str]] = {
    Access.OPEN: set(PRINCIPALS),
    Access.ANY: {"read", "other", "own", "admin"},
    Access.READ: {"read", "own", "admin"},
    Access.WRITE: {"own", "admin"},
    Access.WRITER: {"other", "own", "admin"},
    Access.ADMIN: {"admin"},
}


@dataclass
class World:
    """What the table's requests point at."""

    run: str
    other_run: str
    complete_id: int  # a complete bundle of the run (its first attempt's)
    blob: str  # a blob of it
    pending_id: int  # a pending bundle of the live attempt, every layer but the last recorded
    old_attempt: int  # the first attempt, fenced
    live: dict[str, Any]  # the live attempt's registration
    last_layer: dict[str, Any]  # the record of the pending bundle's missing layer
    spare_token_id: int  # a token any admin call may revoke
    tokens: dict[str, str | None] = field(default_factory=dict)  # principal -> bearer token


@dataclass(frozen=True)
class Row:
    method: str
    template: str  # the OpenAPI path
    access: Access
    status: int  # what an allowed principal gets
    path: Callable[[World], str]
    body: Callable[[World], Any] | None = None
    check: Callable[[str, World, httpx.Response], str | None] | None = None
    in_schema: bool = True
    overrides: dict[str, int] = field(default_factory=dict)  # principal -> status


def _listed_runs(principal: str, world: World, response: httpx.Response) -> str | None:
    names = [run["name"] for run in response.json()["runs"]]
    expected = {
        "other": [world.other_run],
        "own": [world.run],
    }.get(principal, sorted([world.run, world.other_run]))
    return None if names == expected else f"lists runs {names}, expected {expected}"


def _resumable(_: str, world: World, response: httpx.Response) -> str | None:
    found = response.json()["bundle_id"]
    return None if found == world.complete_id else f"resumes from {found}"


# In order: reads first, then writes, the ones that fence the live attempt last.
TABLE: list[Row] = [
    Row("GET", "/healthz", Access.OPEN, 200, lambda w: "/healthz"),
    Row("GET", "/readyz", Access.OPEN, 200, lambda w: "/readyz"),
    Row("GET", "/metrics", Access.OPEN, 200, lambda w: "/metrics"),
    Row("GET", "/docs", Access.OPEN, 200, lambda w: "/docs", in_schema=False),
    Row("GET", "/openapi.json", Access.OPEN, 200, lambda w: "/openapi.json", in_schema=False),
    Row("GET", "/v1/runs", Access.ANY, 200, lambda w: "/v1/runs", check=_listed_runs),
    Row("GET", "/v1/runs/{run}", Access.READ, 200, lambda w: f"/v1/runs/{w.run}"),
    Row(  # a run that does not exist: a run token may not read it either way
        "GET",
        "/v1/runs/{run}",
        Access.READ,
        404,
        lambda w: f"/v1/runs/{w.run}-nope",
        overrides={"own": 403},
    ),
    Row(
        "GET",
        "/v1/runs/{run}/resumable",
        Access.READ,
        200,
        lambda w: f"/v1/runs/{w.run}/resumable",
        check=_resumable,
    ),
    Row("GET", "/v1/runs/{run}/lineage", Access.READ, 200, lambda w: f"/v1/runs/{w.run}/lineage"),
    Row("GET", "/v1/bundles/{bundle}", Access.READ, 200, lambda w: f"/v1/bundles/{w.complete_id}"),
    Row("GET", "/v1/bundles/{bundle}", Access.READ, 200, lambda w: f"/v1/bundles/{w.pending_id}"),
    Row("GET", "/v1/bundles/{bundle}", Access.ANY, 404, lambda w: "/v1/bundles/987654321"),
    Row(
        "GET",
        "/v1/bundles/{bundle}/events",
        Access.READ,
        200,
        lambda w: f"/v1/bundles/{w.complete_id}/events",
    ),
    Row("GET", "/v1/runs/{run}/events", Access.READ, 200, lambda w: f"/v1/runs/{w.run}/events"),
    Row(
        "POST",
        "/v1/blobs/missing",
        Access.WRITER,
        200,
        lambda w: "/v1/blobs/missing",
        body=lambda w: {"blobs": [{"sha256": "ab" * 32, "size": 3}]},
    ),
    Row(  # the run exists: a conflict, once the caller may write it
        "POST", "/v1/runs", Access.WRITE, 409, lambda w: "/v1/runs", body=lambda w: {"name": w.run}
    ),
    Row(  # a new run: a run token may create its own run only
        "POST",
        "/v1/runs",
        Access.WRITE,
        201,
        lambda w: "/v1/runs",
        body=lambda w: {"name": f"{w.run}-new"},
        overrides={"own": 403},
    ),
    Row(
        "PATCH",
        "/v1/runs/{run}",
        Access.WRITE,
        200,
        lambda w: f"/v1/runs/{w.run}",
        body=lambda w: {"keep_every": 100},
    ),
    Row(  # a run's dedup group decides which blobs its token may use: an admin's call
        "PATCH",
        "/v1/runs/{run}",
        Access.ADMIN,
        200,
        lambda w: f"/v1/runs/{w.run}",
        body=lambda w: {"dedup_group": "team"},
    ),
    Row(
        "POST",
        "/v1/runs/{run}/bundles",
        Access.WRITE,
        201,
        lambda w: f"/v1/runs/{w.run}/bundles",
        body=lambda w: {
            "attempt_id": w.live["attempt_id"],
            "epoch": w.live["epoch"],
            "step": 30,
            "world_size": 1,
            "versions": {"ckpt": "0.1.0", "python": "3.11", "torch": "2.13.0"},
        },
    ),
    Row(
        "PUT",
        "/v1/bundles/{bundle}/layers/{rank}/{layer}",
        Access.WRITE,
        200,
        lambda w: f"/v1/bundles/{w.pending_id}/layers/0/{RESTORE_ORDER[-1]}",
        body=lambda w: {"epoch": w.live["epoch"], "record": w.last_layer},
    ),
    Row(
        "POST",
        "/v1/bundles/{bundle}/layers/{rank}",
        Access.WRITE,
        200,
        lambda w: f"/v1/bundles/{w.pending_id}/layers/0",
        body=lambda w: {"epoch": w.live["epoch"], "layers": {RESTORE_ORDER[-1]: w.last_layer}},
    ),
    Row(
        "POST",
        "/v1/bundles/{bundle}/commit",
        Access.WRITE,
        200,
        lambda w: f"/v1/bundles/{w.pending_id}/commit",
        body=lambda w: {"epoch": w.live["epoch"]},
    ),
    Row(  # the live attempt names an intact blob: nothing is quarantined
        "POST",
        "/v1/bundles/{bundle}/quarantine",
        Access.WRITE,
        409,
        lambda w: f"/v1/bundles/{w.complete_id}/quarantine",
        body=lambda w: {"reason": "restore failed", "epoch": w.live["epoch"], "blob": w.blob},
    ),
    Row(
        "PATCH",
        "/v1/bundles/{bundle}",
        Access.WRITE,
        200,
        lambda w: f"/v1/bundles/{w.complete_id}",
        body=lambda w: {"pinned": True},
    ),
    Row(
        "PUT",
        "/v1/bundles/{bundle}/saves/{rank}",
        Access.WRITE,
        200,
        lambda w: f"/v1/bundles/{w.complete_id}/saves/0",
        body=lambda w: {
            "stall_seconds": 0.5,
            "persist_seconds": 2.0,
            "payload_bytes": 1024,
            "new_bytes": 512,
        },
    ),
    Row(
        "POST",
        "/v1/attempts/{attempt}/heartbeat",
        Access.WRITE,
        200,
        lambda w: f"/v1/attempts/{w.live['attempt_id']}/heartbeat",
        body=lambda w: {"step": 25, "fingerprints": [{"step": 25, "parts": {"params": "ab"}}]},
    ),
    Row(
        "GET",
        "/v1/attempts/{attempt}/replay",
        Access.READ,
        200,
        lambda w: f"/v1/attempts/{w.live['attempt_id']}/replay?rank=0&after_step=3",
    ),
    Row(
        "PUT",
        "/v1/attempts/{attempt}/verification",
        Access.WRITE,
        200,
        lambda w: f"/v1/attempts/{w.live['attempt_id']}/verification",
        body=lambda w: {
            "verdict": "unverifiable",
            "mode": "exact",
            "steps_compared": 0,
            "from_attempt_id": None,
        },
    ),
    Row(
        "POST",
        "/v1/attempts/{attempt}/notice",
        Access.WRITE,
        200,
        lambda w: f"/v1/attempts/{w.live['attempt_id']}/notice",
        body=lambda w: {"cloud": "aws", "kind": "rebalance"},
    ),
    Row(
        "GET",
        "/v1/runs/{run}/preemption-rate",
        Access.READ,
        200,
        lambda w: f"/v1/runs/{w.run}/preemption-rate",
    ),
    Row("GET", "/v1/runs/{run}/goodput", Access.READ, 200, lambda w: f"/v1/runs/{w.run}/goodput"),
    Row(
        "POST",
        "/v1/attempts/{attempt}/end",
        Access.WRITE,
        200,
        lambda w: f"/v1/attempts/{w.old_attempt}/end",
        body=lambda w: {"reason": "preempted", "final_save_committed": True},
    ),
    Row(
        "POST",
        "/v1/runs/{run}/attempts",
        Access.WRITE,
        201,
        lambda w: f"/v1/runs/{w.run}/attempts",
        body=lambda w: {"pod": "pod-9"},
    ),
    Row(
        "POST",
        "/v1/runs/{run}/rollback",
        Access.WRITE,
        200,
        lambda w: f"/v1/runs/{w.run}/rollback",
        body=lambda w: {"bundle_id": w.complete_id},
    ),
    Row("GET", "/v1/tokens", Access.ADMIN, 200, lambda w: "/v1/tokens"),
    Row(
        "POST",
        "/v1/tokens",
        Access.ADMIN,
        201,
        lambda w: "/v1/tokens",
        body=lambda w: {"role": "read"},
    ),
    Row(
        "DELETE",
        "/v1/tokens/{token_id}",
        Access.ADMIN,
        200,
        lambda w: f"/v1/tokens/{w.spare_token_id}",
    ),
    Row("POST", "/v1/gc", Access.ADMIN, 200, lambda w: "/v1/gc?dry_run=true"),
    Row("POST", "/v1/scrub", Access.ADMIN, 200, lambda w: "/v1/scrub"),
    Row(  # near the end: it sets the complete bundle aside; a run token sends no epoch here
        "POST",
        "/v1/bundles/{bundle}/quarantine",
        Access.WRITE,
        200,
        lambda w: f"/v1/bundles/{w.complete_id}/quarantine",
        body=lambda w: {"reason": "blob abc does not match its SHA-256"},
        overrides={"own": 409},
    ),
    Row(
        "POST",
        "/v1/bundles/{bundle}/unquarantine",
        Access.ADMIN,
        200,
        lambda w: f"/v1/bundles/{w.complete_id}/unquarantine",
    ),
]


def create_token(admin: httpx.Client, **body: Any) -> dict[str, Any]:
    response = admin.post("/v1/tokens", json=body)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def build_world(server: Server, run: str) -> World:
    other_run = f"{run}-other"
    with server.client() as admin:
        first = register(admin, run)
        complete = save(admin, server.store, run, first, step=10)
        live = register(admin, run)
        assert live["resume_from"]["bundle_id"] == complete["id"]
        opened = open_bundle(admin, run, live, step=20)
        assert opened.status_code == 201, opened.text
        pending_id = opened.json()["id"]
        for layer in RESTORE_ORDER[:-1]:
            rec, _ = make_layer(server.store)
            recorded = record(admin, pending_id, 0, layer, live["epoch"], rec)
            assert recorded.status_code == 200, recorded.text
        last, _ = make_layer(server.store)
        register(admin, other_run)

        revoked = create_token(admin, role="run", run=run, name="revoked")
        assert_status(server, revoked["token"], "GET", f"/v1/runs/{run}", 200)
        response = admin.delete(f"/v1/tokens/{revoked['id']}")
        assert response.status_code == 200, response.text
        assert response.json()["revoked_at"] is not None
        tokens: dict[str, str | None] = {
            "none": None,
            "garbage": "not-a-token-0123456789abcdef",
            "revoked": revoked["token"],
            "read": create_token(admin, role="read", name="reader")["token"],
            "other": create_token(admin, role="run", run=other_run, name="other")["token"],
            "own": create_token(admin, role="run", run=run, name="own")["token"],
            "admin": server.admin_token,
        }
        spare = create_token(admin, role="read", name="spare")
    return World(
        run=run,
        other_run=other_run,
        complete_id=complete["id"],
        blob=complete["manifest"]["ranks"][0]["layers"]["weights"]["blobs"][-1]["sha256"],
        pending_id=pending_id,
        old_attempt=first["attempt_id"],
        live=live,
        last_layer=last.model_dump(mode="json"),
        spare_token_id=spare["id"],
        tokens=tokens,
    )


def assert_status(server: Server, token: str, method: str, path: str, status: int) -> None:
    with server.client(token) as client:
        response = client.request(method, path)
    assert response.status_code == status, response.text


def expected_status(row: Row, principal: str) -> int:
    if principal in row.overrides:
        return row.overrides[principal]
    if principal in ALLOWED[row.access]:
        return row.status
    return 401 if principal in UNAUTHENTICATED else 403


@pytest.mark.parametrize("principal", PRINCIPALS)
def test_auth_matrix(server: Server, run_name: str, principal: str) -> None:
    world = build_world(server, run_name)
    token = world.tokens[principal]
    wrong: list[str] = []
    with server.client(token) as client:
        for row in TABLE:
            path = row.path(world)
            body = row.body(world) if row.body else None
            response = client.request(row.method, path, json=body)
            expected = expected_status(row, principal)
            cell = f"{row.method} {path} ({row.access.name})"
            if response.status_code != expected:
                wrong.append(
                    f"{cell}: expected {expected}, got {response.status_code}: "
                    f"{response.text[:200]}"
                )
                continue
            if expected == 401:
                challenge = response.headers.get("www-authenticate")
                if challenge != "Bearer":
                    wrong.append(f"{cell}: 401 with WWW-Authenticate {challenge!r}")
                if response.json().get("error") != "unauthorized":
                    wrong.append(f"{cell}: 401 body {response.text[:200]}")
            if expected == 403 and response.json().get("error") != "forbidden":
                wrong.append(f"{cell}: 403 body {response.text[:200]}")
            if row.check and expected == row.status and row.status < 300:
                problem = row.check(principal, world, response)
                if problem:
                    wrong.append(f"{cell}: {problem}")
    assert wrong == [], f"{principal}: {len(wrong)} wrong cell(s):\n" + "\n".join(wrong)


def test_table_covers_every_endpoint(server: Server) -> None:
    with server.client(None) as client:
        schema = client.get("/openapi.json")
    assert schema.status_code == 200, schema.text
    endpoints = {
        (method.upper(), path)
        for path, operations in schema.json()["paths"].items()
        for method in operations
    }
    covered = {(row.method, row.template) for row in TABLE if row.in_schema}
    assert endpoints - covered == set(), "endpoints without a row in the auth matrix"
    assert covered - endpoints == set(), "rows for endpoints the app does not have"


def test_tokens_are_stored_hashed(server: Server, run_name: str) -> None:
    with server.client() as admin:
        register(admin, run_name)
        created = [
            create_token(admin, role="read", name="reader"),
            create_token(admin, role="run", run=run_name, name="trainer"),
        ]
        listed = admin.get("/v1/tokens")
    assert listed.status_code == 200, listed.text
    secrets = [token["token"] for token in created]
    assert len(set(secrets)) == 2
    for secret in secrets:
        assert len(secret) >= 32
        assert secret not in listed.text
        assert_status(server, secret, "GET", f"/v1/runs/{run_name}", 200)

    with server.context.transaction() as session:
        rows = {
            row.id: (row.token_hash, row.role, row.run_name, row.name)
            for row in session.scalars(select(Token))
        }
    assert set(rows) == {token["id"] for token in created}
    for token in created:
        token_hash, role, run, name = rows[token["id"]]
        assert token_hash == hashlib.sha256(token["token"].encode()).hexdigest()
        assert (role, run, name) == (token["role"], token["run"], token["name"])
        # The stored hash is not itself a credential.
        assert_status(server, token_hash, "GET", f"/v1/runs/{run_name}", 401)

    # No column of any table holds a secret.
    with server.context.engine.connect() as connection:
        for table in Base.metadata.sorted_tables:
            for row in connection.execute(select(table)):
                for secret in secrets:
                    assert secret not in repr(tuple(row)), f"a secret is stored in {table.name}"


INVALID_TOKEN_REQUESTS: list[dict[str, Any]] = [
    {"role": "run"},  # a run token names its run
    {"role": "run", "run": None},
    {"role": "read", "run": "some-run"},  # a read token reads every run
    {"role": "admin", "run": "some-run"},
    {"role": "superuser"},
    {"role": "read", "extra": 1},
]


def test_token_role_and_run_must_agree(server: Server) -> None:
    wrong: list[str] = []
    with server.client() as admin:
        for body in INVALID_TOKEN_REQUESTS:
            response = admin.post("/v1/tokens", json=body)
            if response.status_code != 422 or response.json().get("error") != "invalid_request":
                wrong.append(f"{body}: {response.status_code} {response.text[:200]}")
        listed = admin.get("/v1/tokens")
    assert wrong == []
    assert listed.json() == []


def test_revoked_token_is_refused(server: Server, run_name: str) -> None:
    with server.client() as admin:
        register(admin, run_name)
        token = create_token(admin, role="run", run=run_name)
        assert_status(server, token["token"], "GET", f"/v1/runs/{run_name}", 200)
        first = admin.delete(f"/v1/tokens/{token['id']}")
        assert first.status_code == 200, first.text
        revoked_at = first.json()["revoked_at"]
        assert revoked_at is not None
        again = admin.delete(f"/v1/tokens/{token['id']}")
        assert again.status_code == 200, again.text
        assert again.json()["revoked_at"] == revoked_at
        assert admin.delete("/v1/tokens/987654321").status_code == 404
    with server.client(token["token"]) as client:
        response = client.get(f"/v1/runs/{run_name}")
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
