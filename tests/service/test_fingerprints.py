"""Resumes that prove themselves, the control plane's side: fingerprints ride on heartbeats
into a ring per (attempt, rank), the replay serves the newest earlier attempt's fingerprints
after a position, and a resumed attempt's verdict is validated, shown, counted and fenced."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from service.models import Fingerprint
from tests.service.conftest import MakeServer, Server
from tests.service.helpers import register


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as opened:
        yield opened


def fp(step: int, micro_step: int = 0, *, tag: str = "a") -> dict[str, Any]:
    return {
        "step": step,
        "micro_step": micro_step,
        "loss": 1.0 / (step + 1),
        "parts": {"params": f"{tag}{step:x}.{micro_step}"},
    }


def beat(
    client: httpx.Client, attempt: dict[str, Any], prints: list[dict[str, Any]], *, rank: int = 0
) -> httpx.Response:
    return client.post(
        f"/v1/attempts/{attempt['attempt_id']}/heartbeat",
        json={"rank": rank, "fingerprints": prints},
    )


def replay(
    client: httpx.Client, attempt: dict[str, Any], *, rank: int = 0, after: tuple[int, int] = (0, 0)
) -> dict[str, Any]:
    response = client.get(
        f"/v1/attempts/{attempt['attempt_id']}/replay",
        params={"rank": rank, "after_step": after[0], "after_micro_step": after[1]},
    )
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


def positions(found: dict[str, Any]) -> list[tuple[int, int]]:
    return [(f["step"], f["micro_step"]) for f in found["fingerprints"]]


def verify(client: httpx.Client, attempt: dict[str, Any], **body: Any) -> httpx.Response:
    return client.put(f"/v1/attempts/{attempt['attempt_id']}/verification", json=body)


def stored(server: Server) -> int:
    with server.context.transaction() as session:
        return session.scalar(select(func.count()).select_from(Fingerprint)) or 0


def verdicts(client: httpx.Client) -> dict[str, float]:
    """ckpt_resume_verifications_total by verdict."""
    found = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("ckpt_resume_verifications_total{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('"')[1]] = float(value)
    return found


NONE = {"verified": 0.0, "diverged": 0.0, "unverifiable": 0.0}
VERIFIED = {"verdict": "verified", "mode": "exact", "steps_compared": 3, "from_attempt_id": None}
DIFFERENCE = {
    "step": 7,
    "micro_step": 0,
    "rank": 1,
    "part": "loss",
    "expected": "2.3809",
    "got": "2.3811",
}


def test_the_replay_is_the_newest_earlier_attempts_fingerprints_after_the_position(
    server: Server, client: httpx.Client, run_name: str
) -> None:
    first = register(client, run_name)
    assert beat(client, first, [fp(s) for s in range(1, 11)] + [fp(10, 1)]).status_code == 200
    assert beat(client, first, [fp(s) for s in range(1, 6)], rank=1).status_code == 200
    second = register(client, run_name)  # resumed at 5, died at 8
    assert beat(client, second, [fp(s, tag="b") for s in (6, 7, 8)]).status_code == 200
    third = register(client, run_name)

    from_second = replay(client, third, after=(5, 0))
    assert from_second["from_attempt_id"] == second["attempt_id"]
    assert positions(from_second) == [(6, 0), (7, 0), (8, 0)]
    assert from_second["fingerprints"][0] == fp(6, tag="b")
    # The second attempt computed nothing after step 8: the first did.
    from_first = replay(client, third, after=(8, 0))
    assert from_first["from_attempt_id"] == first["attempt_id"]
    assert positions(from_first) == [(9, 0), (10, 0), (10, 1)]
    assert positions(replay(client, third, after=(10, 0))) == [(10, 1)]
    # Ranks are apart: the second attempt sent nothing of rank 1.
    rank_one = replay(client, third, rank=1, after=(2, 0))
    assert rank_one["from_attempt_id"] == first["attempt_id"]
    assert positions(rank_one) == [(3, 0), (4, 0), (5, 0)]
    # Only earlier attempts count, and not a position past every fingerprint.
    assert replay(client, second, after=(5, 0))["from_attempt_id"] == first["attempt_id"]
    assert replay(client, first) == {"from_attempt_id": None, "fingerprints": []}
    assert replay(client, third, rank=2) == {"from_attempt_id": None, "fingerprints": []}
    assert replay(client, third, after=(10, 1)) == {"from_attempt_id": None, "fingerprints": []}
    missing = client.get("/v1/attempts/987654/replay")
    assert missing.status_code == 404, missing.text


def test_the_ring_keeps_each_ranks_newest_positions_and_a_resent_one_replaces(
    make_server: MakeServer, backend: str, run_name: str
) -> None:
    server = make_server(backend, fingerprint_ring=5)
    with server.client() as client:
        dead = register(client, run_name)
        assert beat(client, dead, [fp(s) for s in range(1, 5)]).status_code == 200
        assert beat(client, dead, [fp(s, tag="new") for s in range(3, 9)]).status_code == 200
        assert beat(client, dead, [fp(s) for s in range(1, 3)], rank=1).status_code == 200
        # One request naming a position twice: the last wins.
        assert beat(client, dead, [fp(8, tag="x"), fp(8, tag="y")]).status_code == 200
        resumed = register(client, run_name)

        kept = replay(client, resumed)
        assert positions(kept) == [(s, 0) for s in range(4, 9)]
        assert kept["fingerprints"][0] == fp(4, tag="new")
        assert kept["fingerprints"][-1] == fp(8, tag="y")
        assert positions(replay(client, resumed, rank=1)) == [(1, 0), (2, 0)]
        assert stored(server) == 7


def test_a_fenced_attempt_stores_no_fingerprints_and_reports_no_verdict(
    server: Server, client: httpx.Client, run_name: str
) -> None:
    fenced = register(client, run_name)
    register(client, run_name)
    refused = beat(client, fenced, [fp(1), fp(2)])
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"] == "fenced"
    refused = verify(client, fenced, **VERIFIED)
    assert refused.status_code == 409, refused.text
    assert stored(server) == 0
    attempts = client.get(f"/v1/runs/{run_name}/lineage").json()["attempts"]
    assert [a["verification"] for a in attempts] == [None, None]
    assert verdicts(client) == NONE


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({**VERIFIED, "verdict": "diverged"}, "first_difference is required"),
        ({**VERIFIED, "first_difference": DIFFERENCE}, "must be null"),
        ({**VERIFIED, "verdict": "maybe"}, "verdict"),
        ({**VERIFIED, "mode": "loose"}, "mode"),
        ({**VERIFIED, "steps_compared": -1}, "steps_compared"),
        ({**VERIFIED, "detail": "x" * 501}, "detail"),
        ({**VERIFIED, "max_relative_difference": -0.5}, "max_relative_difference"),
        ({**VERIFIED, "extra": 1}, "extra"),
    ],
)
def test_a_bad_verdict_is_refused_with_what_to_fix_and_nothing_recorded(
    client: httpx.Client, run_name: str, body: dict[str, Any], says: str
) -> None:
    attempt = register(client, run_name)
    response = verify(client, attempt, **body)
    assert response.status_code == 422, response.text
    assert says in response.text
    assert client.get(f"/v1/runs/{run_name}/lineage").json()["attempts"][0]["verification"] is None
    assert verdicts(client) == NONE


def test_a_verdict_must_name_an_earlier_attempt_of_its_run(
    client: httpx.Client, run_name: str
) -> None:
    other = register(client, f"{run_name}-other")
    attempt = register(client, run_name)
    for source in (other["attempt_id"], attempt["attempt_id"]):
        response = verify(client, attempt, **{**VERIFIED, "from_attempt_id": source})
        assert response.status_code == 422, response.text
        assert "not an earlier attempt" in response.json()["message"]


@pytest.mark.parametrize(
    ("prints", "says"),
    [
        ([fp(s) for s in range(513)], "512"),
        ([{**fp(1), "parts": {f"p{i}": "x" for i in range(9)}}], "8"),
        ([{**fp(1), "parts": {"Params": "x"}}], "pattern"),
        ([{**fp(1), "parts": {"params": "x" * 129}}], "128"),
        ([{**fp(1), "parts": {"params": "ab\ncd"}}], "pattern"),
        ([{**fp(1), "step": -1}], "step"),
        ([{**fp(1), "micro_step": "1"}], "micro_step"),
        ([{**fp(1), "extra": 1}], "extra"),
    ],
)
def test_bad_fingerprints_are_refused_with_what_to_fix_and_none_kept(
    server: Server, client: httpx.Client, run_name: str, prints: list[dict[str, Any]], says: str
) -> None:
    attempt = register(client, run_name)
    response = beat(client, attempt, [fp(1), *prints])
    assert response.status_code == 422, response.text
    assert says in response.text
    assert stored(server) == 0


def test_an_infinite_loss_is_refused(server: Server, client: httpx.Client, run_name: str) -> None:
    attempt = register(client, run_name)
    response = client.post(
        f"/v1/attempts/{attempt['attempt_id']}/heartbeat",
        content=b'{"fingerprints": [{"step": 1, "loss": Infinity, "parts": {}}]}',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 422, response.text
    assert stored(server) == 0


def test_a_verdict_is_shown_replaced_by_a_retry_and_counted_once(
    server: Server, client: httpx.Client, run_name: str
) -> None:
    dead = register(client, run_name)
    resumed = register(client, run_name)
    diverged = {
        "verdict": "diverged",
        "mode": "tolerance",
        "steps_compared": 4,
        "from_attempt_id": dead["attempt_id"],
        "first_difference": DIFFERENCE,
        "max_relative_difference": 8.4e-5,
        "detail": "loss differs: likely the data layer",
    }
    first = verify(client, resumed, **VERIFIED)
    assert first.status_code == 200, first.text
    assert first.json()["verification"] == {**VERIFIED, "first_difference": None} | {
        "max_relative_difference": None,
        "detail": "",
    }
    retried = verify(client, resumed, **diverged)
    assert retried.status_code == 200, retried.text
    attempts = client.get(f"/v1/runs/{run_name}/lineage").json()["attempts"]
    assert [a["verification"] for a in attempts] == [None, diverged]
    assert verdicts(client) == {"verified": 1.0, "diverged": 0.0, "unverifiable": 0.0}
    again = register(client, run_name)
    assert verify(client, again, **diverged).status_code == 200
    assert verdicts(client) == {"verified": 1.0, "diverged": 1.0, "unverifiable": 0.0}


def test_ckpt_attempts_prints_each_attempts_verdict(
    server: Server, client: httpx.Client, run_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckpt.cli import main

    first = register(client, run_name)
    verified = register(client, run_name)
    assert verify(client, verified, **{**VERIFIED, "steps_compared": 37}).status_code == 200
    diverged = register(client, run_name)
    body = {**VERIFIED, "verdict": "diverged", "first_difference": {**DIFFERENCE, "step": 1204}}
    assert verify(client, diverged, **body).status_code == 200
    unverifiable = register(client, run_name)
    body = {**VERIFIED, "verdict": "unverifiable", "steps_compared": 0}
    assert verify(client, unverifiable, **body).status_code == 200

    asked = ["attempts", run_name, "--server", server.url, "--token", server.admin_token]
    assert main(asked) == 0
    lines = capsys.readouterr().out.splitlines()
    ends = {int(line.split()[0]): line for line in lines[2:]}
    assert ends[first["attempt_id"]].endswith(" -")
    assert ends[verified["attempt_id"]].endswith(" verified 37 steps")
    assert ends[diverged["attempt_id"]].endswith(" diverged at 1204 rank 1: loss 2.3811 vs 2.3809")
    assert ends[unverifiable["attempt_id"]].endswith(" unverifiable")
