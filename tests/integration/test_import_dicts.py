"""``ckpt import`` of ``torch.save`` dicts and DCP directories: every layer found comes
back ``torch.equal`` in a ``Checkpointer`` resume; unsafe pickles, damaged files and
missing layers are refused by name, and nothing is committed then."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from agent.catalog.manifests import latest_manifest
from agent.checkpointer import Checkpointer
from agent.interop.importing import import_checkpoint
from ckpt import ResumableSampler
from ckpt.cli import main as cli
from ckpt.core.errors import ImportSourceError
from ckpt.core.storage import open_store
from tests.integration.dcp_writer import model_and_optimizer

pytestmark = [
    pytest.mark.slow,  # the DCP checkpoint is written by two spawned ranks
    # The scheduler is stepped after the optimizer's steps, without steps of its own.
    pytest.mark.filterwarnings("ignore:Detected call of:UserWarning"),
]


def trained() -> dict[str, Any]:
    """A model, optimizer, scheduler and sampler three steps in, and the global RNGs."""
    model, optimizer = model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    for _ in range(3):
        scheduler.step()
    sampler = ResumableSampler(20, seed=5)
    sampler.set_epoch(1)
    sampler.advance(8)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cpu": torch.get_rng_state(),
        },
        "data": sampler.state_dict(),
        "step": 3,
        "epoch": 1,
        "batch": 2,
    }


def resumed(store: str, run: str) -> dict[str, Any]:
    """A fresh model, optimizer, scheduler and sampler resumed from the run's bundle."""
    torch.manual_seed(11)  # other weights and streams than the saved ones
    random.seed(11)
    np.random.seed(11)
    model = nn.Linear(4, 6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    sampler = ResumableSampler(20, seed=0)
    with Checkpointer(
        run=run,
        models=model,
        optimizers=optimizer,
        schedulers=scheduler,
        data=sampler,
        store=store,
        quiet=True,
    ) as checkpointer:
        result = checkpointer.resume()
        counters = checkpointer.counters
        return {
            "layers": result.layers,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "cpu": torch.get_rng_state(),
            },
            "data": sampler.state_dict(),
            "position": (counters.step, counters.epoch, counters.batch),
        }


def assert_tensors_equal(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def assert_optimizer_equal(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["param_groups"] == theirs["param_groups"]
    for index, values in theirs["state"].items():
        assert_tensors_equal(ours["state"][index], values)


def test_a_torch_save_dict_with_every_layer_resumes_every_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = trained()
    torch.save(saved, tmp_path / "state.pt")
    store = str(tmp_path / "store")
    assert cli(["import", str(tmp_path / "state.pt"), "--run", "pt", "--store", store]) == 0
    printed = capsys.readouterr().out
    assert "step 3, imported from torch" in printed and "MISSING" not in printed
    manifest = latest_manifest(open_store(store), "pt")
    assert manifest is not None and manifest.imported is not None
    assert (manifest.imported.format, manifest.imported.missing) == ("torch", ())
    ours = resumed(store, "pt")
    assert len(ours["layers"]) == 6 and ours["position"] == (3, 1, 2)
    assert_tensors_equal(ours["model"], saved["model"])
    assert_optimizer_equal(ours["optimizer"], saved["optimizer"])
    assert ours["scheduler"] == saved["scheduler"] and ours["data"] == saved["data"]
    assert ours["rng"]["python"] == saved["rng"]["python"]
    assert torch.equal(ours["rng"]["cpu"], saved["rng"]["cpu"])
    assert all(
        np.array_equal(a, b)
        for a, b in zip(ours["rng"]["numpy"], saved["rng"]["numpy"], strict=True)
    )


def test_a_missing_layer_is_refused_until_accepted_then_recorded_partial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = trained()
    del saved["rng"], saved["data"]
    torch.save(saved, tmp_path / "state.pt")
    store = str(tmp_path / "store")
    args = ["import", str(tmp_path / "state.pt"), "--run", "pt", "--store", store]
    assert cli(args) == 1
    assert "--accept-missing rng,data" in capsys.readouterr().err
    assert latest_manifest(open_store(store), "pt") is None
    assert cli([*args, "--accept-missing", "rng,dta"]) == 1
    assert "names no layer dta: the layers are weights, optimizer" in capsys.readouterr().err
    assert cli([*args, "--accept-missing", "rng,data"]) == 0
    assert "imported, partial" in capsys.readouterr().out
    manifest = latest_manifest(open_store(store), "pt")
    assert manifest is not None and manifest.imported is not None
    assert manifest.imported.partial and [str(x) for x in manifest.imported.missing] == [
        "rng",
        "data",
    ]


def test_an_unsafe_pickle_needs_the_opt_in(tmp_path: Path) -> None:
    saved = trained()
    saved["data"] = {"temperature": np.float64(0.5)}  # a NumPy scalar: not weights_only
    path = tmp_path / "state.pt"
    torch.save(saved, path)
    store = str(tmp_path / "store")
    with pytest.raises(
        ImportSourceError, match=r"state\.pt: holds Python objects .*--unsafe-unpickle"
    ):
        import_checkpoint(path, run="pt", store=store)
    assert latest_manifest(open_store(store), "pt") is None
    result = import_checkpoint(path, run="pt", store=store, unsafe_unpickle=True)
    assert not result.partial


def test_a_damaged_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    torch.save(trained(), path)
    path.write_bytes(path.read_bytes()[:-200])
    store = str(tmp_path / "store")
    with pytest.raises(ImportSourceError, match=r"state\.pt: cannot be read"):
        import_checkpoint(path, run="pt", store=store)
    assert latest_manifest(open_store(store), "pt") is None


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint written by two ranks, each holding half of every tensor's rows."""
    folder = tmp_path_factory.mktemp("dcp") / "checkpoint"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "DCP_PORT": str(port)}
    command = [sys.executable, "-m", "tests.integration.dcp_writer", str(folder)]
    subprocess.run(command, check=True, env=env)
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    return folder


def test_a_dcp_checkpoint_of_two_ranks_imports_whole(dcp_folder: Path, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    missing = ["scheduler", "rng", "data"]
    with pytest.raises(ImportSourceError, match=r"\.metadata is a pickle"):
        import_checkpoint(dcp_folder, run="dcp", store=store, accept_missing=missing)
    result = import_checkpoint(
        dcp_folder, run="dcp", store=store, accept_missing=missing, unsafe_unpickle=True
    )
    assert (result.format, result.step, result.partial) == ("dcp", 3, True)
    model, optimizer = model_and_optimizer()
    torch.manual_seed(11)
    fresh = nn.Linear(4, 6)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with Checkpointer(
        run="dcp", models=fresh, optimizers=fresh_optimizer, store=store, quiet=True
    ) as checkpointer:
        assert [str(x) for x in checkpointer.resume().layers] == [
            "weights",
            "optimizer",
            "counters",
        ]
    assert_tensors_equal(fresh.state_dict(), model.state_dict())
    assert_optimizer_equal(fresh_optimizer.state_dict(), optimizer.state_dict())


def test_a_damaged_dcp_checkpoint_is_refused(dcp_folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / "checkpoint"
    copy.mkdir()
    for part in dcp_folder.iterdir():
        data = part.read_bytes()
        (copy / part.name).write_bytes(data[:40] if part.name == "__1_0.distcp" else data)
    store = str(tmp_path / "store")
    with pytest.raises(ImportSourceError, match="checkpoint: cannot be read"):
        import_checkpoint(
            copy,
            run="dcp",
            store=store,
            accept_missing=["scheduler", "rng", "data"],
            unsafe_unpickle=True,
        )
    assert latest_manifest(open_store(store), "dcp") is None
