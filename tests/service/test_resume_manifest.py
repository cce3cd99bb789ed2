"""What a restarting job waits on answers the manifest of its resume point as the catalog
holds it, not parsed, checked and written out again (a 64-rank job's, 8 MB, held the GIL
0.7 s a time): ``/resumable`` and a registration's ``resume_from``, whether the resume
point is the run's head or older, on both databases; and it reads as the manifest
committed."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Text, cast, select

from ckpt.core.contract import Manifest
from service.models import Bundle
from service.runs.schemas import AttemptRegistered, ResumePoint
from tests.service.conftest import Server
from tests.service.helpers import open_bundle, register, save


def held(server: Server, bundle_id: int) -> str:
    """The bundle's manifest as the catalog holds its JSON."""
    with server.context.transaction() as session:
        text = session.scalar(select(cast(Bundle.manifest, Text)).where(Bundle.id == bundle_id))
    assert text is not None
    return text


def check_point(point: dict[str, Any], answer: str, *, bundle: int, step: int, text: str) -> None:
    assert text in answer  # passed through as the catalog holds it
    assert (point["bundle_id"], point["step"], point["micro_step"]) == (bundle, step, 0)
    assert Manifest.model_validate(point["manifest"]) == Manifest.model_validate_json(text)


def test_the_resume_point_answers_the_manifest_as_held(server: Server, run_name: str) -> None:
    with server.client() as client:
        first = register(client, run_name)
        assert first["resume_from"] is None
        saved = save(client, server.store, run_name, first, step=5)
        text = held(server, saved["id"])
        for pending in (False, True):  # the head; then an older bundle, past a pending head
            if pending:
                opened = open_bundle(client, run_name, first, step=9)
                assert opened.status_code == 201, opened.text
            answer = client.get(f"/v1/runs/{run_name}/resumable")
            assert answer.status_code == 200, answer.text
            assert answer.headers["content-type"] == "application/json"
            point = ResumePoint.model_validate_json(answer.content).model_dump(mode="json")
            check_point(point, answer.text, bundle=saved["id"], step=5, text=text)
        answer = client.post(f"/v1/runs/{run_name}/attempts", json={})
        assert answer.status_code == 201, answer.text
        registered = AttemptRegistered.model_validate_json(answer.content).model_dump(mode="json")
        assert registered["epoch"] == first["epoch"] + 1
        assert registered["run"] == run_name
        assert registered["store"] == first["store"]
        check_point(registered["resume_from"], answer.text, bundle=saved["id"], step=5, text=text)
