"""Bad input over HTTP: every malformed, out-of-range, unknown, oversized or hostile request
gets a 4xx whose JSON body names what is wrong, and nothing is written."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from ckpt.core.contract import RESTORE_ORDER, Layer, LayerRecord
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import VERSIONS, make_layer, open_bundle, record, register, save

MISSING_ID = 987654321


@dataclass
class World:
    """A run with a complete bundle (step 10) and a pending one (step 20, world size 2, rank
    0's weights recorded); ``rec`` is a valid record whose blobs are in the store."""

    run: str
    attempt: dict[str, Any]
    complete: dict[str, Any]
    pending_id: int
    rec: LayerRecord
    small_sha: str  # a 16-byte blob the catalog knows

    @property
    def epoch(self) -> int:
        epoch: int = self.attempt["epoch"]
        return epoch

    def open_body(self, **changes: Any) -> dict[str, Any]:
        body = {
            "attempt_id": self.attempt["attempt_id"],
            "epoch": self.epoch,
            "step": 30,
            "world_size": 1,
            "versions": VERSIONS,
        }
        body.update(changes)
        return body

    def record_json(self, **changes: Any) -> dict[str, Any]:
        body: dict[str, Any] = self.rec.model_dump(mode="json")
        body.update(changes)
        return body

    def put_body(self, record: Any = None, **changes: Any) -> dict[str, Any]:
        body = {"epoch": self.epoch, "record": self.record_json() if record is None else record}
        body.update(changes)
        return body

    @property
    def bundles(self) -> str:
        return f"/v1/runs/{self.run}/bundles"

    @property
    def layer_path(self) -> str:
        return f"/v1/bundles/{self.pending_id}/layers/1/optimizer"


def build_world(client: httpx.Client, server: Server, run: str) -> World:
    attempt = register(client, run)
    complete = save(client, server.store, run, attempt, step=10)
    opened = open_bundle(client, run, attempt, step=20, world_size=2)
    assert opened.status_code == 201, opened.text
    pending_id = opened.json()["id"]
    small, _ = make_layer(server.store, size=16)
    response = record(client, pending_id, 0, Layer.WEIGHTS, attempt["epoch"], small)
    assert response.status_code == 200, response.text
    rec, _ = make_layer(server.store, size=64)
    return World(
        run=run,
        attempt=attempt,
        complete=complete,
        pending_id=pending_id,
        rec=rec,
        small_sha=small.blobs[1].sha256,
    )


def get_json(client: httpx.Client, path: str) -> Any:
    response = client.get(path)
    assert response.status_code == 200, response.text
    return response.json()


def store_files(server: Server) -> dict[str, str]:
    root = server.store.root
    if not root.exists():
        return {}
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def snapshot(client: httpx.Client, server: Server, world: World) -> dict[str, Any]:
    """Everything a request could change, as the API and the store show it."""
    return {
        "runs": get_json(client, "/v1/runs?limit=500"),
        "run": get_json(client, f"/v1/runs/{world.run}"),
        "lineage": get_json(client, f"/v1/runs/{world.run}/lineage"),
        "pending": get_json(client, f"/v1/bundles/{world.pending_id}"),
        "complete": get_json(client, f"/v1/bundles/{world.complete['id']}"),
        "store": store_files(server),
    }


def assert_refused(response: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body: dict[str, Any] = response.json()
    assert isinstance(body.get("error"), str) and body["error"], body
    assert isinstance(body.get("message"), str) and body["message"], body
    for word in words:
        assert word.lower() in body["message"].lower(), (word, body["message"])
    return body


@dataclass(frozen=True)
class Case:
    """A bad request: ``request(world)`` gives (method, path, httpx keyword arguments)."""

    request: Callable[[World], tuple[str, str, dict[str, Any]]]
    status: int
    words: tuple[str, ...]


def json_case(
    method: str, path: Callable[[World], str], body: Callable[[World], Any], *words: str
) -> Case:
    return Case(lambda w: (method, path(w), {"json": body(w)}), 422, words)


def raw_case(method: str, path: Callable[[World], str], content: bytes, *words: str) -> Case:
    headers = {"content-type": "application/json"}
    return Case(lambda w: (method, path(w), {"content": content, "headers": headers}), 422, words)


def _bundles(w: World) -> str:
    return w.bundles


def _layer(w: World) -> str:
    return w.layer_path


def _commit(w: World) -> str:
    return f"/v1/bundles/{w.pending_id}/commit"


def _attempt(w: World) -> str:
    return f"/v1/attempts/{w.attempt['attempt_id']}"


def _blob(w: World, index: int, **changes: Any) -> list[dict[str, Any]]:
    blobs: list[dict[str, Any]] = w.record_json()["blobs"]
    blobs[index] = {**blobs[index], **changes}
    return blobs


def _huge_record(w: World) -> dict[str, Any]:
    """A self-consistent record of a payload larger than any 64-bit size."""
    huge = 2**63
    header = w.rec.blobs[0]
    return {
        "payload_bytes": header.size + huge,
        "header_bytes": header.size,
        "blobs": [header.model_dump(), {"sha256": "c" * 64, "size": huge}],
        "tensors": {"t": {"dtype": "U8", "shape": [huge], "data_offsets": [0, huge]}},
    }


def _out_of_range(method: str, path: Callable[[World], str], body: Any, field: str) -> Case:
    """An id no catalog row can have (below 1, beyond 32 bits): 422 naming the field."""
    return Case(
        lambda w: (method, path(w), {"json": body(w) if callable(body) else body}),
        422,
        (field, "Input should be"),
    )


def _not_found(method: str, path: Callable[[World], str], body: Any, *words: str) -> Case:
    return Case(
        lambda w: (method, path(w), {"json": body(w) if callable(body) else body}), 404, words
    )


CASES: dict[str, Case] = {
    # Malformed JSON.
    "malformed_json_open": raw_case("POST", _bundles, b'{"attempt_id": 1, "epoch":', "JSON"),
    "malformed_json_record": raw_case("PUT", _layer, b'{"epoch": 1, "record": {', "JSON"),
    "malformed_json_commit": raw_case("POST", _commit, b"{epoch: 1}", "JSON"),
    "malformed_json_runs": raw_case("POST", lambda w: "/v1/runs", b'{"name": "x"', "JSON"),
    "body_not_an_object": json_case("POST", _bundles, lambda w: [1, 2], "body"),
    "empty_body": raw_case("POST", _bundles, b"", "body"),
    # Wrong types.
    "step_word_string": json_case("POST", _bundles, lambda w: w.open_body(step="ten"), "step"),
    "step_numeric_string": json_case("POST", _bundles, lambda w: w.open_body(step="30"), "step"),
    "step_fraction": json_case("POST", _bundles, lambda w: w.open_body(step=30.5), "step"),
    "step_null": json_case("POST", _bundles, lambda w: w.open_body(step=None), "step"),
    "world_size_list": json_case(
        "POST", _bundles, lambda w: w.open_body(world_size=[2]), "world_size"
    ),
    "world_size_bool": json_case(
        "POST", _bundles, lambda w: w.open_body(world_size=True), "world_size"
    ),
    "attempt_id_string": json_case(
        "POST", _bundles, lambda w: w.open_body(attempt_id="me"), "attempt_id"
    ),
    "versions_string": json_case(
        "POST", _bundles, lambda w: w.open_body(versions="2.13"), "versions"
    ),
    "epoch_string": json_case("POST", _commit, lambda w: {"epoch": "latest"}, "epoch"),
    "record_not_an_object": json_case("PUT", _layer, lambda w: w.put_body(record=[]), "record"),
    # Out of range.
    "step_negative": json_case("POST", _bundles, lambda w: w.open_body(step=-1), "step"),
    "step_too_large": json_case("POST", _bundles, lambda w: w.open_body(step=2**62 + 1), "step"),
    "step_beyond_int64": json_case("POST", _bundles, lambda w: w.open_body(step=2**64), "step"),
    "world_size_zero": json_case(
        "POST", _bundles, lambda w: w.open_body(world_size=0), "world_size"
    ),
    "world_size_too_large": json_case(
        "POST", _bundles, lambda w: w.open_body(world_size=65537), "world_size"
    ),
    "epoch_zero": json_case("POST", _bundles, lambda w: w.open_body(epoch=0), "epoch"),
    "heartbeat_step_negative": json_case(
        "POST", lambda w: _attempt(w) + "/heartbeat", lambda w: {"step": -5}, "step"
    ),
    "heartbeat_step_beyond_int64": json_case(
        "POST", lambda w: _attempt(w) + "/heartbeat", lambda w: {"step": 2**63}, "step"
    ),
    "end_step_beyond_int64": json_case(
        "POST",
        lambda w: _attempt(w) + "/end",
        lambda w: {"reason": "failed", "step": 2**64},
        "step",
    ),
    "payload_beyond_int64": json_case("PUT", _layer, lambda w: w.put_body(_huge_record(w))),
    "end_reason_unknown": json_case(
        "POST", lambda w: _attempt(w) + "/end", lambda w: {"reason": "bored"}, "reason"
    ),
    # Booleans and integers are taken as such, never coerced (0 is not false, false not 0).
    "pinned_zero": json_case(
        "PATCH", lambda w: f"/v1/bundles/{w.complete['id']}", lambda w: {"pinned": 0}, "pinned"
    ),
    "pinned_string": json_case(
        "PATCH", lambda w: f"/v1/bundles/{w.complete['id']}", lambda w: {"pinned": "yes"}, "pinned"
    ),
    "size_false": json_case(
        "PUT", _layer, lambda w: w.put_body(w.record_json(blobs=_blob(w, 1, size=False))), "size"
    ),
    "size_string": json_case(
        "PUT", _layer, lambda w: w.put_body(w.record_json(blobs=_blob(w, 1, size="9"))), "size"
    ),
    "keep_last_true": json_case(
        "PATCH", lambda w: f"/v1/runs/{w.run}", lambda w: {"keep_last": True}, "keep_last"
    ),
    "resume_one": json_case(
        "POST", lambda w: f"/v1/runs/{w.run}/attempts", lambda w: {"resume": 1}, "resume"
    ),
    "final_save_string": json_case(
        "POST",
        lambda w: _attempt(w) + "/end",
        lambda w: {"reason": "failed", "final_save_committed": "true"},
        "final_save_committed",
    ),
    "keep_last_zero": json_case(
        "PATCH", lambda w: f"/v1/runs/{w.run}", lambda w: {"keep_last": 0}, "keep_last"
    ),
    # The URL.
    "unknown_layer": json_case(
        "PUT",
        lambda w: f"/v1/bundles/{w.pending_id}/layers/0/gradients",
        lambda w: w.put_body(),
        "layer",
    ),
    "rank_at_world_size": json_case(
        "PUT",
        lambda w: f"/v1/bundles/{w.pending_id}/layers/2/optimizer",
        lambda w: w.put_body(),
        "rank 2",
    ),
    "rank_far_beyond_world_size": json_case(
        "PUT",
        lambda w: f"/v1/bundles/{w.pending_id}/layers/7/optimizer",
        lambda w: w.put_body(),
        "rank 7",
    ),
    "rank_negative": json_case(
        "PUT",
        lambda w: f"/v1/bundles/{w.pending_id}/layers/-1/optimizer",
        lambda w: w.put_body(),
        "rank",
    ),
    "rank_not_a_number": json_case(
        "PUT",
        lambda w: f"/v1/bundles/{w.pending_id}/layers/one/optimizer",
        lambda w: w.put_body(),
        "rank",
    ),
    "bundle_id_not_a_number": json_case(
        "POST", lambda w: "/v1/bundles/latest/commit", lambda w: {"epoch": w.epoch}, "bundle"
    ),
    # Unknown fields.
    "extra_field_open": json_case("POST", _bundles, lambda w: w.open_body(color="red"), "color"),
    "extra_field_put": json_case("PUT", _layer, lambda w: w.put_body(color="red"), "color"),
    "extra_field_record": json_case(
        "PUT", _layer, lambda w: w.put_body(w.record_json(color="red")), "color"
    ),
    "extra_field_blob": json_case(
        "PUT", _layer, lambda w: w.put_body(w.record_json(blobs=_blob(w, 0, color="red"))), "color"
    ),
    "extra_field_versions": json_case(
        "POST",
        _bundles,
        lambda w: w.open_body(versions={**VERSIONS, "color": "red"}),
        "color",
    ),
    "extra_field_commit": json_case(
        "POST", _commit, lambda w: {"epoch": w.epoch, "color": "red"}, "color"
    ),
    "extra_field_create_run": json_case(
        "POST", lambda w: "/v1/runs", lambda w: {"name": "fresh-run", "color": "red"}, "color"
    ),
    "extra_field_register": json_case(
        "POST", lambda w: "/v1/runs/fresh-run/attempts", lambda w: {"color": "red"}, "color"
    ),
    "extra_field_register_existing": json_case(
        "POST", lambda w: f"/v1/runs/{w.run}/attempts", lambda w: {"color": "red"}, "color"
    ),
    "extra_field_heartbeat": json_case(
        "POST", lambda w: _attempt(w) + "/heartbeat", lambda w: {"step": 3, "color": 1}, "color"
    ),
    "extra_field_end": json_case(
        "POST", lambda w: _attempt(w) + "/end", lambda w: {"reason": "failed", "color": 1}, "color"
    ),
    "extra_field_rollback": json_case(
        "POST",
        lambda w: f"/v1/runs/{w.run}/rollback",
        lambda w: {"bundle_id": w.complete["id"], "color": 1},
        "color",
    ),
    "extra_field_patch_run": json_case(
        "PATCH", lambda w: f"/v1/runs/{w.run}", lambda w: {"keep_last": 2, "color": 1}, "color"
    ),
    "extra_field_patch_bundle": json_case(
        "PATCH",
        lambda w: f"/v1/bundles/{w.complete['id']}",
        lambda w: {"pinned": True, "color": 1},
        "color",
    ),
    "extra_field_blobs_missing": json_case(
        "POST",
        lambda w: "/v1/blobs/missing",
        lambda w: {"blobs": w.record_json()["blobs"], "color": 1},
        "color",
    ),
    # Records that do not add up.
    "blobs_short_of_payload": json_case(
        "PUT",
        _layer,
        lambda w: w.put_body(w.record_json(payload_bytes=w.rec.payload_bytes + 1)),
        "payload",
    ),
    "blobs_beyond_payload": json_case(
        "PUT",
        _layer,
        lambda w: w.put_body(w.record_json(payload_bytes=w.rec.payload_bytes - 1)),
        "payload",
    ),
    "header_not_first_blob": json_case(
        "PUT",
        _layer,
        lambda w: w.put_body(w.record_json(header_bytes=w.rec.header_bytes + 1)),
        "header",
    ),
    "no_blobs": json_case("PUT", _layer, lambda w: w.put_body(w.record_json(blobs=[])), "blob"),
    "blob_size_negative": json_case(
        "PUT", _layer, lambda w: w.put_body(w.record_json(blobs=_blob(w, 1, size=-1))), "size"
    ),
    # (A blob size that disagrees with the catalog is not refused at record time: the commit
    # compares each record with the store, so one run cannot block another by claiming a
    # wrong size for a shared blob — see test_robustness.py.)
    # Bad SHA-256 strings.
    "sha_uppercase": json_case(
        "PUT",
        _layer,
        lambda w: w.put_body(
            w.record_json(blobs=_blob(w, 1, sha256=w.rec.blobs[1].sha256.upper()))
        ),
        "sha256",
    ),
    "sha_short": json_case(
        "PUT",
        _layer,
        lambda w: w.put_body(w.record_json(blobs=_blob(w, 1, sha256=w.rec.blobs[1].sha256[:63]))),
        "sha256",
    ),
    "sha_not_hex": json_case(
        "PUT",
        _layer,
        lambda w: w.put_body(w.record_json(blobs=_blob(w, 1, sha256="g" * 64))),
        "sha256",
    ),
    "sha_path_traversal": json_case(
        "PUT",
        _layer,
        lambda w: w.put_body(w.record_json(blobs=_blob(w, 1, sha256="../" * 21 + "a"))),
        "sha256",
    ),
    "sha_number": json_case(
        "PUT", _layer, lambda w: w.put_body(w.record_json(blobs=_blob(w, 1, sha256=12))), "sha256"
    ),
    "sha_blobs_missing": json_case(
        "POST",
        lambda w: "/v1/blobs/missing",
        lambda w: {"blobs": [{"sha256": "ab" * 32 + "\n", "size": 3}]},
        "sha256",
    ),
    # Ids that do not exist.
    "no_bundle_get": _not_found(
        "GET", lambda w: f"/v1/bundles/{MISSING_ID}", None, str(MISSING_ID)
    ),
    "no_bundle_record": _not_found(
        "PUT",
        lambda w: f"/v1/bundles/{MISSING_ID}/layers/0/weights",
        lambda w: w.put_body(),
        str(MISSING_ID),
    ),
    "no_bundle_commit": _not_found(
        "POST",
        lambda w: f"/v1/bundles/{MISSING_ID}/commit",
        lambda w: {"epoch": w.epoch},
        str(MISSING_ID),
    ),
    "no_bundle_patch": _not_found(
        "PATCH", lambda w: f"/v1/bundles/{MISSING_ID}", {"pinned": True}, str(MISSING_ID)
    ),
    "no_bundle_negative": _out_of_range("GET", lambda w: "/v1/bundles/-3", None, "path.bundle"),
    "no_bundle_rollback": _not_found(
        "POST", lambda w: f"/v1/runs/{w.run}/rollback", {"bundle_id": MISSING_ID}, str(MISSING_ID)
    ),
    "no_attempt_heartbeat": _not_found(
        "POST", lambda w: f"/v1/attempts/{MISSING_ID}/heartbeat", {}, str(MISSING_ID)
    ),
    "no_attempt_end": _not_found(
        "POST", lambda w: f"/v1/attempts/{MISSING_ID}/end", {"reason": "failed"}, str(MISSING_ID)
    ),
    "no_attempt_open": _not_found(
        "POST", _bundles, lambda w: w.open_body(attempt_id=MISSING_ID), str(MISSING_ID)
    ),
    "no_run_get": _not_found("GET", lambda w: "/v1/runs/no-such-run", None, "no-such-run"),
    "no_run_lineage": _not_found(
        "GET", lambda w: "/v1/runs/no-such-run/lineage", None, "no-such-run"
    ),
    "no_run_resumable": _not_found(
        "GET", lambda w: "/v1/runs/no-such-run/resumable", None, "no-such-run"
    ),
    "no_run_patch": _not_found(
        "PATCH", lambda w: "/v1/runs/no-such-run", {"keep_last": 3}, "no-such-run"
    ),
    "no_run_open": _not_found(
        "POST", lambda w: "/v1/runs/no-such-run/bundles", lambda w: w.open_body(), "no-such-run"
    ),
    "no_run_rollback": _not_found(
        "POST",
        lambda w: "/v1/runs/no-such-run/rollback",
        lambda w: {"bundle_id": w.complete["id"]},
        "no-such-run",
    ),
    # Ids beyond a 32- or 64-bit integer: a 422 naming the field, never a server error.
    "int32_bundle_get": _out_of_range("GET", lambda w: f"/v1/bundles/{2**31}", None, "path.bundle"),
    "int32_attempt_end": _out_of_range(
        "POST", lambda w: f"/v1/attempts/{2**31}/end", {"reason": "failed"}, "path.attempt"
    ),
    "huge_bundle_get": _out_of_range("GET", lambda w: f"/v1/bundles/{2**64}", None, "path.bundle"),
    "huge_bundle_commit": _out_of_range(
        "POST", lambda w: f"/v1/bundles/{2**63}/commit", lambda w: {"epoch": w.epoch}, "path.bundle"
    ),
    "huge_attempt_heartbeat": _out_of_range(
        "POST", lambda w: f"/v1/attempts/{2**64}/heartbeat", {}, "path.attempt"
    ),
    "huge_attempt_open": _out_of_range(
        "POST", _bundles, lambda w: w.open_body(attempt_id=2**64), "body.attempt_id"
    ),
    "huge_bundle_rollback": _out_of_range(
        "POST", lambda w: f"/v1/runs/{w.run}/rollback", {"bundle_id": 2**64}, "body.bundle_id"
    ),
}


# Longer than the module could take anywhere: the shared world's attempt stays live.
WORLD_LIFETIME = 7 * 24 * 3600.0


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def shared(request: pytest.FixtureRequest, make_module_server: MakeServer) -> tuple[Server, World]:
    """One control plane and world per database for every bad request: each test checks
    that its request changed nothing, so the next one finds the world as it was built
    (a server and a world per request cost ~0.7 s each, 240 times). Its attempt never
    beats: the catalog must not mark it lost while the module runs, however long a busy
    machine makes that (by default at 60 s, in the middle of some case)."""
    server = make_module_server(request.param, lost_after_seconds=WORLD_LIFETIME)
    with server.client() as client:
        return server, build_world(client, server, f"run-shared-{request.param}")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_is_refused_and_writes_nothing(shared: tuple[Server, World], case: str) -> None:
    spec = CASES[case]
    server, world = shared
    with server.client() as client:
        before = snapshot(client, server, world)
        method, path, kwargs = spec.request(world)
        for _ in range(2):
            assert_refused(client.request(method, path, **kwargs), spec.status, *spec.words)
        assert snapshot(client, server, world) == before


def test_a_foreign_bundle_is_not_found_through_another_run(server: Server, run_name: str) -> None:
    """Rolling back to, or opening with, another run's ids is 404, not a cross-run write."""
    with server.client() as client:
        world = build_world(client, server, run_name)
        other = build_world(client, server, run_name + "-other")
        before = snapshot(client, server, world)
        other_before = snapshot(client, server, other)
        assert_refused(
            client.post(f"/v1/runs/{world.run}/rollback", json={"bundle_id": other.complete["id"]}),
            404,
            str(other.complete["id"]),
        )
        assert_refused(
            client.post(
                world.bundles, json=world.open_body(attempt_id=other.attempt["attempt_id"])
            ),
            404,
            str(other.attempt["attempt_id"]),
        )
        assert snapshot(client, server, world) == before
        assert snapshot(client, server, other) == other_before


BAD_NAMES = {
    "dot_dot": "..",
    "dot": ".",
    "hidden": ".hidden",
    "dash": "-rf",
    "slash": "a/b",
    "encoded_slash": "a%2Fb",
    "encoded_dots": "%2e%2e",
    "traversal": "../../etc/passwd",
    "backslash": "..\\..\\x",
    "too_long": "a" * 129,
    "unicode": "rün",
    "cjk": "実験",
    "space": "a b",
    "sql": "x'; DROP TABLE runs; --",
    "empty": "",
    "nul": "a\x00b",
    "newline": "a\nb",
    "percent": "100%",
}


@pytest.mark.parametrize("name", list(BAD_NAMES))
def test_bad_run_name_in_a_body(server: Server, run_name: str, name: str) -> None:
    bad = BAD_NAMES[name]
    with server.client() as client:
        world = build_world(client, server, run_name)
        before = snapshot(client, server, world)
        for body in ({"name": bad}, {"name": bad, "keep_last": 3}):
            response = client.post("/v1/runs", json=body)
            assert_refused(response, 422, "name")
        assert snapshot(client, server, world) == before


def test_run_name_of_wrong_type(server: Server, run_name: str) -> None:
    with server.client() as client:
        world = build_world(client, server, run_name)
        before = snapshot(client, server, world)
        for bad in (5, None, ["a"], {"name": "a"}):
            assert_refused(client.post("/v1/runs", json={"name": bad}), 422, "name")
        assert_refused(client.post("/v1/runs", json={}), 422, "name")
        assert snapshot(client, server, world) == before


def test_good_run_names_are_accepted(server: Server) -> None:
    """The control for the two tests above: the longest and oddest valid names work."""
    with server.client() as client:
        for name in ("a" * 128, "A.b_c-9", "0", "x..y"):
            created = client.post("/v1/runs", json={"name": name})
            assert created.status_code == 201, created.text
            assert get_json(client, f"/v1/runs/{name}")["name"] == name
            assert register(client, name)["run"] == name


URL_NAMES = {
    "encoded_dots": "%2e%2e",
    "encoded_dots_upper": "%2E%2E",
    "encoded_dot": "%2e",
    "encoded_slash": "a%2Fb",
    "encoded_traversal": "..%2F..%2Fetc",
    "hidden": ".hidden",
    "dash": "-rf",
    "too_long": "a" * 129,
    "unicode": "r%C3%BCn",
    "space": "a%20b",
    "sql": "x%27%3B%20DROP%20TABLE%20runs%3B--",
    "nul": "a%00b",
    "newline": "a%0Ab",
    "backslash": "..%5C..%5Cx",
}


def _url_requests(world: World, name: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    base = f"/v1/runs/{name}"
    yield "POST", base + "/attempts", {"json": {}}
    yield "POST", base + "/bundles", {"json": world.open_body()}
    yield "GET", base, {}
    yield "GET", base + "/lineage", {}
    yield "GET", base + "/resumable", {}
    yield "PATCH", base, {"json": {"keep_last": 3}}
    yield "POST", base + "/rollback", {"json": {"bundle_id": world.complete["id"]}}


@pytest.mark.parametrize("name", list(URL_NAMES))
def test_bad_run_name_in_the_url(server: Server, run_name: str, name: str) -> None:
    encoded = URL_NAMES[name]
    with server.client() as client:
        world = build_world(client, server, run_name)
        before = snapshot(client, server, world)
        for method, path, kwargs in _url_requests(world, encoded):
            response = client.request(method, path, **kwargs)
            assert response.status_code in (404, 422), (method, path, response.text)
            if "%2F" in encoded:  # a slash: no route has that shape
                assert_refused(response, response.status_code)
            else:
                assert_refused(response, 422, "run")
        assert snapshot(client, server, world) == before


# Bodies over the limit.

LIMIT = 4096


@pytest.fixture(params=["postgres", "sqlite"])
def small_server(request: pytest.FixtureRequest, make_server: MakeServer) -> Server:
    backend: str = request.param
    return make_server(backend, max_body_bytes=LIMIT)


def padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` as JSON, padded with whitespace to exactly ``size`` bytes (still valid)."""
    text = json.dumps(body).encode()
    assert len(text) < size
    return text[:-1] + b" " * (size - len(text)) + b"}"


def chunks(data: bytes, size: int = 1000) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def oversized_requests(world: World, new_run: str) -> dict[str, tuple[str, str, bytes]]:
    return {
        "create_run": ("POST", "/v1/runs", padded({"name": new_run}, LIMIT + 1)),
        "register": ("POST", f"/v1/runs/{new_run}/attempts", padded({}, LIMIT + 500)),
        "record": ("PUT", world.layer_path, padded(world.put_body(), LIMIT * 4)),
        "open": ("POST", world.bundles, padded(world.open_body(), LIMIT + 1)),
    }


@pytest.mark.parametrize("target", ["create_run", "register", "record", "open"])
@pytest.mark.parametrize("framing", ["content_length", "chunked"])
def test_oversized_body_is_refused(
    small_server: Server, run_name: str, target: str, framing: str
) -> None:
    server = small_server
    with server.client() as client:
        world = build_world(client, server, run_name)
        before = snapshot(client, server, world)
        method, path, data = oversized_requests(world, run_name + "-new")[target]
        headers = {"content-type": "application/json"}
        for _ in range(2):
            if framing == "chunked":
                response = client.request(method, path, content=chunks(data), headers=headers)
            else:
                response = client.request(method, path, content=data, headers=headers)
            body = assert_refused(response, 413, str(LIMIT))
            assert body["error"] == "payload_too_large"
        assert snapshot(client, server, world) == before
        assert client.get(f"/v1/runs/{run_name}-new").status_code == 404


@pytest.mark.parametrize("framing", ["content_length", "chunked"])
def test_body_at_the_limit_is_accepted(small_server: Server, run_name: str, framing: str) -> None:
    """The control for the test above: the same padded bodies, at the limit, work."""
    with small_server.client() as client:
        data = padded({"name": run_name}, LIMIT)
        content: bytes | Iterator[bytes] = chunks(data) if framing == "chunked" else data
        response = client.post(
            "/v1/runs", content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 201, response.text
        assert get_json(client, f"/v1/runs/{run_name}")["name"] == run_name


def test_layers_of_every_kind_record(server: Server, run_name: str) -> None:
    """The control for the record cases: the world's valid record is accepted at every layer."""
    with server.client() as client:
        world = build_world(client, server, run_name)
        for layer in RESTORE_ORDER:
            response = client.put(
                f"/v1/bundles/{world.pending_id}/layers/1/{layer}", json=world.put_body()
            )
            assert response.status_code == 200, response.text
