"""A bundle is named by its training position, (step, micro step): a later micro step of a
saved step is a new bundle, and a position whose bundle a resume skipped is saved again,
replacing it. Neither kills the trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.catalog.manifests import load_manifest
from agent.demo.compare import differences
from ckpt import Layer
from ckpt.core.contract import LayerRecord, RankRecord, missing_parts
from ckpt.core.storage import DirectoryStore, keys
from tests.conftest import run_trainer
from tests.server_process import ckpt_server

pytestmark = pytest.mark.slow

STEPS = ("--steps", "24", "--total-steps", "32")
# A policy save at step 6, then the user's save at step 6, micro step 2 (an emergency save
# mid-accumulation), and the process dies.
SECOND_SAVE = ("--every", "6", "--save-at", "6.2", "--kill-after-save")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reference")
    return run_trainer(root / "store", root / "reference.pt", *STEPS)


def test_a_save_at_a_later_micro_step_of_a_saved_step_is_a_new_bundle(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    store = tmp_path / "store"
    run_trainer(store, tmp_path / "killed.pt", *STEPS, *SECOND_SAVE, expect_rc=-9)
    manifest = load_manifest(DirectoryStore(store), keys.manifest_key("demo", 6, 2))
    assert manifest.position == (6, 2)
    resumed = run_trainer(store, tmp_path / "resumed.pt", *STEPS)
    assert resumed["positions"][0] == (6, 3)
    assert differences(reference, resumed) == []


def test_through_the_control_plane_a_later_micro_step_is_a_new_bundle(
    tmp_path: Path, reference: dict[str, Any], database_url: str | None
) -> None:
    with ckpt_server(tmp_path, database_url=database_url) as server:
        env = {**server.env(), "CKPT_RUN": "micro"}
        args = (*STEPS, "--run", "micro")
        run_trainer(
            server.store, tmp_path / "killed.pt", *args, *SECOND_SAVE, expect_rc=-9, env=env
        )
        with server.client() as client:
            resumable = client.get("/v1/runs/micro/resumable").json()
        assert (resumable["step"], resumable["micro_step"]) == (6, 2)
        resumed = run_trainer(server.store, tmp_path / "resumed.pt", *args, env=env)
        with server.client() as client:
            lineage = client.get("/v1/runs/micro/lineage").json()
    assert resumed["positions"][0] == (6, 3)
    assert differences(reference, resumed) == []
    bundles = [(b["step"], b["micro_step"], b["status"]) for b in lineage["bundles"]]
    assert bundles == [(6, 0, "complete"), (6, 2, "complete")]


def test_a_skipped_incomplete_bundle_is_saved_again_and_resumed_from(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    store = tmp_path / "store"
    every = (*STEPS, "--every", "8", "--kill-at", "20")
    run_trainer(store, tmp_path / "killed.pt", *every, expect_rc=-9)
    _drop_a_layer(DirectoryStore(store), keys.manifest_key("demo", 16))
    # Resumes at 8 (16 is incomplete), reaches 16 again, saves it (replacing the incomplete
    # manifest) and is killed at 20, as before.
    again = run_trainer(store, tmp_path / "again.pt", *every, expect_rc=-9)
    assert again == {}
    saved_again = load_manifest(DirectoryStore(store), keys.manifest_key("demo", 16))
    assert missing_parts(saved_again) == []
    resumed = run_trainer(store, tmp_path / "resumed.pt", *STEPS)
    assert resumed["positions"][0] == (16, 1)
    assert differences(reference, resumed) == []


def _drop_a_layer(store: DirectoryStore, key: str) -> None:
    """Leave the manifest valid JSON that records no counters: a resume skips it."""
    manifest = load_manifest(store, key)
    layers: dict[Layer, LayerRecord] = {
        k: v for k, v in manifest.ranks[0].layers.items() if k != Layer.COUNTERS
    }
    broken = manifest.model_copy(update={"ranks": (RankRecord(rank=0, layers=layers),)})
    store.put(key, [broken.model_dump_json().encode()])
