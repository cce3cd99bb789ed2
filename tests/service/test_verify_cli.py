"""``ckpt verify``: every blob of a bundle read back and checked, from the store alone."""

from __future__ import annotations

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
