"""Save figures: each rank reports what its save of a bundle cost; the bundle shows them and
``/metrics`` counts each rank's first report once."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import delete, func, select

from service.models import Bundle, Save
from tests.service.conftest import Server
from tests.service.helpers import register, save

FIGURES = {"stall_seconds": 0.25, "persist_seconds": 12.5, "payload_bytes": 4096, "new_bytes": 1024}
COUNTED = (
    "ckpt_save_stall_seconds_count",
    "ckpt_save_stall_seconds_sum",
    "ckpt_save_persist_seconds_count",
    "ckpt_save_persist_seconds_sum",
    "ckpt_save_payload_bytes_total",
    "ckpt_save_new_bytes_total",
)


def put_save(client: httpx.Client, bundle_id: int, rank: int, body: Any) -> httpx.Response:
    return client.put(f"/v1/bundles/{bundle_id}/saves/{rank}", json=body)


def counted(client: httpx.Client) -> dict[str, float]:
    """The save metrics' unlabelled samples, as ``/metrics`` shows them."""
    text = client.get("/metrics").text
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }
    return {name: samples[name] for name in COUNTED}


def saved_bundle(client: httpx.Client, server: Server, run: str, *, world_size: int = 2) -> int:
    attempt = register(client, run)
    bundle_id: int = save(client, server.store, run, attempt, step=10, world_size=world_size)["id"]
    return bundle_id


def test_the_bundle_shows_each_ranks_figures_by_rank(server: Server, run_name: str) -> None:
    with server.client() as client:
        bundle_id = saved_bundle(client, server, run_name)
        assert client.get(f"/v1/bundles/{bundle_id}").json()["saves"] == []
        one = {**FIGURES, "stall_seconds": 1.5, "new_bytes": 0}
        answers = [put_save(client, bundle_id, 1, one), put_save(client, bundle_id, 0, FIGURES)]
        bundle = client.get(f"/v1/bundles/{bundle_id}").json()
    for answer in answers:
        assert answer.status_code == 200, answer.text
    assert bundle["saves"] == [answers[1].json(), answers[0].json()]
    assert [{**s, "reported_at": None} for s in bundle["saves"]] == [
        {"rank": 0, **FIGURES, "reported_at": None},
        {"rank": 1, **one, "reported_at": None},
    ]
    assert datetime.fromisoformat(bundle["saves"][0]["reported_at"]).utcoffset() is not None


def test_a_second_report_replaces_the_first_and_counts_once(server: Server, run_name: str) -> None:
    again = {"stall_seconds": 3.0, "persist_seconds": 4.0, "payload_bytes": 8192, "new_bytes": 8}
    with server.client() as client:
        bundle_id = saved_bundle(client, server, run_name)
        assert set(counted(client).values()) == {0}
        first = put_save(client, bundle_id, 0, FIGURES)
        second = put_save(client, bundle_id, 0, again)
        after_replace = counted(client)
        other = put_save(client, bundle_id, 1, again)
        after_other = counted(client)
        shown = client.get(f"/v1/bundles/{bundle_id}").json()["saves"]
    for answer in (first, second, other):
        assert answer.status_code == 200, answer.text
    assert second.json() == {"rank": 0, **again, "reported_at": second.json()["reported_at"]}
    assert shown == [second.json(), other.json()]
    assert after_replace == {
        "ckpt_save_stall_seconds_count": 1,
        "ckpt_save_stall_seconds_sum": 0.25,
        "ckpt_save_persist_seconds_count": 1,
        "ckpt_save_persist_seconds_sum": 12.5,
        "ckpt_save_payload_bytes_total": 4096,
        "ckpt_save_new_bytes_total": 1024,
    }
    assert after_other == {
        "ckpt_save_stall_seconds_count": 2,
        "ckpt_save_stall_seconds_sum": 3.25,
        "ckpt_save_persist_seconds_count": 2,
        "ckpt_save_persist_seconds_sum": 16.5,
        "ckpt_save_payload_bytes_total": 4096 + 8192,
        "ckpt_save_new_bytes_total": 1024 + 8,
    }


def test_a_fenced_attempt_still_reports_its_figures(server: Server, run_name: str) -> None:
    with server.client() as client:
        bundle_id = saved_bundle(client, server, run_name, world_size=1)
        register(client, run_name)  # a newer attempt fences the one that saved
        answer = put_save(client, bundle_id, 0, FIGURES)
    assert answer.status_code == 200, answer.text


def test_an_unknown_bundle_is_not_found(server: Server) -> None:
    with server.client() as client:
        answer = put_save(client, 987654321, 0, FIGURES)
        metrics = counted(client)
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"] == "not_found"
    assert "987654321" in answer.json()["message"]
    assert set(metrics.values()) == {0}


BAD: dict[str, tuple[int, Any, str]] = {  # rank, body, a word the message must name
    "rank_beyond_the_world": (2, FIGURES, "ranks are 0 to 1"),
    "rank_negative": (-1, FIGURES, "path.rank"),
    "rank_beyond_any_world": (16384, FIGURES, "path.rank"),
    "stall_negative": (0, {**FIGURES, "stall_seconds": -0.5}, "body.stall_seconds"),
    "persist_negative": (0, {**FIGURES, "persist_seconds": -1}, "body.persist_seconds"),
    "stall_a_word": (0, {**FIGURES, "stall_seconds": "fast"}, "body.stall_seconds"),
    "bytes_negative": (0, {**FIGURES, "new_bytes": -1}, "body.new_bytes"),
    "bytes_fractional": (0, {**FIGURES, "payload_bytes": 1.5}, "body.payload_bytes"),
    "bytes_beyond_64_bits": (0, {**FIGURES, "payload_bytes": 2**64}, "body.payload_bytes"),
    "extra_field": (0, {**FIGURES, "epoch": 1}, "body.epoch"),
    "missing_field": (0, {k: v for k, v in FIGURES.items() if k != "new_bytes"}, "new_bytes"),
    "not_an_object": (0, [FIGURES], "body"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_figures_are_refused_and_nothing_is_stored(
    server: Server, run_name: str, case: str
) -> None:
    rank, body, word = BAD[case]
    with server.client() as client:
        bundle_id = saved_bundle(client, server, run_name)
        answer = put_save(client, bundle_id, rank, body)
        shown = client.get(f"/v1/bundles/{bundle_id}").json()["saves"]
        metrics = counted(client)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"] == "invalid_request"
    assert word in answer.json()["message"], answer.json()["message"]
    assert shown == []
    assert set(metrics.values()) == {0}


def test_only_the_runs_writers_report(server: Server, run_name: str) -> None:
    with server.client() as admin:
        bundle_id = saved_bundle(admin, server, run_name)
        register(admin, f"{run_name}-other")
        tokens = {
            role_run: admin.post("/v1/tokens", json=body).json()["token"]
            for role_run, body in {
                "read": {"role": "read"},
                "other": {"role": "run", "run": f"{run_name}-other"},
                "own": {"role": "run", "run": run_name},
            }.items()
        }
    statuses = {}
    for name, token in {"none": None, **tokens}.items():
        with server.client(token) as client:
            statuses[name] = put_save(client, bundle_id, 0, FIGURES).status_code
    assert statuses == {"none": 401, "read": 403, "other": 403, "own": 200}


def test_deleting_a_bundle_deletes_its_figures(server: Server, run_name: str) -> None:
    """No endpoint deletes bundle rows; this checks the migration's ON DELETE CASCADE."""
    with server.client() as client:
        bundle_id = saved_bundle(client, server, run_name)
        for rank in (0, 1):
            assert put_save(client, bundle_id, rank, FIGURES).status_code == 200
    with server.context.transaction() as session:
        assert session.scalar(select(func.count()).select_from(Save)) == 2
        session.execute(delete(Bundle).where(Bundle.id == bundle_id))
    with server.context.transaction() as session:
        assert session.scalar(select(func.count()).select_from(Save)) == 0
