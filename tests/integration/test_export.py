"""``ckpt export``: bundles out as safetensors, Transformers folders, DCP and torch.save
files, read back by those libraries themselves; from a directory store and from S3 (moto);
a sharded FSDP2 bundle of 2 ranks loaded by DCP in 1 and in 2 processes; a damaged blob
and an incomplete bundle refused."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from agent.checkpointer import Checkpointer
from agent.interop.exporting import export
from ckpt.cli import main as ckpt
from ckpt.core.contract import Layer, Manifest
from ckpt.core.errors import CorruptBundleError
from ckpt.core.storage import DirectoryStore, keys
from tests.dcp_ranks import load_in_ranks
from tests.ranks_job import run_ranks
from tests.s3_server import S3Server, aws_environment, moto_server
from tests.server_process import ckpt_server

RUN = "export"


def train(
    store: str | Path, *, run: str = RUN, width: int = 512, **config: Any
) -> tuple[nn.Module, Any]:
    """Two AdamW steps of a small model, saved at step 2 in small blobs (so that tensors
    span several); the model and the optimizer's state dict at the save."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4 * width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    ckpt = Checkpointer(
        run=run,
        store=str(store),
        models=model,
        optimizers=optimizer,
        schedulers=scheduler,
        blob_bytes=1 << 20,
        quiet=True,
        **config,
    )
    for _ in range(2):
        model(torch.randn(3, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        ckpt.counters.step += 1
    ckpt.save().wait()
    ckpt.close()
    return model, optimizer.state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, Any]:
    store = tmp_path_factory.mktemp("saved") / "store"
    model, optimizer_state = train(store)
    return store, model, optimizer_state


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def dcp_load(state: dict[str, Any], folder: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        load(state, checkpoint_id=str(folder), no_dist=True)


def test_weights_export_as_safetensors_torch_and_dcp(saved: Any, tmp_path: Path) -> None:
    store, model, _ = saved
    want = model.state_dict()
    one = export(str(store), RUN, str(tmp_path / "w.safetensors"), to="safetensors", quiet=True)
    assert one.step == 2 and one.tensors == len(want)
    assert_equal(load_file(tmp_path / "w.safetensors"), want)

    export(str(store), f"{RUN}@2", str(tmp_path / "w.pt"), to="torch", quiet=True)
    assert_equal(torch.load(tmp_path / "w.pt", weights_only=True), want)

    export(
        str(store), f"runs/{RUN}/bundles/000000000002", str(tmp_path / "d"), to="dcp", quiet=True
    )
    loaded = {key: torch.zeros_like(value) for key, value in want.items()}
    dcp_load(loaded, tmp_path / "d")
    assert_equal(loaded, want)


def test_a_large_model_is_cut_into_shards_with_an_index(saved: Any, tmp_path: Path) -> None:
    store, model, _ = saved
    want = model.state_dict()
    export(
        str(store),
        RUN,
        str(tmp_path / "s"),
        to="safetensors",
        max_shard_bytes=1_000_000,
        quiet=True,
    )
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    got: dict[str, torch.Tensor] = {}
    for name in files:
        got |= load_file(tmp_path / "s" / name)
    assert_equal(got, want)


def test_the_whole_state_exports_with_the_optimizer(saved: Any, tmp_path: Path) -> None:
    store, model, optimizer_state = saved
    export(str(store), RUN, str(tmp_path / "all.pt"), to="torch", whole_state=True, quiet=True)
    everything = torch.load(tmp_path / "all.pt", weights_only=False)
    layers = everything["layers"]
    assert sorted(layers) == sorted(str(layer) for layer in Layer)
    assert_equal(dict(layers["weights"]["models"]["0"]), model.state_dict())
    got = layers["optimizer"]["optimizers"]["0"]
    for index, state in optimizer_state["state"].items():
        assert_equal(got["state"][index], state)
    assert got["param_groups"] == optimizer_state["param_groups"]
    assert layers["scheduler"]["0"]["last_epoch"] == 2

    export(str(store), RUN, str(tmp_path / "dcp"), to="dcp", whole_state=True, quiet=True)
    zeros: dict[str, Any] = {
        "model": {key: torch.zeros_like(value) for key, value in model.state_dict().items()},
        "optimizer": {
            "state": {
                index: {key: torch.zeros_like(value) for key, value in state.items()}
                for index, state in optimizer_state["state"].items()
            },
            "param_groups": [dict(group, lr=0.0) for group in optimizer_state["param_groups"]],
        },
    }
    dcp_load(zeros, tmp_path / "dcp")
    assert_equal(zeros["model"], model.state_dict())
    for index, state in optimizer_state["state"].items():
        assert_equal(zeros["optimizer"]["state"][index], state)
    assert zeros["optimizer"]["param_groups"] == optimizer_state["param_groups"]


def test_a_transformers_folder_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = Checkpointer(
        run="gpt", store=str(tmp_path / "store"), models=model, optimizers=optimizer, quiet=True
    )
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    ckpt.counters.step += 1
    ckpt.save().wait()
    ckpt.close()
    model.config.save_pretrained(tmp_path / "config")

    export(
        str(tmp_path / "store"),
        "gpt",
        str(tmp_path / "hf"),
        to="transformers",
        config=str(tmp_path / "config"),
        quiet=True,
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert_equal(loaded.state_dict(), model.state_dict())
    model.train(False)  # from_pretrained gives a model in eval mode: no dropout
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_damaged_blob_is_refused_naming_it_and_its_tensor(tmp_path: Path) -> None:
    store = tmp_path / "store"
    train(store)
    manifest = Manifest.model_validate_json(DirectoryStore(store).get(keys.manifest_key(RUN, 2)))
    record = manifest.ranks[0].layers[Layer.WEIGHTS]
    blob = record.blobs[-1]
    path = store / keys.blob_key(blob.sha256)
    path.write_bytes(b"\0" * blob.size)
    with pytest.raises(
        CorruptBundleError, match=rf"{blob.sha256}.*tensor\(s\) weights/models/0/2.bias"
    ):
        export(str(store), RUN, str(tmp_path / "out"), to="safetensors", quiet=True)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["store"]  # no partial folder left either


def test_an_incomplete_bundle_exports_only_with_the_flag_and_names_what_it_lacks(
    saved: Any, tmp_path: Path
) -> None:
    source, model, _ = saved
    store = DirectoryStore(tmp_path / "store")
    for key in DirectoryStore(source).list_keys("blobs/"):
        store.put(key, [DirectoryStore(source).get(key)])
    manifest = json.loads(DirectoryStore(source).get(keys.manifest_key(RUN, 2)))
    del manifest["ranks"][0]["layers"]["rng"]
    manifest["step"] = 3
    store.put(keys.manifest_key(RUN, 3), [json.dumps(manifest).encode()])

    with pytest.raises(ValueError, match=r"not resumable: it lacks rank 0 rng.*--allow-incomplete"):
        export(store, f"{RUN}@3", str(tmp_path / "out"), to="safetensors", quiet=True)
    with pytest.raises(SystemExit) as refused:
        ckpt(["export", f"{RUN}@3", str(tmp_path / "out"), "--to", "torch", "--store", str(store.root)])  # fmt: skip
    assert refused.value.code == 2
    assert not (tmp_path / "out").exists()
    flags = ["--to", "torch", "--allow-incomplete", "--store", str(store.root)]
    code = ckpt(["export", f"{RUN}@3", str(tmp_path / "out.pt"), *flags])
    assert code == 0
    assert_equal(torch.load(tmp_path / "out.pt", weights_only=True), model.state_dict())


def test_through_the_control_plane_the_resumable_bundle_is_exported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ckpt_server(tmp_path) as server:
        model, _ = train(server.store, server=server.url, token=server.token)
        flags = ["--server", server.url, "--token", server.token, "--store", server.store]
        out = str(tmp_path / "w.pt")
        assert ckpt(["export", RUN, out, "--to", "torch", *flags]) == 0
        assert f"runs/{RUN}/bundles/000000000002 (step 2)" in capsys.readouterr().out
        assert_equal(torch.load(out, weights_only=True), model.state_dict())
        with pytest.raises(SystemExit) as refused:
            ckpt(["export", f"{RUN}@5", str(tmp_path / "x.pt"), "--to", "torch", *flags])
        assert refused.value.code == 2
        assert "no resumable bundle at step 5 in the control plane" in capsys.readouterr().err


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with aws_environment(), moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


def test_export_streams_from_s3(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPT_S3_ENDPOINT", s3.endpoint)
    url = f"s3://{s3.bucket()}/ckpt"
    model, _ = train(url)
    export(url, RUN, str(tmp_path / "w.safetensors"), to="safetensors", quiet=True)
    assert_equal(load_file(tmp_path / "w.safetensors"), model.state_dict())


@pytest.mark.slow
def test_an_fsdp_bundle_of_2_ranks_loads_with_dcp_in_1_and_in_2_processes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    job = ("--parallel", "fsdp", "--steps", "4", "--every", "4")
    done = run_ranks(2, store, tmp_path / "job", *job, "--dump-final", str(tmp_path / "whole.pt"))
    assert done.codes == [0, 0], done.text()
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)  # model/NAME, optimizer/I/KEY
    want = {
        ("model." if key.startswith("model/") else "optimizer.state.")
        + key.split("/", 1)[1].replace("/", "."): value
        for key, value in whole.items()
    }
    manifest = Manifest.model_validate_json(
        DirectoryStore(store).get(keys.manifest_key("ranks", 4))
    )
    assert manifest.world_size == 2

    export(str(store), "ranks", str(tmp_path / "w.safetensors"), to="safetensors", quiet=True)
    weights = {
        key.removeprefix("model."): value for key, value in want.items() if key.startswith("model.")
    }
    assert_equal(load_file(tmp_path / "w.safetensors"), weights)

    export(str(store), "ranks", str(tmp_path / "dcp"), to="dcp", whole_state=True, quiet=True)
    one = {key: torch.zeros_like(value) for key, value in want.items()}
    nested: dict[str, Any] = {"model": {}, "optimizer": {"state": {}}}
    for key, value in one.items():
        if key.startswith("model."):
            nested["model"][key.removeprefix("model.")] = value
        else:
            index, name = key.removeprefix("optimizer.state.").split(".")
            nested["optimizer"]["state"].setdefault(int(index), {})[name] = value
    dcp_load(nested, tmp_path / "dcp")
    assert_equal(one, want)

    torch.save(
        {key: torch.zeros_like(value) for key, value in want.items()}, tmp_path / "template.pt"
    )
    load_in_ranks(2, tmp_path / "dcp", tmp_path / "template.pt", tmp_path / "two.pt")
    assert_equal(torch.load(tmp_path / "two.pt", weights_only=True), want)
