"""What restore refuses, what it ignores, and what it never executes."""

from __future__ import annotations

import base64
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from agent.catalog.manifests import latest_manifest, write_manifest
from agent.catalog.store import store_held
from agent.format.skeleton import JSON
from agent.restore.download import read_layer
from agent.save.upload import WriteStats, upload_layers
from agent.state.capture import LayerState
from ckpt import (
    BundleExistsError,
    BundleFormatError,
    Checkpointer,
    CorruptBundleError,
    IncompatibleBundleError,
    ResumableSampler,
    StoreError,
    UnrepresentableStateError,
)
from ckpt.core.contract import Layer, Manifest
from ckpt.core.storage import DirectoryStore, keys


class Marker:
    """Pickled, it would create a file when loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


class Box:
    """A user extra whose state is whatever we put in it."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def make(
    store: DirectoryStore, *, box: Box | None = None
) -> tuple[Checkpointer, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = Checkpointer(
        run="integrity",
        store=store,
        models=model,
        optimizers=optimizer,
        data=ResumableSampler(16, seed=1),
        extras={"box": box or Box({"note": "hi"})},
    )
    return ckpt, model, optimizer


def train_step(ckpt: Checkpointer, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(3, 4)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    ckpt.counters.step += 1


def saved_store(tmp_path: Path, steps: tuple[int, ...] = (1, 2)) -> DirectoryStore:
    store = DirectoryStore(tmp_path / "store")
    ckpt, model, optimizer = make(store)
    for _ in range(max(steps)):
        train_step(ckpt, model, optimizer)
        if ckpt.counters.step in steps:
            ckpt.save().wait()
    return store


def blob_files(
    store: DirectoryStore, run: str = "integrity", step: int = 2, layer: Layer = Layer.WEIGHTS
) -> list[Path]:
    manifest = Manifest.model_validate_json(store.get(keys.manifest_key(run, step)))
    return [
        store.root / keys.blob_key(blob.sha256) for blob in manifest.ranks[0].layers[layer].blobs
    ]


def test_a_flipped_byte_is_refused_naming_the_bundle_and_blob(tmp_path: Path) -> None:
    store = saved_store(tmp_path, steps=(2,))
    victim = blob_files(store)[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(data)
    ckpt, model, _ = make(store)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(CorruptBundleError) as raised:
        ckpt.resume()
    assert raised.value.blob == victim.name
    assert "runs/integrity/bundles/000000000002" in str(raised.value)
    assert "refusing to start from scratch" in str(raised.value)
    # The weights layer failed verification before anything was loaded into the model.
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())


def test_a_damaged_blob_that_two_ranks_share_is_named_with_both(tmp_path: Path) -> None:
    # Replicated state is stored once: here every blob of the two ranks' layers is shared.
    store = saved_store(tmp_path, steps=(1,))
    layers = Manifest.model_validate_json(store.get(keys.manifest_key("integrity", 1))).ranks[0]
    shared = write_manifest(
        store,
        run="integrity",
        position=(2, 0),
        world_size=2,
        ranks={0: layers.layers, 1: layers.layers},
    )
    victim = shared.ranks[1].layers[Layer.WEIGHTS].blobs[-1].sha256  # rank 1's entry
    path = store.root / keys.blob_key(victim)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(CorruptBundleError) as raised:
        read_layer(store, shared, rank=0, layer=Layer.WEIGHTS)  # rank 0 meets it first
    assert f"blob {victim} (of rank 0 weights, rank 1 weights) does not match" in str(raised.value)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_bundle_is_set_aside_for_the_one_before_it(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = saved_store(tmp_path)
    victim = blob_files(store, layer=Layer.OPTIMIZER)[-1]
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0x01
        victim.write_bytes(data)
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-1])
    else:
        victim.unlink()
    ckpt, model, _ = make(store)
    with caplog.at_level(logging.ERROR, logger="ckpt"):
        result = ckpt.resume()
    assert result.step == 1 and ckpt.counters.step == 1
    assert "runs/integrity/bundles/000000000002" in caplog.text
    assert victim.name in caplog.text and "falling back" in caplog.text
    # It is the state of step 1, exactly: a fresh run trained one step lands there too.
    reference = DirectoryStore(tmp_path / "reference")
    fresh, fresh_model, fresh_optimizer = make(reference)
    train_step(fresh, fresh_model, fresh_optimizer)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_truncated_or_missing_blob_is_refused(tmp_path: Path, damage: str) -> None:
    store = saved_store(tmp_path, steps=(2,))
    victim = blob_files(store, layer=Layer.OPTIMIZER)[-1]
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-1])
    else:
        victim.unlink()
    ckpt, _, _ = make(store)
    with pytest.raises(CorruptBundleError, match=victim.name):
        ckpt.resume()
    # Blobs are read straight into the live weights and optimizer state (the error says to
    # rebuild them), but no layer is restored: the counters still say step 0.
    assert ckpt.counters.step == 0


def test_a_bundle_without_manifest_is_ignored(tmp_path: Path) -> None:
    store = saved_store(tmp_path)
    store.delete(keys.manifest_key("integrity", 2))
    ckpt, _, _ = make(store)
    result = ckpt.resume()
    assert (result.step, ckpt.counters.step) == (1, 1)


def test_no_bundle_means_a_fresh_start(tmp_path: Path) -> None:
    result = make(DirectoryStore(tmp_path))[0].resume()
    assert not result.resumed and result.bundle is None


def test_restore_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = saved_store(tmp_path)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle was used on the load path")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    ckpt, _, _ = make(store)
    assert ckpt.resume().step == 2


def test_pickle_bytes_in_state_come_back_as_bytes_and_run_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    smuggled = pickle.dumps(Marker(marker))
    store = DirectoryStore(tmp_path / "store")
    ckpt, _, _ = make(store, box=Box({"payload": smuggled}))
    ckpt.save().wait()
    box = Box()
    restored, _, _ = make(store, box=box)
    restored.resume()
    assert box.state == {"payload": smuggled}
    assert not marker.exists()


@pytest.mark.parametrize(
    "smuggled",
    [
        {"$pickle": "PAYLOAD"},
        {"$reduce": ["pathlib.Path.touch", ["MARKER"]]},
        {"$tensor": "weights/models/0/0.weight", "$reduce": "x"},
        {"$numpy": ["O", "PAYLOAD"]},
        {"$dtype": "load"},
    ],
)
def test_a_crafted_skeleton_executes_nothing(tmp_path: Path, smuggled: dict[str, Any]) -> None:
    marker = tmp_path / "executed"
    payload = base64.b64encode(pickle.dumps(Marker(marker))).decode()
    crafted = json.loads(
        json.dumps(smuggled).replace("PAYLOAD", payload).replace("MARKER", str(marker))
    )
    store = saved_store(tmp_path, steps=(1,))
    # Rewrite the weights layer of a committed bundle: its skeleton smuggles the value into
    # the extra's state; hashes and manifest are valid, so only the decoder stands guard.
    manifest = latest_manifest(store, "integrity")
    assert manifest is not None
    skeleton: JSON = {"models": {}, "masters": {}, "extras": {"box": crafted}, "grads": None}
    stats = WriteStats()
    record = upload_layers(
        store,
        {Layer.WEIGHTS: LayerState(skeleton, {})},
        blob_bytes=1 << 20,
        stats=stats,
        held=store_held(store, set()),
    )[Layer.WEIGHTS]
    layers = {**manifest.ranks[0].layers, Layer.WEIGHTS: record}
    write_manifest(store, run="integrity", position=(5, 0), world_size=1, ranks={0: layers})
    with pytest.raises(BundleFormatError):
        make(store)[0].resume()
    assert not marker.exists()


def test_unrepresentable_state_fails_at_save_naming_its_key_path(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    ckpt, _, _ = make(store, box=Box({"schedule": {"fn": lambda step: step}}))
    with pytest.raises(UnrepresentableStateError, match=r"weights/extras/box/schedule/fn"):
        ckpt.save().wait()
    assert latest_manifest(store, "integrity") is None


def test_other_objects_are_refused_with_what_to_pass(tmp_path: Path) -> None:
    store = saved_store(tmp_path)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ckpt = Checkpointer(
        run="integrity",
        store=store,
        models={"student": model},
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
    )
    with pytest.raises(IncompatibleBundleError, match="student"):
        ckpt.resume()


def test_master_weights_generators_extras_and_named_objects_round_trip(tmp_path: Path) -> None:
    def build() -> tuple[Checkpointer, dict[str, Any]]:
        torch.manual_seed(0)
        model = nn.Linear(4, 4).to(torch.bfloat16)
        masters = [p.detach().float().requires_grad_() for p in model.parameters()]
        head = nn.Linear(4, 1)
        objects: dict[str, Any] = {
            "model": model,
            "head": head,
            "masters": masters,
            "opt": torch.optim.Adam(masters, lr=0.1),
            "head_opt": torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9),
            "gen": torch.Generator().manual_seed(3),
            "npgen": np.random.default_rng(4),
            "box": Box({"ema": torch.zeros(2), "n": 0}),
        }
        ckpt = Checkpointer(
            run="masters",
            store=DirectoryStore(tmp_path),
            models={"model": model, "head": head},
            optimizers={"opt": objects["opt"], "head_opt": objects["head_opt"]},
            generators={"gen": objects["gen"], "npgen": objects["npgen"]},
            extras={"box": objects["box"]},
        )
        return ckpt, objects

    ckpt, saved = build()
    for _ in range(3):
        saved["masters"][0].grad = torch.randn(4, 4, generator=saved["gen"])
        saved["masters"][1].grad = torch.randn(4, generator=saved["gen"])
        saved["opt"].step()
        saved["head"](torch.randn(2, 4)).sum().backward()
        saved["head_opt"].step()
        saved["box"].state = {"ema": torch.randn(2), "n": saved["box"].state["n"] + 1}
    saved["npgen"].random(5)
    ckpt.counters.step = 3
    ckpt.save().wait()

    fresh, restored = build()
    fresh.resume()
    for a, b in zip(saved["masters"], restored["masters"], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(restored["box"].state["ema"], saved["box"].state["ema"])
    assert restored["box"].state["n"] == 3
    assert torch.equal(saved["gen"].get_state(), restored["gen"].get_state())
    assert saved["npgen"].random() == restored["npgen"].random()
    for name in ("opt", "head_opt"):
        before, after = saved[name].state_dict(), restored[name].state_dict()
        assert before["param_groups"] == after["param_groups"]
        for index, state in before["state"].items():
            assert state.keys() == after["state"][index].keys()
            assert all(
                torch.equal(value, after["state"][index][key]) for key, value in state.items()
            )


def test_a_list_of_schedulers_is_saved_as_separate_objects(tmp_path: Path) -> None:
    def build() -> tuple[Checkpointer, list[torch.optim.lr_scheduler.LRScheduler]]:
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        schedulers: list[torch.optim.lr_scheduler.LRScheduler] = [
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=2),
            torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5),
        ]
        ckpt = Checkpointer(
            run="schedulers",
            store=DirectoryStore(tmp_path),
            models=model,
            optimizers=optimizer,
            schedulers=schedulers,
        )
        return ckpt, schedulers

    ckpt, schedulers = build()
    assert set(ckpt.objects.schedulers) == {"0", "1"}
    for _ in range(3):
        ckpt.objects.optimizers["0"].step()
        for scheduler in schedulers:
            scheduler.step()
    ckpt.save().wait()
    fresh, restored = build()
    fresh.resume()
    assert [s.state_dict() for s in restored] == [s.state_dict() for s in schedulers]


def test_a_save_before_the_first_optimizer_step_resumes(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    ckpt, _, _ = make(store)
    ckpt.save().wait()
    fresh, _, optimizer = make(store)
    assert fresh.resume().step == 0
    assert optimizer.state_dict()["state"] == {}


def test_a_mismatched_optimizer_is_an_incompatible_bundle(tmp_path: Path) -> None:
    store = saved_store(tmp_path)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    ckpt = Checkpointer(
        run="integrity",
        store=store,
        models=model,
        optimizers=torch.optim.AdamW(groups),
        data=ResumableSampler(16, seed=1),
        extras={"box": Box()},
    )
    with pytest.raises(IncompatibleBundleError, match="optimizer layer does not fit"):
        ckpt.resume()


def test_a_damaged_blob_in_the_store_is_rewritten_not_referenced_again(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    ckpt, model, optimizer = make(store)
    train_step(ckpt, model, optimizer)
    ckpt.save().wait()
    victim = blob_files(store, step=1)[-1]
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size, wrong bytes
    # A new process saves the same state: it must not trust the damaged blob by its size.
    again = Checkpointer(
        run="integrity",
        store=store,
        models=model,
        optimizers=optimizer,
        data=ResumableSampler(16, seed=1),
        extras={"box": Box({"note": "hi"})},
    )
    again.counters.step = 2
    assert again.save().wait().new_bytes >= victim.stat().st_size
    assert make(store)[0].resume().step == 2


def test_store_failures_are_store_errors(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("x")
    ckpt, _, _ = make(DirectoryStore(not_a_directory))
    with pytest.raises(StoreError, match="Not a directory"):
        ckpt.save().wait()


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path: Path) -> None:
    def build() -> tuple[Checkpointer, nn.Embedding, nn.Linear]:
        torch.manual_seed(0)
        embedding, head = nn.Embedding(1000, 64), nn.Linear(64, 1000, bias=False)
        head.weight = embedding.weight
        model = nn.Sequential(embedding, head)
        return (
            Checkpointer(run="tied", store=DirectoryStore(tmp_path), models=model),
            embedding,
            head,
        )

    ckpt, embedding, _ = build()
    with torch.no_grad():
        embedding.weight.add_(1.0)
    result = ckpt.save().wait()
    assert result.payload_bytes < 1000 * 64 * 4 * 1.5
    fresh, restored_embedding, restored_head = build()
    fresh.resume()
    assert restored_head.weight is restored_embedding.weight
    assert torch.equal(restored_embedding.weight, embedding.weight)


def test_a_blob_deleted_behind_a_live_checkpointer_is_written_again(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    ckpt, _, _ = make(store)
    ckpt.save().wait()
    for path in (tmp_path / "blobs").rglob("*"):
        if path.is_file():
            path.unlink()
    ckpt.counters.step = 1  # the same state, so the same blobs, at the next step
    ckpt.save().wait()
    assert make(store)[0].resume().step == 1


def test_a_warm_start_into_the_same_run_cannot_replace_its_bundles(tmp_path: Path) -> None:
    store = saved_store(tmp_path)
    ckpt, _, _ = make(store)
    ckpt.resume(layers=["weights"])
    ckpt.counters.step = 1
    with pytest.raises(BundleExistsError, match="step 1"):
        ckpt.save().wait()
    assert latest_manifest(store, "integrity") is not None


def test_a_warm_start_from_another_run_takes_weights_but_not_stale_grads(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    base, model, _ = make(store)
    model(torch.randn(3, 4)).sum().backward()
    base.counters.micro_step = 1
    base.save().wait()
    torch.manual_seed(1)
    student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ckpt = Checkpointer(run="student", store=store, models=student, extras={"box": Box()})
    result = ckpt.resume(from_run="integrity", layers=["weights"])
    assert result.layers == (Layer.WEIGHTS,)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), student.parameters(), strict=True)
    )
    assert all(p.grad is None for p in student.parameters())
    assert ckpt.counters.step == 0
    ckpt.save().wait()  # into its own run
    assert latest_manifest(store, "student") is not None
