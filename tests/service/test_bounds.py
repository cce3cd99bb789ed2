"""Bounded requests: list sizes, string lengths and characters, tensor indexes, steps and
path ids a client sends are refused (422, 413) with a message naming the bound, before any
work is done; and nothing a client sends can forge a line of the server's log."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ckpt.core.contract import MAX_STEP, Manifest, TensorEntry
from service.logsafe import escape, protect
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import VERSIONS, commit, make_layer, open_bundle, register, save


def blob_refs(count: int, *, start: int = 0) -> list[dict[str, Any]]:
    return [
        {"sha256": hashlib.sha256(b"%d" % i).hexdigest(), "size": 1 + i}
        for i in range(start, start + count)
    ]


def refused(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    message: str = response.json()["message"]
    for word in words:
        assert word in message, (word, message)
    return message


# --- list sizes ---------------------------------------------------------------------------


def test_a_blob_query_holds_at_most_10000_blobs(server: Server) -> None:
    with server.client() as client:
        answer = client.post("/v1/blobs/missing", json={"blobs": blob_refs(10_000)})
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["missing"]) == 10_000
        too_many = client.post("/v1/blobs/missing", json={"blobs": blob_refs(10_001)})
    refused(too_many, 422, "blobs", "10000")


def test_a_blob_query_far_over_the_cap_is_refused_before_it_is_parsed(server: Server) -> None:
    body = json.dumps({"blobs": blob_refs(30_000)}).encode()

    def streamed() -> Iterator[bytes]:  # no Content-Length: chunked
        for start in range(0, len(body), 1 << 16):
            yield body[start : start + (1 << 16)]

    with server.client() as client:
        declared = client.post("/v1/blobs/missing", content=body)
        chunked = client.post("/v1/blobs/missing", content=streamed())
    for answer in (declared, chunked):
        refused(answer, 413, "at most 10000 blobs")


def test_a_long_blob_query_is_validated_whole(server: Server) -> None:
    """Parsed in slices off the event loop, a long query still names its bad entry."""
    blobs = blob_refs(2_000)
    blobs[1_234]["sha256"] = "Z" * 64
    with server.client() as client:
        answer = client.post("/v1/blobs/missing", json={"blobs": blobs})
        extra = client.post("/v1/blobs/missing", json={"blobs": blob_refs(600), "color": 1})
        broken = client.post(
            "/v1/blobs/missing",
            content=b'{"blobs": [',
            headers={"content-type": "application/json"},
        )
        empty = client.post("/v1/blobs/missing", content=b"")
    refused(answer, 422, "body.blobs.1234.sha256")
    refused(extra, 422, "color")
    refused(broken, 422, "JSON")
    refused(empty, 422, "body")


# --- strings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("torch", "2." + "9" * 200, ("versions.torch", "128")),
        ("python", "3.11\x00", ("versions.python", "pattern")),
        ("ckpt", "0.1\nFORGED", ("versions.ckpt", "pattern")),
        ("torch", "2.13\u2028x", ("versions.torch", "pattern")),
        ("torch", "2.13\x1b[31m", ("versions.torch", "pattern")),
        ("torch", "2.13\u202e", ("versions.torch", "U+202E")),
    ],
)
def test_versions_are_short_printable_strings(
    server: Server, run_name: str, field: str, value: str, words: tuple[str, ...]
) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        answer = client.post(
            f"/v1/runs/{run_name}/bundles",
            json={
                "attempt_id": attempt["attempt_id"],
                "epoch": attempt["epoch"],
                "step": 1,
                "world_size": 1,
                "versions": {**VERSIONS, field: value},
            },
        )
        lineage = client.get(f"/v1/runs/{run_name}/lineage").json()
    refused(answer, 422, *words)
    assert lineage["bundles"] == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/runs/{run}/attempts", {"pod": "pod\x85next"}),
        ("/v1/runs/{run}/attempts", {"node": "node\u2029"}),
        ("/v1/runs/{run}/attempts", {"pod": "p" * 254}),
        ("/v1/tokens", {"role": "read", "name": "ops\u2028"}),
        ("/v1/tokens", {"role": "read", "name": "n" * 129}),
    ],
)
def test_names_are_bounded_and_printable(
    server: Server, run_name: str, path: str, body: dict[str, Any]
) -> None:
    with server.client() as client:
        answer = client.post(path.format(run=run_name), json=body)
    assert answer.status_code == 422, answer.text


# --- tensor indexes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"shape": [-64]}, ("shape.0", "greater than or equal to 0")),
        ({"data_offsets": [-1, 63]}, ("data_offsets.0", "greater than or equal to 0")),
        ({"data_offsets": [64, 0]}, ("data_offsets [64, 0] begin after they end",)),
        ({"dtype": "F4"}, ("unknown dtype 'F4'", "BF16")),
        ({"dtype": "U8\x00"}, ("unknown dtype",)),
        ({"shape": [1] * 65}, ("shape", "64")),
    ],
)
def test_a_tensor_index_must_be_well_formed(
    server: Server, run_name: str, entry: dict[str, Any], words: tuple[str, ...]
) -> None:
    rec, _ = make_layer(server.store, size=64)
    body = rec.model_dump(mode="json")
    body["tensors"]["t"].update(entry)
    with server.client() as client:
        attempt = register(client, run_name)
        bundle = open_bundle(client, run_name, attempt, step=1).json()
        answer = client.put(
            f"/v1/bundles/{bundle['id']}/layers/0/weights",
            json={"epoch": attempt["epoch"], "record": body},
        )
        recorded = client.get(f"/v1/bundles/{bundle['id']}").json()["recorded"]
    refused(answer, 422, *words)
    assert recorded == []


def test_the_contract_refuses_malformed_tensor_entries_and_far_steps() -> None:
    """The same rules hold wherever the contract is read (the agent reads manifests too)."""
    with pytest.raises(ValueError, match="begin after they end"):
        TensorEntry(dtype="U8", shape=(1,), data_offsets=(2, 1))
    with pytest.raises(ValueError, match="unknown dtype"):
        TensorEntry(dtype="complex64", shape=(1,), data_offsets=(0, 8))
    with pytest.raises(ValueError, match="less than or equal to"):
        Manifest(
            run="r",
            step=MAX_STEP + 1,
            world_size=1,
            created_at="now",
            versions=VERSIONS,  # type: ignore[arg-type]
            ranks=(),
        )


# --- steps ----------------------------------------------------------------------------------


def test_steps_stay_below_2_to_the_40(server: Server, run_name: str) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        beat = f"/v1/attempts/{attempt['attempt_id']}/heartbeat"
        opened = open_bundle(client, run_name, attempt, step=MAX_STEP + 1)
        beaten = client.post(beat, json={"step": MAX_STEP + 1})
        ended = client.post(
            f"/v1/attempts/{attempt['attempt_id']}/end",
            json={"reason": "failed", "step": MAX_STEP + 1},
        )
    for answer in (opened, beaten, ended):
        refused(answer, 422, "step", str(MAX_STEP))


@pytest.fixture(params=["postgres", "sqlite"])
def bounded(request: pytest.FixtureRequest, make_server: MakeServer) -> Server:
    """A control plane where a step may advance at most 100 past what an attempt reported."""
    backend: str = request.param
    return make_server(backend, max_step_advance=100)


def test_a_step_advances_at_most_the_bound_past_what_the_attempt_reported(
    bounded: Server, run_name: str
) -> None:
    with bounded.client() as client:
        attempt = register(client, run_name)
        beat = f"/v1/attempts/{attempt['attempt_id']}/heartbeat"
        too_far = client.post(beat, json={"step": 101})  # a fresh start is at step 0
        assert client.post(beat, json={"step": 100}).status_code == 200
        assert client.post(beat, json={"step": 200}).status_code == 200
        again_too_far = client.post(beat, json={"step": 301})
        end = f"/v1/attempts/{attempt['attempt_id']}/end"
        end_too_far = client.post(end, json={"reason": "preempted", "step": 301})
        last = client.get(f"/v1/runs/{run_name}/lineage").json()["attempts"][0]
        assert client.post(end, json={"reason": "preempted", "step": 300}).status_code == 200
    message = refused(too_far, 422, "step 101", "CKPT_MAX_STEP_ADVANCE", "step 0")
    assert "100 steps" in message
    refused(again_too_far, 422, "step 301", "step 200")
    refused(end_too_far, 422, "step 301", "step 200")
    assert last["last_step"] == 200 and last["ended_at"] is None  # nothing was written


def test_a_resumed_attempt_advances_from_the_step_it_resumed_from(
    bounded: Server, run_name: str
) -> None:
    with bounded.client() as client:
        first = register(client, run_name)
        save(client, bounded.store, run_name, first, step=5_000)
        second = register(client, run_name)
        assert second["resume_from"]["step"] == 5_000
        beat = f"/v1/attempts/{second['attempt_id']}/heartbeat"
        assert client.post(beat, json={"step": 5_100}).status_code == 200
        third = register(client, run_name)
        too_far = client.post(f"/v1/attempts/{third['attempt_id']}/heartbeat", json={"step": 5_101})
    refused(too_far, 422, "step 5101", "step 5000")


# --- path ids -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["{id}.0", "%20{id}", "{id}%20", "+{id}", "0{id}", "1_0", "1e0"])
def test_path_ids_are_plain_decimal_digits(server: Server, run_name: str, text: str) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        bundle = save(client, server.store, run_name, attempt, step=1)
        plain = client.get(f"/v1/bundles/{bundle['id']}")
        answer = client.get("/v1/bundles/" + text.format(id=bundle["id"]))
        beat = client.post(
            "/v1/attempts/" + text.format(id=attempt["attempt_id"]) + "/heartbeat",
            json={"step": 1},
        )
    assert plain.status_code == 200
    refused(answer, 422, "path.bundle", "decimal digits")
    refused(beat, 422, "path.attempt", "decimal digits")


@pytest.mark.parametrize("rank", ["00", "+0", "0.0", "%200"])
def test_rank_path_params_are_plain_decimal_digits(
    server: Server, run_name: str, rank: str
) -> None:
    rec, _ = make_layer(server.store)
    with server.client() as client:
        attempt = register(client, run_name)
        bundle = open_bundle(client, run_name, attempt, step=1).json()
        body = {"epoch": attempt["epoch"], "record": rec.model_dump(mode="json")}
        answer = client.put(f"/v1/bundles/{bundle['id']}/layers/{rank}/weights", json=body)
        figures = {"stall_seconds": 0, "persist_seconds": 0, "payload_bytes": 0, "new_bytes": 0}
        saves = client.put(f"/v1/bundles/{bundle['id']}/saves/{rank}", json=figures)
        committed = commit(client, bundle["id"], attempt["epoch"])
    refused(answer, 422, "path.rank")
    refused(saves, 422, "path.rank")
    assert committed.status_code == 409  # nothing was recorded


# --- logs -----------------------------------------------------------------------------------


def test_a_quarantine_reason_cannot_forge_a_log_line(
    server: Server, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    forged = "disk error\n2026-11-30 12:00:00,000 INFO ckpt.service bundle 1 is fine"
    with server.client() as client:
        attempt = register(client, run_name)
        bundle = save(client, server.store, run_name, attempt, step=1)
        with caplog.at_level(logging.INFO):
            answer = client.post(f"/v1/bundles/{bundle['id']}/quarantine", json={"reason": forged})
    assert answer.status_code == 422, answer.text
    assert all("\n" not in record.getMessage() for record in caplog.records)


def test_every_service_log_line_escapes_control_characters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    protect()
    with caplog.at_level(logging.INFO):
        logging.getLogger("ckpt.service").info("reason: %s", "a\nb\x1b[31m\u2028c\\n")
        logging.getLogger("ckpt.runs").warning("pod %r", "x\ry")
        logging.getLogger("ckpt.gc").info("plain %s", "text")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["reason: a\\nb\\x1b[31m\\u2028c\\\\n", "pod 'x\\ry'", "plain text"]


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain", "plain"),
        ("a\\nb", "a\\nb"),  # a literal backslash-n stays as it is on a clean line
        ("a\nb", "a\\nb"),
        ("a\\n\nb", "a\\\\n\\nb"),  # once a line needs escapes, backslashes double
        ("\x00\x7f\x85\u2029", "\\x00\\x7f\\x85\\u2029"),
        ("\u202elive\u2069 \\", "\\u202elive\\u2069 \\\\"),  # bidirectional controls
        ("tag\U000e0041", "tag\\U000e0041"),
        ("tab\there", "tab\\there"),
        ("é✓", "é✓"),
    ],
)
def test_escape(text: str, shown: str) -> None:
    assert escape(text) == shown
