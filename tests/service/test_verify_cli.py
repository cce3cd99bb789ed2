"""``ckpt verify``: every blob of a bundle read back and checked, from the store alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt import Checkpointer
from ckpt.cli import main
from ckpt.core.contract import Layer
from ckpt.core.storage import DirectoryStore, keys
from ckpt.core.verify import find_manifest


def saved(root: Path, *, steps: tuple[int, ...]) -> DirectoryStore:
    store = DirectoryStore(root)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    with Checkpointer(run="verified", store=store, models=model, blob_bytes=1 << 20) as ckpt:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            ckpt.counters.step = step
            ckpt.save()
    return store


def test_an_intact_bundle_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved(tmp_path / "store", steps=(1, 2))
    assert main(["verify", "verified", "--store", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert "runs/verified/bundles/000000000002/manifest.json" in out
    assert out.rstrip().endswith("intact")


def test_a_flipped_byte_is_named_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = saved(tmp_path / "store", steps=(1, 2))
    manifest_path = tmp_path / "store" / keys.manifest_key("verified", 1)
    assert manifest_path.exists()

    manifest = find_manifest(store, "verified", step=1)
    victim = manifest.ranks[0].layers[Layer.WEIGHTS].blobs[-1].sha256
    path = tmp_path / "store" / keys.blob_key(victim)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    assert main(["verify", "verified", "--step", "1", "--store", str(tmp_path / "store")]) == 1
    out = capsys.readouterr().out
    assert f"BAD  {keys.blob_key(victim)}: its SHA-256 does not match its name" in out
    assert "1 bad blob(s)" in out


def test_a_missing_blob_is_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = saved(tmp_path / "store", steps=(1,))

    victim = find_manifest(store, "verified", step=None).ranks[0].layers[Layer.WEIGHTS].blobs[-1]
    (tmp_path / "store" / keys.blob_key(victim.sha256)).unlink()
    assert main(["verify", "verified", "--store", str(tmp_path / "store")]) == 1
    assert "unreadable" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "nobody"], "run nobody has no bundle"),
        (["verify", "verified", "--step", "7"], "no bundle at step 7"),
    ],
)
def test_no_such_bundle_exits_2_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    saved(tmp_path / "store", steps=(1,))
    assert main([*argv, "--store", str(tmp_path / "store")]) == 2
    assert message in capsys.readouterr().err


def manifest_totals(store: DirectoryStore, step: int) -> tuple[int, int]:
    """(distinct blobs, their bytes) of the bundle at ``step``."""
    manifest = find_manifest(store, "verified", step=step)
    blobs = {b.sha256: b.size for r in manifest.ranks for x in r.layers.values() for b in x.blobs}
    return len(blobs), sum(blobs.values())


def test_json_report_of_an_intact_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = saved(tmp_path / "store", steps=(1, 2))
    assert main(["verify", "verified", "--store", str(tmp_path / "store"), "--json"]) == 0
    blobs, size = manifest_totals(store, 2)
    assert json.loads(capsys.readouterr().out) == {
        "bundle": "runs/verified/bundles/000000000002/manifest.json",
        "run": "verified",
        "step": 2,
        "blobs": blobs,
        "bytes": size,
        "bad": {},
        "missing": [],
        "intact": True,
    }


def test_json_report_names_each_bad_blob_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = saved(tmp_path / "store", steps=(1,))
    layers = find_manifest(store, "verified", step=1).ranks[0].layers
    flipped, missing = layers[Layer.WEIGHTS].blobs[-1].sha256, layers[Layer.RNG].blobs[-1].sha256
    path = tmp_path / "store" / keys.blob_key(flipped)
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))
    (tmp_path / "store" / keys.blob_key(missing)).unlink()

    argv = ["verify", "verified", "--step", "1", "--store", str(tmp_path / "store"), "--json"]
    assert main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["intact"] is False
    assert report["bad"].keys() == {flipped, missing}
    assert report["bad"][flipped] == "its SHA-256 does not match its name"
    assert report["bad"][missing].startswith("unreadable: ")
    assert (report["blobs"], report["bytes"]) == manifest_totals(store, 1)


@pytest.mark.parametrize(
    ("argv", "step", "message"),
    [
        (["verify", "nobody"], None, "run nobody has no bundle"),
        (["verify", "verified", "--step", "7"], 7, "run verified has no bundle at step 7"),
    ],
)
def test_json_asked_for_a_missing_bundle_exits_2_with_a_json_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    step: int | None,
    message: str,
) -> None:
    saved(tmp_path / "store", steps=(1,))
    assert main([*argv, "--store", str(tmp_path / "store"), "--json"]) == 2
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report.keys() == {"run", "step", "error", "intact"}
    assert (report["run"], report["step"], report["intact"]) == (argv[1], step, False)
    assert report["error"].startswith(message)
    assert message in err


def drop_layer(store: DirectoryStore, *, step: int, layer: Layer) -> None:
    """Rewrite the manifest at ``step`` without one of its layers (five of six)."""
    manifest = find_manifest(store, "verified", step=step)
    rank = manifest.ranks[0]
    layers = {name: record for name, record in rank.layers.items() if name != layer}
    partial = manifest.model_copy(update={"ranks": (rank.model_copy(update={"layers": layers}),)})
    store.put(keys.manifest_key("verified", step), [partial.model_dump_json().encode()])


def test_the_newest_bundle_is_the_one_a_resume_would_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = saved(tmp_path / "store", steps=(1, 2))
    drop_layer(store, step=2, layer=Layer.COUNTERS)
    assert main(["verify", "verified", "--store", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert "bundles/000000000001/manifest.json" in out and out.rstrip().endswith("intact")


def test_a_bundle_without_every_layer_is_not_intact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = saved(tmp_path / "store", steps=(1, 2))
    drop_layer(store, step=2, layer=Layer.COUNTERS)
    assert main(["verify", "verified", "--step", "2", "--store", str(store.root), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["missing"] == ["rank 0 counters"] and report["intact"] is False
    assert main(["verify", "verified", "--step", "2", "--store", str(store.root)]) == 1
    assert "MISSING  rank 0 counters" in capsys.readouterr().out


def test_a_run_with_no_complete_bundle_is_not_verified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = saved(tmp_path / "store", steps=(1,))
    drop_layer(store, step=1, layer=Layer.RNG)
    assert main(["verify", "verified", "--store", str(store.root)]) == 2
    assert "has no complete bundle" in capsys.readouterr().err
