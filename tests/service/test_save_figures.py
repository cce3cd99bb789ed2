"""Save figures: each rank reports what its save of a bundle cost (its stall and its save
tax, the tax when known); the bundle shows them and ``/metrics`` counts each rank's first
report once."""

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

FIGURES = {
    "stall_seconds": 0.25,
    "persist_seconds": 12.5,
    "payload_bytes": 4096,
    "new_bytes": 1024,
    "tax_seconds": 0.75,
}
COUNTED = (
    "ckpt_save_stall_seconds_count",
    "ckpt_save_stall_seconds_sum",
    "ckpt_save_tax_seconds_count",
    "ckpt_save_tax_seconds_sum",
    "ckpt_save_persist_seconds_count",
    "ckpt_save_persist_seconds_sum",
    "ckpt_save_payload_bytes_total",
    "ckpt_save_new_bytes_total",
)


def put_save(client: httpx.Client, bundle_id: int, rank: int, body: Any) -> httpx.Response:
    """PUT the figures: ``body`` as JSON, or as it is when bytes (JSON's ``Infinity``)."""
    path = f"/v1/bundles/{bundle_id}/saves/{rank}"
    if isinstance(body, bytes):
        return client.put(path, content=body, headers={"Content-Type": "application/json"})
    return client.put(path, json=body)


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
        # Rank 1 did not know its tax: it sends none (an older agent) or null.
        one = {k: v for k, v in FIGURES.items() if k != "tax_seconds"} | {"stall_seconds": 1.5}
        answers = [put_save(client, bundle_id, 1, one), put_save(client, bundle_id, 0, FIGURES)]
        bundle = client.get(f"/v1/bundles/{bundle_id}").json()
    for answer in answers:
        assert answer.status_code == 200, answer.text
    assert bundle["saves"] == [answers[1].json(), answers[0].json()]
    assert [{**s, "reported_at": None} for s in bundle["saves"]] == [
        {"rank": 0, **FIGURES, "reported_at": None},
        {"rank": 1, **one, "tax_seconds": None, "reported_at": None},
    ]
    assert datetime.fromisoformat(bundle["saves"][0]["reported_at"]).utcoffset() is not None


def test_a_second_report_replaces_the_first_and_counts_once(server: Server, run_name: str) -> None:
    again = {
        "stall_seconds": 3.0,
        "persist_seconds": 4.0,
        "payload_bytes": 8192,
        "new_bytes": 8,
        "tax_seconds": 5.5,
    }
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
        "ckpt_save_tax_seconds_count": 1,
        "ckpt_save_tax_seconds_sum": 0.75,
        "ckpt_save_persist_seconds_count": 1,
        "ckpt_save_persist_seconds_sum": 12.5,
        "ckpt_save_payload_bytes_total": 4096,
        "ckpt_save_new_bytes_total": 1024,
    }
    assert after_other == {
        "ckpt_save_stall_seconds_count": 2,
        "ckpt_save_stall_seconds_sum": 3.25,
        "ckpt_save_tax_seconds_count": 2,
        "ckpt_save_tax_seconds_sum": 6.25,
        "ckpt_save_persist_seconds_count": 2,
        "ckpt_save_persist_seconds_sum": 16.5,
        "ckpt_save_payload_bytes_total": 4096 + 8192,
        "ckpt_save_new_bytes_total": 1024 + 8,
    }


def test_a_tax_the_rank_did_not_know_is_stored_as_none_and_not_counted(
    server: Server, run_name: str
) -> None:
    """Unknown is not a tax of 0: it adds no sample to ``ckpt_save_tax_seconds``; a report
    again with the tax known replaces it (and counts nothing more)."""
    unknown = {**FIGURES, "tax_seconds": None}
    with server.client() as client:
        bundle_id = saved_bundle(client, server, run_name)
        first = put_save(client, bundle_id, 0, unknown)
        after_unknown = counted(client)
        known = put_save(client, bundle_id, 0, FIGURES)
        after_known = counted(client)
    assert first.status_code == 200, first.text
    assert first.json()["tax_seconds"] is None
    assert known.json()["tax_seconds"] == 0.75
    assert after_unknown["ckpt_save_stall_seconds_count"] == 1
    assert after_unknown["ckpt_save_tax_seconds_count"] == 0
    assert after_unknown["ckpt_save_tax_seconds_sum"] == 0
    assert after_known == after_unknown  # a replace counts nothing


def test_the_tax_falls_in_the_histograms_buckets(server: Server, run_name: str) -> None:
    with server.client() as client:
        bundle_id = saved_bundle(client, server, run_name)
        put_save(client, bundle_id, 0, {**FIGURES, "tax_seconds": 3.0}).raise_for_status()
        text = client.get("/metrics").text
    buckets = {
        sample.labels["le"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "ckpt_save_tax_seconds_bucket"
    }
    assert (buckets["2.5"], buckets["5.0"], buckets["+Inf"]) == (0, 1, 1)


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


# The rest of FIGURES, after a tax_seconds written by hand (JSON's Infinity and NaN).
FIGURES_TAIL = (
    b', "stall_seconds": 0.25, "persist_seconds": 12.5, "payload_bytes": 4096, "new_bytes": 1}'
)
TAX = "body.tax_seconds: Input should be"
BAD: dict[str, tuple[int, Any, str]] = {  # rank, body, a word the message must name
    "rank_beyond_the_world": (2, FIGURES, "ranks are 0 to 1"),
    "rank_negative": (-1, FIGURES, "path.rank"),
    "rank_beyond_any_world": (16384, FIGURES, "path.rank"),
    "stall_negative": (0, {**FIGURES, "stall_seconds": -0.5}, "body.stall_seconds"),
    "persist_negative": (0, {**FIGURES, "persist_seconds": -1}, "body.persist_seconds"),
    "stall_a_word": (0, {**FIGURES, "stall_seconds": "fast"}, "body.stall_seconds"),
    # The tax's own words (not "Extra inputs are not permitted": the field is known).
    "tax_negative": (0, {**FIGURES, "tax_seconds": -0.5}, f"{TAX} greater than or equal to 0"),
    "tax_a_word": (0, {**FIGURES, "tax_seconds": "slow"}, f"{TAX} a valid number"),
    "tax_infinite": (0, b'{"tax_seconds": Infinity' + FIGURES_TAIL, f"{TAX} a finite number"),
    "tax_not_a_number": (0, b'{"tax_seconds": NaN' + FIGURES_TAIL, f"{TAX} a finite number"),
    "tax_beyond_a_billion": (0, {**FIGURES, "tax_seconds": 2e9}, f"{TAX} less than or equal"),
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
