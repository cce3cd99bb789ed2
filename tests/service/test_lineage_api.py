"""Lineage over the API: three preemptions, a lost save and a rollback make the expected tree.

attempt 1   10 ── 20                                    preempted
attempt 2          └─ 30 ── 40                          preempted
attempt 3                    └─ 50 ── (60, pending)     preempted mid-save
attempt 4                          └─ 70                rolled back to 30
attempt 5             30 ── 40' ── 50'                  live
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.service.conftest import Server
from tests.service.helpers import open_bundle, register, save


def end(client: httpx.Client, attempt: dict[str, Any], **body: Any) -> dict[str, Any]:
    response = client.post(f"/v1/attempts/{attempt['attempt_id']}/end", json=body)
    assert response.status_code == 200, response.text
    ended: dict[str, Any] = response.json()
    return ended


def resumed_from(attempt: dict[str, Any]) -> int | None:
    point = attempt["resume_from"]
    return None if point is None else int(point["bundle_id"])


@dataclass
class Played:
    ids: dict[str, int]  # bundle label ("10", "40'"...) -> id
    attempts: list[dict[str, Any]]  # the registrations, attempt 1 first
    lineage: dict[str, Any]
    resumable: dict[str, Any]

    @property
    def label(self) -> dict[int, str]:
        """Bundle id -> label."""
        return {bundle_id: name for name, bundle_id in self.ids.items()}

    @property
    def attempt_no(self) -> dict[int, int]:
        """Attempt id -> 1..5."""
        return {a["attempt_id"]: n for n, a in enumerate(self.attempts, start=1)}


def play(server: Server, run: str) -> Played:
    store = server.store
    ids: dict[str, int] = {}  # bundle label -> id
    with server.client() as client:

        def saved(label: str, attempt: dict[str, Any], step: int) -> None:
            ids[label] = save(client, store, run, attempt, step=step)["id"]

        a1 = register(client, run, pod="pod-1")
        assert a1["resume_from"] is None
        saved("10", a1, 10)
        saved("20", a1, 20)
        end(client, a1, reason="preempted", final_save_committed=True)

        a2 = register(client, run, pod="pod-2")
        assert resumed_from(a2) == ids["20"]
        saved("30", a2, 30)
        saved("40", a2, 40)
        end(client, a2, reason="preempted", final_save_committed=True)

        a3 = register(client, run, pod="pod-3")
        assert resumed_from(a3) == ids["40"]
        saved("50", a3, 50)
        opened = open_bundle(client, run, a3, step=60)  # preempted before it commits
        assert opened.status_code == 201, opened.text
        ids["60"] = opened.json()["id"]
        end(client, a3, reason="preempted", final_save_committed=False)

        a4 = register(client, run, pod="pod-4")
        assert resumed_from(a4) == ids["50"]  # not the pending 60
        saved("70", a4, 70)

        rolled = client.post(f"/v1/runs/{run}/rollback", json={"bundle_id": ids["30"]})
        assert rolled.status_code == 200, rolled.text
        assert rolled.json()["from_bundle_id"] == ids["70"]
        assert rolled.json()["head"]["id"] == ids["30"]
        assert rolled.json()["epoch"] == 5

        a5 = register(client, run, pod="pod-5")
        assert resumed_from(a5) == ids["30"]
        saved("40'", a5, 40)
        saved("50'", a5, 50)

        response = client.get(f"/v1/runs/{run}/lineage")
        assert response.status_code == 200, response.text
        lineage = response.json()
        resumable = client.get(f"/v1/runs/{run}/resumable")
        assert resumable.status_code == 200, resumable.text
    return Played(ids, [a1, a2, a3, a4, a5], lineage, resumable.json())


def test_preemptions_and_rollback_make_the_expected_tree(server: Server, run_name: str) -> None:
    played = play(server, run_name)
    ids, attempts, lineage, label = played.ids, played.attempts, played.lineage, played.label
    attempt_no = played.attempt_no

    assert lineage["run"] == run_name
    assert lineage["epoch"] == 6
    assert [a["epoch"] for a in attempts] == [1, 2, 3, 4, 6]

    # Parent edges: the previous bundle of the attempt, or the bundle it resumed from.
    edges = sorted((label[e["parent"]], label[e["child"]]) for e in lineage["parent_edges"])
    assert edges == sorted(
        [
            ("10", "20"),
            ("20", "30"),
            ("30", "40"),
            ("40", "50"),
            ("50", "60"),
            ("50", "70"),
            ("30", "40'"),
            ("40'", "50'"),
        ]
    )
    resume_edges = sorted(
        (attempt_no[e["attempt"]], label[e["bundle"]]) for e in lineage["resume_edges"]
    )
    assert resume_edges == [(2, "20"), (3, "40"), (4, "50"), (5, "30")]

    assert len(lineage["rollbacks"]) == 1
    rollback = lineage["rollbacks"][0]
    assert (rollback["from_bundle_id"], rollback["to_bundle_id"], rollback["epoch"]) == (
        ids["70"],
        ids["30"],
        5,
    )

    # 30 has two children after the rollback (40 and 40'); 50 has two as well, the lost save
    # 60 and attempt 4's 70 ("where a rollback (or a lost save) split the run").
    assert [label[f] for f in lineage["forks"]] == ["30", "50"]
    assert [label[b] for b in lineage["live_branch"]] == ["50'", "40'", "30", "20", "10"]
    assert lineage["head_id"] == ids["50'"]
    assert lineage["resumable_id"] == ids["50'"]
    assert played.resumable["bundle_id"] == ids["50'"]
    assert played.resumable["step"] == 50
    check_bundles(played)
    check_attempts(played)


def check_bundles(played: Played) -> None:
    ids, label, attempt_no = played.ids, played.label, played.attempt_no
    bundles = {label[b["id"]]: b for b in played.lineage["bundles"]}
    assert set(bundles) == set(ids)
    live = {"10", "20", "30", "40'", "50'"}
    assert {name for name, b in bundles.items() if b["live"]} == live
    assert {name: b["status"] for name, b in bundles.items() if b["status"] != "complete"} == {
        "60": "pending"
    }
    steps = {name: int(name.rstrip("'")) for name in ids}
    made_by = {"10": 1, "20": 1, "30": 2, "40": 2, "50": 3, "60": 3, "70": 4, "40'": 5, "50'": 5}
    for name, b in bundles.items():
        assert b["step"] == steps[name], name
        assert attempt_no[b["attempt_id"]] == made_by[name], name
    assert bundles["10"]["parent_id"] is None


def check_attempts(played: Played) -> None:
    ids, attempt_no = played.ids, played.attempt_no
    listed = {attempt_no[a["id"]]: a for a in played.lineage["attempts"]}
    assert sorted(listed) == [1, 2, 3, 4, 5]
    assert {n: a["epoch"] for n, a in listed.items()} == {1: 1, 2: 2, 3: 3, 4: 4, 5: 6}
    assert {n: a["fenced"] for n, a in listed.items()} == {
        1: True,
        2: True,
        3: True,
        4: True,
        5: False,
    }
    assert {n: a["end_reason"] for n, a in listed.items()} == {
        1: "preempted",
        2: "preempted",
        3: "preempted",
        4: None,
        5: None,
    }
    assert {n: a["final_save_committed"] for n, a in listed.items()} == {
        1: True,
        2: True,
        3: False,
        4: None,
        5: None,
    }
    assert {n: a["resumed_from_id"] for n, a in listed.items()} == {
        1: None,
        2: ids["20"],
        3: ids["40"],
        4: ids["50"],
        5: ids["30"],
    }
    assert {n: a["pod"] for n, a in listed.items()} == {n: f"pod-{n}" for n in range(1, 6)}


@pytest.mark.parametrize("limit", [1, 3, 4, 1000])
def test_pages_of_the_lineage_add_up_to_the_whole(
    server: Server, run_name: str, limit: int
) -> None:
    played = play(server, run_name)
    whole = played.lineage
    pages: list[dict[str, Any]] = []
    with server.client() as client:
        params: dict[str, int] = {"limit": limit}
        while True:
            answer = client.get(f"/v1/runs/{run_name}/lineage", params=params)
            assert answer.status_code == 200, answer.text
            pages.append(answer.json())
            if pages[-1]["next_before"] is None:
                break
            params["before"] = pages[-1]["next_before"]
        for bad in ({"limit": 0}, {"limit": 10_001}, {"before": 0}, {"limit": "many"}):
            refused = client.get(f"/v1/runs/{run_name}/lineage", params=bad)
            assert refused.status_code == 422, (bad, refused.text)
    assert len(pages) == -(-len(whole["bundles"]) // limit)
    assert all(len(page["bundles"]) <= limit for page in pages)
    newest_first = list(reversed(pages))
    assert [b for page in newest_first for b in page["bundles"]] == whole["bundles"]
    assert [i for page in pages for i in page["live_branch"]] == whole["live_branch"]
    for key in ("parent_edges", "resume_edges", "rollbacks"):
        found = [item for page in pages for item in page[key]]
        assert all(item in whole[key] for item in found), key
        assert all(item in found for item in whole[key]), key
    assert sorted({fork for page in pages for fork in page["forks"]}) == whole["forks"]
    attempts = {a["id"]: a for page in pages for a in page["attempts"]}
    by_epoch = sorted(attempts.values(), key=lambda a: a["epoch"])
    assert by_epoch == [a for a in whole["attempts"] if a["id"] in attempts]
    owners = {b["attempt_id"] for b in whole["bundles"]}
    assert owners <= attempts.keys()
    for page in pages:
        for key in ("run", "epoch", "head_id", "resumable_id"):
            assert page[key] == whole[key], key
        ids = {b["id"] for b in page["bundles"]}
        assert all(edge["child"] in ids for edge in page["parent_edges"])
        assert all(fork in ids for fork in page["forks"])
    assert whole["next_before"] is None
