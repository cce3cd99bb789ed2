"""The API description (``/openapi.json``) tells the truth: the bearer scheme on every route
that needs a token, every error each route answers with its body model, bodies the server
really sends that match it; malformed JSON is a 422; and ``/docs`` works offline, from the
Swagger UI files the package ships.

The generated requests of ``test_schemathesis.py`` check the same description at large;
these tests name each promise and make the server keep it on purpose.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import pytest

from ckpt.core.contract import Layer
from service.apidocs import STATIC
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import commit, make_layer, open_bundle, record, register, save

ROOT = Path(__file__).resolve().parents[2]
PROBES = {"/healthz", "/readyz", "/metrics"}
ERROR_BODY = "#/components/schemas/ErrorBody"


@pytest.fixture
def sqlite_server(make_server: MakeServer) -> Server:
    """The description and the static files do not depend on the database."""
    return make_server("sqlite")


def description(server: Server) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/openapi.json", timeout=60)
    assert response.status_code == 200, response.text
    schema: dict[str, Any] = response.json()
    return schema


def operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method.upper(), path, operation)
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
    ]


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node


def assert_documented(schema: dict[str, Any], template: str, response: httpx.Response) -> None:
    """``response`` (to a request for the route ``template``) has a documented status, and its
    JSON body matches the documented body of that status."""
    method = response.request.method
    documented = schema["paths"][template][method.lower()]["responses"]
    status = str(response.status_code)
    assert status in documented, f"{method} {template}: {status} is not documented"
    body_schema = documented[status]["content"]["application/json"]["schema"]
    # The components beside the body's schema, so that its "#/components/..." refs resolve.
    validator = jsonschema_rs.Draft202012Validator(
        {**body_schema, "components": schema["components"]}
    )
    problems = [error.message for error in validator.iter_errors(response.json())]
    assert problems == [], f"{method} {template} {status}: {response.text[:500]}"


def test_the_bearer_scheme_guards_every_route_that_needs_a_token(sqlite_server: Server) -> None:
    schema = description(sqlite_server)
    scheme = schema["components"]["securitySchemes"]["bearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for method, path, operation in operations(schema):
        headers = [
            p["name"].lower() for p in operation.get("parameters", []) if p["in"] == "header"
        ]
        assert "authorization" not in headers, f"{method} {path}: the token is a parameter"
        if path in PROBES:
            assert "security" not in operation, f"{method} {path} needs no token"
        else:
            assert operation.get("security") == [{"bearer": []}], f"{method} {path}"
            assert "401" in operation["responses"], f"{method} {path}"


def test_every_error_is_documented_with_the_error_body(sqlite_server: Server) -> None:
    schema = description(sqlite_server)
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components  # FastAPI's 422 body is never sent
    error_bodies = {name for name in components if name.endswith("Body")}
    assert "ErrorBody" in error_bodies
    for name in error_bodies:  # each extends the one error body
        assert {"error", "message"} <= set(components[name]["required"]), name
    for method, path, operation in operations(schema):
        responses = operation["responses"]
        if path not in PROBES:
            assert {"401", "413", "429", "503"} <= set(responses), f"{method} {path}"
        takes_input = operation.get("parameters") or operation.get("requestBody")
        assert ("422" in responses) == bool(takes_input), f"{method} {path}"
        for status, response in responses.items():
            if status.startswith(("4", "5")) and path not in PROBES:
                body = response["content"]["application/json"]["schema"]
                refs = [body] if "$ref" in body else body["oneOf"]
                names = {ref["$ref"].rsplit("/", 1)[1] for ref in refs}
                assert names <= error_bodies, f"{method} {path} {status}: {names}"
                assert response["description"].startswith("`"), f"{method} {path} {status}"


def test_a_conflict_names_each_of_its_codes(sqlite_server: Server) -> None:
    commit_409 = description(sqlite_server)["paths"]["/v1/bundles/{bundle}/commit"]["post"][
        "responses"
    ]["409"]
    body = commit_409["content"]["application/json"]["schema"]
    assert body["discriminator"]["mapping"].keys() == {"fenced", "incomplete", "conflict"}
    for code in ("fenced", "incomplete", "conflict"):
        assert f"`{code}`" in commit_409["description"]


def test_the_bodies_the_server_sends_are_the_documented_ones(server: Server) -> None:
    """Every error status, made to happen on purpose, against the route's description."""
    schema = description(server)
    with server.client() as admin, server.client(None) as anonymous:
        old = register(admin, "fenced-run")
        pending = open_bundle(admin, "fenced-run", old, step=5)
        assert pending.status_code == 201, pending.text
        pending_id = pending.json()["id"]
        rng, _ = make_layer(server.store)
        new = register(admin, "fenced-run")  # fences ``old``
        complete = save(admin, server.store, "fenced-run", new, step=10)
        empty = open_bundle(admin, "fenced-run", new, step=20)
        reader = admin.post("/v1/tokens", json={"role": "read", "name": "reader"}).json()
        answers = {
            "fenced heartbeat": (
                "/v1/attempts/{attempt}/heartbeat",
                admin.post(f"/v1/attempts/{old['attempt_id']}/heartbeat", json={"step": 1}),
            ),
            "fenced open": (
                "/v1/runs/{run}/bundles",
                open_bundle(admin, "fenced-run", old, step=6),
            ),
            "fenced record": (
                "/v1/bundles/{bundle}/layers/{rank}/{layer}",
                record(admin, pending_id, 0, Layer.RNG, old["epoch"], rng),
            ),
            "fenced commit": (
                "/v1/bundles/{bundle}/commit",
                commit(admin, pending_id, old["epoch"]),
            ),
            "incomplete commit": (
                "/v1/bundles/{bundle}/commit",
                commit(admin, empty.json()["id"], new["epoch"]),
            ),
            "intact quarantine": (
                "/v1/bundles/{bundle}/quarantine",
                admin.post(
                    f"/v1/bundles/{complete['id']}/quarantine",
                    json={"reason": "a test", "blob": first_blob(complete)},
                ),
            ),
            "conflict": ("/v1/runs", admin.post("/v1/runs", json={"name": "fenced-run"})),
            "unauthorized": ("/v1/runs", anonymous.get("/v1/runs")),
            "forbidden": (
                "/v1/runs",
                httpx.post(
                    f"{server.url}/v1/runs",
                    json={"name": "x"},
                    headers={"Authorization": f"Bearer {reader['token']}"},
                    timeout=60,
                ),
            ),
            "not found": ("/v1/bundles/{bundle}", admin.get("/v1/bundles/987654")),
            "invalid": ("/v1/runs/{run}/bundles", open_bundle(admin, "fenced-run", new, step=-1)),
        }
    codes = {what: answer.json()["error"] for what, (_, answer) in answers.items()}
    assert codes == {
        "fenced heartbeat": "fenced",
        "fenced open": "fenced",
        "fenced record": "fenced",
        "fenced commit": "fenced",
        "incomplete commit": "incomplete",
        "intact quarantine": "intact",
        "conflict": "conflict",
        "unauthorized": "unauthorized",
        "forbidden": "forbidden",
        "not found": "not_found",
        "invalid": "invalid_request",
    }
    for template, answer in answers.values():
        assert_documented(schema, template, answer)
    fenced = answers["fenced heartbeat"][1].json()
    assert fenced["run_epoch"] == new["epoch"]  # every fenced body names the current epoch
    assert answers["unauthorized"][1].headers["WWW-Authenticate"] == "Bearer"


def first_blob(bundle: dict[str, Any]) -> str:
    sha: str = bundle["manifest"]["ranks"][0]["layers"][Layer.WEIGHTS]["blobs"][0]["sha256"]
    return sha


def test_limits_answer_with_their_documented_bodies(make_server: MakeServer) -> None:
    server = make_server(
        "sqlite", max_body_bytes=4096, rate_limit_per_second=0.001, rate_limit_burst=2
    )
    schema = description(server)
    with server.client() as admin:
        too_large = admin.post("/v1/runs", json={"name": "x" * 5000})
        admin.get("/v1/runs")  # the burst's last request
        limited = admin.get("/v1/runs")
    assert too_large.status_code == 413, too_large.text
    assert_documented(schema, "/v1/runs", too_large)
    assert limited.status_code == 429, limited.text
    assert_documented(schema, "/v1/runs", limited)
    assert int(limited.headers["Retry-After"]) == limited.json()["retry_after"] >= 1


def test_a_failing_database_answers_a_documented_503(sqlite_server: Server) -> None:
    schema = description(sqlite_server)
    catalog = Path(sqlite_server.context.settings.database_url.removeprefix("sqlite:///"))
    for path in catalog.parent.glob(f"{catalog.name}*"):
        path.unlink()
    catalog.mkdir()  # a directory: the database cannot be opened
    sqlite_server.context.engine.dispose()  # no connection opened before survives
    with sqlite_server.client() as admin:
        failed = admin.get("/v1/runs")
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"] == "database_unavailable"
    assert "sqlite" not in failed.text.lower()  # the driver's error goes to the log only
    assert_documented(schema, "/v1/runs", failed)


NOT_JSON = {
    "not utf-8": b'{"name": "\xff"}',
    "utf-16 cut short": b"\xff\xfe{",
    "nested too deep": b"[" * 100_000,
    "cut short": b'{"name": ',
}


@pytest.mark.parametrize("body", NOT_JSON.values(), ids=NOT_JSON.keys())
@pytest.mark.parametrize("path", ["/v1/runs", "/v1/blobs/missing"])
def test_a_body_that_is_not_json_is_a_422(sqlite_server: Server, path: str, body: bytes) -> None:
    """As docs/rest-api.md says: the usual error body, naming the body (FastAPI alone
    answers 400 to bytes that are not UTF-8 and to deep nesting)."""
    with sqlite_server.client() as client:
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    answer = response.json()
    assert answer["error"] == "invalid_request"
    assert "JSON" in answer["message"] and answer["problems"], answer
    assert_documented(description(sqlite_server), path, response)


ASSET = re.compile(r'(?:src|href|data-openapi-url)="([^"]+)"')


def test_the_docs_page_loads_nothing_from_elsewhere(sqlite_server: Server) -> None:
    with httpx.Client(timeout=60, base_url=sqlite_server.url) as anonymous:  # no token needed
        page = anonymous.get("/docs")
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/html")
        assert "//" not in re.sub(r"http://www\.w3\.org/[^\"']*", "", page.text), page.text
        urls = ASSET.findall(page.text)
        # Swagger UI's script and ours (docs.js), the style sheet, the icon, the description
        assert len(urls) == 5, urls
        types = {}
        for url in urls:
            assert url.startswith("/"), url
            asset = anonymous.get(url)
            assert asset.status_code == 200, url
            assert asset.content, url
            types[url.rsplit(".", 1)[-1]] = asset.headers["content-type"].split(";")[0]
    assert types == {
        "js": "text/javascript",
        "css": "text/css",
        "png": "image/png",
        "json": "application/json",
    }


def test_swagger_ui_ships_with_the_package() -> None:
    """Every vendored file is package data (a wheel without them serves a blank /docs), and
    the license comes with the code."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["service"]
    package = STATIC.parent
    shipped = {path for pattern in patterns for path in package.glob(pattern) if path.is_file()}
    vendored = {path for path in STATIC.rglob("*") if path.is_file()}
    assert vendored and vendored <= shipped
    names = {path.name for path in vendored}
    assert {"swagger-ui-bundle.js", "swagger-ui.css", "LICENSE", "NOTICE"} <= names
