"""A bundle whose stored bytes rotted: the resume detects it, sets the bundle aside (the
catalog quarantines it), falls back to the bundle before it, says so loudly, and the resumed
run is bit-exact with respect to that older bundle."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from agent.catalog.manifests import load_manifest
from agent.demo.compare import differences
from ckpt import Layer
from ckpt.core.storage import DirectoryStore, keys
from tests.conftest import run_trainer
from tests.server_process import ckpt_server

pytestmark = pytest.mark.slow

STEPS = ("--steps", "24", "--total-steps", "32", "--every", "8")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reference")
    return run_trainer(root / "store", root / "reference.pt", *STEPS)


def rot_step(store: Path, run: str, step: int) -> str:
    """Flip one byte of the blob that only the bundle at ``step`` has: its counters."""
    manifest = load_manifest(DirectoryStore(store), keys.manifest_key(run, step))
    sha = manifest.ranks[0].layers[Layer.COUNTERS].blobs[0].sha256
    path = store / keys.blob_key(sha)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return sha


def test_store_only_resume_falls_back_past_a_rotten_bundle(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    store = tmp_path / "store"
    run_trainer(
        store, tmp_path / "killed.pt", *STEPS, "--run", "rot", "--kill-at", "20", expect_rc=-9
    )
    rot_step(store, "rot", 16)
    resumed = run_trainer(store, tmp_path / "resumed.pt", *STEPS, "--run", "rot")
    assert resumed["positions"][0] == (8, 1)
    assert differences(reference, resumed) == []


def test_the_control_plane_quarantines_a_rotten_bundle_and_resumes_the_one_before(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    with ckpt_server(tmp_path) as server:
        env = {**server.env(), "CKPT_RUN": "rot"}
        store = Path(server.store)
        run_trainer(
            store,
            tmp_path / "killed.pt",
            *STEPS,
            "--run",
            "rot",
            "--kill-at",
            "20",
            expect_rc=-9,
            env=env,
        )
        rotten = rot_step(store, "rot", 16)
        resumed = run_trainer(store, tmp_path / "resumed.pt", *STEPS, "--run", "rot", env=env)
        with server.client() as client:
            lineage = client.get("/v1/runs/rot/lineage").json()
    assert resumed["positions"][0] == (8, 1)
    assert differences(reference, resumed) == []
    # Saving step 16 again wrote the rotten blob again (it was the same blob: the counters of
    # step 16), as store-only does; else every later resume would fall back again.
    blob = (store / keys.blob_key(rotten)).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == rotten
    first, _, third = (a["id"] for a in lineage["attempts"])
    saved = {(b["attempt_id"], b["step"]): b for b in lineage["bundles"]}
    assert saved[first, 16]["status"] == "quarantined"
    assert saved[first, 8]["status"] == "complete"
    # The second attempt was offered 16; after quarantining it, it registered again (the
    # third attempt), resumed from 8, and saved 16 and 24 again on a new branch.
    assert [a["resumed_from_id"] for a in lineage["attempts"]] == [
        None,
        saved[first, 16]["id"],
        saved[first, 8]["id"],
    ]
    assert saved[third, 16]["parent_id"] == saved[first, 8]["id"]
    assert lineage["head_id"] == lineage["resumable_id"] == saved[third, 24]["id"]
    assert lineage["forks"] == [saved[first, 8]["id"]]
