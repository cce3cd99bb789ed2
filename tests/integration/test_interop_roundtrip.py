"""Round trips through ckpt: a framework writes a checkpoint of a tiny model, ``ckpt import``
commits it as a bundle, ``ckpt export`` writes the bundle back out in a format that framework
reads, and the framework's own loader gets every tensor back ``torch.equal`` to what it saved.

The sources are those of docs/interop.md: a Hugging Face Trainer ``checkpoint-N/`` folder
(out as a Transformers folder for ``from_pretrained``), a Lightning ``.ckpt`` (out as a
``torch.save`` of the whole state, loaded into the LightningModule and its optimizer), a
DCP directory (out as DCP for ``dcp.load``) and a ``torch.save`` dict (out as ``torch.save``
files for ``torch.load``, through the CLI). The checkpoints are written by the helpers of
the import tests, so each round trip starts from the same files those tests import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from transformers import AutoModelForCausalLM

from agent.interop.exporting import export
from agent.interop.importing import import_checkpoint
from ckpt.cli import main as cli
from tests.integration.dcp_writer import model_and_optimizer, state
from tests.integration.hf_trainer import Tokens
from tests.integration.test_export import assert_equal, dcp_load
from tests.integration.test_import_dicts import assert_optimizer_equal, trained
from tests.integration.test_import_hf import SAVED_AT, PlainTrainer, arguments, tiny_model, train
from tests.integration.test_import_lightning import BATCHES, Tiny, fit

# The Trainer, accelerate and Lightning warn about CPU-only runs, loaders without workers
# and deprecated defaults, as in the import tests that write these checkpoints.
FRAMEWORK_WARNINGS = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

pytestmark = pytest.mark.slow  # a Trainer and a Lightning fit write the checkpoints


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoint-4/`` as the Trainer writes it (test_import_hf's run)."""
    root = tmp_path_factory.mktemp("hf")
    train(PlainTrainer(model=tiny_model(), args=arguments(root, save=True), train_dataset=Tokens()))
    return root / f"checkpoint-{SAVED_AT}"


@pytest.fixture(scope="module")
def lightning_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``.ckpt`` ModelCheckpoint writes at the end of the first epoch
    (test_import_lightning's run)."""
    root = tmp_path_factory.mktemp("lightning")
    fit(root, [ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)])
    return root / f"epoch=0-step={BATCHES}.ckpt"


@FRAMEWORK_WARNINGS
def test_a_trainer_checkpoint_loads_with_from_pretrained_after_the_round_trip(
    hf_checkpoint: Path, tmp_path: Path
) -> None:
    store = str(tmp_path / "store")
    import_checkpoint(hf_checkpoint, run="hf", store=store, accept_missing=["data"])
    out = tmp_path / "hf-model"
    config = str(hf_checkpoint / "config.json")  # the Trainer saves the model's config too
    export(store, "hf", str(out), to="transformers", config=config, quiet=True)
    # With output_loading_info, from_pretrained gives a pair, which its annotation omits.
    pair: Any = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    loaded, info = pair
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    assert_equal(loaded.state_dict(), load_file(hf_checkpoint / "model.safetensors"))


@FRAMEWORK_WARNINGS
def test_a_lightning_checkpoint_loads_into_the_module_after_the_round_trip(
    lightning_checkpoint: Path, tmp_path: Path
) -> None:
    saved = torch.load(lightning_checkpoint, weights_only=True)
    store = str(tmp_path / "store")
    import_checkpoint(lightning_checkpoint, run="pl", store=store, accept_missing=["rng", "data"])
    out = tmp_path / "state.pt"
    export(store, "pl", str(out), to="torch", whole_state=True, quiet=True)
    layers = torch.load(out, weights_only=False)["layers"]  # a file written just now
    module = Tiny()
    module.load_state_dict(layers["weights"]["models"]["model"])  # strict: every name
    assert_equal(module.state_dict(), saved["state_dict"])
    optimizer = module.configure_optimizers()["optimizer"]
    optimizer.load_state_dict(layers["optimizer"]["optimizers"]["0"])
    assert_optimizer_equal(optimizer.state_dict(), saved["optimizer_states"][0])
    assert layers["scheduler"]["0"] == saved["lr_schedulers"][0]


# DCP without a process group: "assuming the intent is to save in a single process".
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_dcp_checkpoint_loads_with_dcp_after_the_round_trip(tmp_path: Path) -> None:
    source = tmp_path / "dcp"
    dcp_save(state(None), checkpoint_id=str(source), no_dist=True)  # one process, whole tensors
    store = str(tmp_path / "store")
    missing = ["scheduler", "rng", "data"]
    import_checkpoint(source, run="dcp", store=store, accept_missing=missing, unsafe_unpickle=True)
    out = tmp_path / "out"
    export(store, "dcp", str(out), to="dcp", whole_state=True, quiet=True)
    model, optimizer = model_and_optimizer()  # the three steps state() saved, again
    want = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    zeros: dict[str, Any] = {
        "model": {key: torch.zeros_like(value) for key, value in want["model"].items()},
        "optimizer": {
            "state": {
                index: {key: torch.zeros_like(value) for key, value in values.items()}
                for index, values in want["optimizer"]["state"].items()
            },
            "param_groups": [dict(group, lr=0.0) for group in want["optimizer"]["param_groups"]],
        },
    }
    dcp_load(zeros, out)
    assert_equal(zeros["model"], want["model"])
    assert_optimizer_equal(zeros["optimizer"], want["optimizer"])


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # trained()'s scheduler
def test_a_torch_save_dict_loads_with_torch_load_after_the_round_trip(tmp_path: Path) -> None:
    saved = trained()
    torch.save(saved, tmp_path / "state.pt")
    store = ["--store", str(tmp_path / "store")]
    assert cli(["import", str(tmp_path / "state.pt"), "--run", "pt", *store]) == 0
    weights, whole = tmp_path / "weights.pt", tmp_path / "whole.pt"
    assert cli(["export", "pt", str(weights), "--to", "torch", *store]) == 0
    assert cli(["export", "pt", str(whole), "--to", "torch", "--whole-state", *store]) == 0
    assert_equal(torch.load(weights, weights_only=True), saved["model"])
    layers = torch.load(whole, weights_only=False)["layers"]  # a file written just now
    assert_equal(dict(layers["weights"]["models"]["0"]), saved["model"])
    assert_optimizer_equal(layers["optimizer"]["optimizers"]["0"], saved["optimizer"])
    assert layers["scheduler"]["0"] == saved["scheduler"]
    assert torch.equal(layers["rng"]["torch"], saved["rng"]["cpu"])
    assert layers["rng"]["python"] == saved["rng"]["python"]
    assert np.array_equal(layers["rng"]["numpy"]["state"]["key"], saved["rng"]["numpy"][1])
    assert layers["data"]["source"] == saved["data"]
    counters = layers["counters"]
    assert (counters["step"], counters["epoch"], counters["batch"]) == (3, 1, 2)
