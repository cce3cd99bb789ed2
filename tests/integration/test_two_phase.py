"""Two-phase saves: save() stages a snapshot and returns; one background persist at a time.

Covers what the snapshot holds (the state at save(), not later), at most one save in flight
(wait or skip), failures surfaced from every way of waiting, the frozen-weight skip (and
what must never be skipped), staging-buffer reuse, the in_flight setting and the context
manager. Slow or failing stores are real ``DirectoryStore``s with a delay or a failure
injected into ``put``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.config import InFlight
from ckpt import Checkpointer, PendingSave, StoreError
from ckpt.core.contract import Layer, LayerRecord, Manifest
from ckpt.core.storage import DirectoryStore, keys

RUN = "two-phase"
TIMEOUT = 10.0  # bounds every wait on the background thread; never reached when all is well
MIB = 1 << 20


class GatedStore(DirectoryStore):
    """A directory store whose puts wait until ``gate`` opens: a persist held mid-upload."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.entered = threading.Event()  # a put reached the gate

    def put(self, key: str, pieces: Iterable[memoryview | bytes]) -> None:
        self.entered.set()
        if not self.gate.wait(TIMEOUT):
            raise StoreError(f"{self.url}: the test never opened the gate for {key!r}")
        super().put(key, pieces)


class BrokenStore(DirectoryStore):
    """A directory store whose blob puts fail while ``broken`` is true."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.broken = True
        self.refused = threading.Event()  # a put failed: the persist holding it will fail

    def put(self, key: str, pieces: Iterable[memoryview | bytes]) -> None:
        if self.broken and keys.manifest_position(key) is None:
            self.refused.set()
            raise StoreError(f"{self.url}: cannot write {key!r}: injected failure")
        super().put(key, pieces)


class LoRA(nn.Module):
    """A large frozen base plus a small trainable low-rank adapter."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width, bias=False)
        self.base.requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + self.up(self.down(x))
        return out


@dataclass
class Rig:
    """A model, its optimizer and the width of its input: one training setup."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    width: int

    def checkpointer(
        self, store: DirectoryStore, **options: int | str | InFlight | None
    ) -> Checkpointer:
        return Checkpointer(
            run=RUN,
            store=store,
            models=self.model,
            optimizers=self.optimizer,
            **options,  # type: ignore[arg-type]
        )

    def train(self, ckpt: Checkpointer, steps: int = 1) -> None:
        for _ in range(steps):
            self.model(torch.randn(4, self.width)).square().mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            ckpt.counters.step += 1

    def state(self) -> dict[str, torch.Tensor]:
        """Clones of every tensor of the model and of the optimizer's state."""
        tensors = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for index, entry in self.optimizer.state_dict()["state"].items():
            for name, value in entry.items():
                tensors[f"optimizer/{index}/{name}"] = torch.as_tensor(value).clone()
        return tensors


def mlp() -> Rig:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return Rig(model, torch.optim.Adam(model.parameters(), lr=0.01), width=4)


def lora(width: int = 1024, rank: int = 4) -> Rig:
    torch.manual_seed(0)
    model = LoRA(width, rank)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return Rig(model, torch.optim.Adam(trainable, lr=0.01), width=width)


def fused_with_batch_norm() -> Rig:
    """Fused Adam and batch norm write their tensors without bumping the version counter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))
    model[0].requires_grad_(False)  # a frozen layer, so that the skip is in play
    trainable = [p for p in model.parameters() if p.requires_grad]
    return Rig(model, torch.optim.Adam(trainable, lr=0.01, fused=True), width=8)


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    differing = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differing, f"differ from what was saved: {differing}"


def resumed_state(root: Path, build: Callable[[], Rig], *, step: int) -> dict[str, torch.Tensor]:
    """Resume the run into freshly built objects and return their state."""
    rig = build()
    with rig.checkpointer(DirectoryStore(root)) as ckpt:
        assert ckpt.resume().step == step
    return rig.state()


def manifest_at(store: DirectoryStore, step: int) -> Manifest:
    return Manifest.model_validate_json(store.get(keys.manifest_key(RUN, step)))


def record_of(manifest: Manifest, layer: Layer) -> LayerRecord:
    return manifest.ranks[0].layers[layer]


# -- snapshot semantics -------------------------------------------------------------------


def test_the_bundle_holds_the_state_at_save_not_what_training_did_after(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "store")
    rig = mlp()
    with rig.checkpointer(store) as ckpt:
        rig.train(ckpt)
        at_save = rig.state()
        pending = ckpt.save()
        assert store.entered.wait(TIMEOUT)  # the persist is uploading, held at the gate
        assert not pending.done() and not pending.durable
        rig.train(ckpt, steps=3)
        later = rig.state()
        unchanged = [name for name in at_save if torch.equal(at_save[name], later[name])]
        assert not unchanged, f"training should have changed every tensor: {unchanged}"
        store.gate.set()
        result = pending.wait(TIMEOUT)
        assert pending.durable
        assert (result.step, result.bundle) == (1, pending.bundle)
        assert result.payload_bytes == result.new_bytes > 0  # an empty store: all of it new

    restored = resumed_state(tmp_path / "store", mlp, step=1)
    assert_same(restored, at_save)
    assert not any(torch.equal(restored[name], later[name]) for name in later)


# -- at most one save in flight -----------------------------------------------------------


def test_a_second_save_waits_until_the_first_is_durable(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "store")
    rig = mlp()
    with rig.checkpointer(store) as ckpt:
        rig.train(ckpt)
        first = ckpt.save()
        rig.train(ckpt)
        at_second = rig.state()
        second: list[PendingSave] = []
        returned = threading.Event()

        def save_again() -> None:
            second.append(ckpt.save())
            returned.set()

        thread = threading.Thread(target=save_again)
        thread.start()
        assert not returned.wait(0.3), "the second save returned while the first was in flight"
        assert not first.done()
        store.gate.set()
        assert returned.wait(TIMEOUT)
        thread.join(TIMEOUT)
        assert first.durable  # the second staged only once the first was committed
        assert second[0].step == 2
        assert second[0].stall_seconds >= 0.1  # its wait for the first counts as stall
        assert second[0].wait(TIMEOUT).step == 2

    assert_same(resumed_state(tmp_path / "store", mlp, step=2), at_second)


def test_skip_returns_none_while_a_save_is_in_flight_then_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = GatedStore(tmp_path / "store")
    rig = mlp()
    with rig.checkpointer(store, every_steps=1, in_flight="skip") as ckpt:
        rig.train(ckpt)
        first = ckpt.maybe_save()
        assert first is not None and first.step == 1
        rig.train(ckpt)
        with caplog.at_level(logging.INFO, logger="ckpt"):
            assert ckpt.maybe_save() is None
        assert "still in flight; skipping" in caplog.text
        assert not first.done()
        store.gate.set()
        first.wait(TIMEOUT)
        second = ckpt.maybe_save()  # step 2 is still due: the skipped save is taken now
        assert second is not None and second.step == 2
        second.wait(TIMEOUT)
        assert ckpt.maybe_save() is None  # nothing due at the step just saved

    found = [keys.manifest_position(key) for key in store.list_keys(keys.bundles_prefix(RUN))]
    assert found == [(1, 0), (2, 0)]


# -- failures -----------------------------------------------------------------------------


def _leave_with_block(ckpt: Checkpointer) -> None:
    with ckpt:
        pass


SURFACES: dict[str, Callable[[Checkpointer, PendingSave], object]] = {
    "PendingSave.wait": lambda ckpt, pending: pending.wait(TIMEOUT),
    "Checkpointer.wait": lambda ckpt, pending: ckpt.wait(),
    "Checkpointer.end": lambda ckpt, pending: ckpt.end(),
    "Checkpointer.close": lambda ckpt, pending: ckpt.close(),
    "leaving a with block": lambda ckpt, pending: _leave_with_block(ckpt),
    "the next save": lambda ckpt, pending: ckpt.save(),
}


@pytest.mark.parametrize("surface", list(SURFACES))
def test_a_failed_persist_is_raised(
    tmp_path: Path, surface: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = BrokenStore(tmp_path / "store")
    rig = mlp()
    ckpt = rig.checkpointer(store)
    rig.train(ckpt)
    with caplog.at_level(logging.ERROR, logger="ckpt"):
        pending = ckpt.save()
        with pytest.raises(StoreError, match="injected failure"):
            SURFACES[surface](ckpt, pending)
    assert pending.done() and not pending.durable
    assert f"saving {pending.bundle} failed" in caplog.text  # logged even if nobody waits
    assert store.size(keys.manifest_key(RUN, 1)) is None
    ckpt.close()  # raised once: not again


def test_the_next_save_raises_a_failure_once_and_the_one_after_saves(tmp_path: Path) -> None:
    store = BrokenStore(tmp_path / "store")
    rig = mlp()
    with rig.checkpointer(store) as ckpt:
        rig.train(ckpt)
        failed = ckpt.save()
        assert store.refused.wait(TIMEOUT)
        store.broken = False  # too late for the persist in flight: it fails all the same
        rig.train(ckpt)
        at_step_2 = rig.state()
        with pytest.raises(StoreError, match="injected failure"):
            ckpt.save()
        result = ckpt.save().wait(TIMEOUT)
        assert result.step == 2
        assert failed.done() and not failed.durable

    assert store.size(keys.manifest_key(RUN, 1)) is None
    found = [keys.manifest_position(key) for key in store.list_keys(keys.bundles_prefix(RUN))]
    assert found == [(2, 0)]
    assert_same(resumed_state(tmp_path / "store", mlp, step=2), at_step_2)


def test_a_failure_raised_by_the_pending_save_is_not_raised_again(tmp_path: Path) -> None:
    store = BrokenStore(tmp_path / "store")
    rig = mlp()
    with rig.checkpointer(store) as ckpt:
        rig.train(ckpt)
        failed = ckpt.save()
        with pytest.raises(StoreError, match="injected failure"):
            failed.wait(TIMEOUT)
        assert ckpt.wait() is None
        store.broken = False
        rig.train(ckpt)
        assert ckpt.save().wait(TIMEOUT).step == 2


# -- the frozen-weight skip ---------------------------------------------------------------


@pytest.mark.parametrize("blob_bytes", [None, MIB], ids=["default blobs", "1 MiB blobs"])
def test_a_frozen_base_is_neither_copied_nor_hashed_nor_uploaded_again(
    tmp_path: Path, blob_bytes: int | None
) -> None:
    store = DirectoryStore(tmp_path / "store")
    rig = lora()
    model = rig.model
    assert isinstance(model, LoRA)
    frozen = model.base.weight.nbytes
    with rig.checkpointer(store, blob_bytes=blob_bytes) as ckpt:
        rig.train(ckpt)
        first = ckpt.save().wait(TIMEOUT)
        buffers = ckpt._staging._buffers
        base_buffer = next(name for name in buffers if name.endswith("/base.weight"))
        base_address = buffers[base_buffer].data_ptr()
        rig.train(ckpt)
        at_second = rig.state()
        second = ckpt.save().wait(TIMEOUT)
        assert ckpt._staging._buffers[base_buffer].data_ptr() == base_address

    assert first.new_bytes == first.payload_bytes > frozen
    manifest = manifest_at(store, 2)
    weights, optimizer = record_of(manifest, Layer.WEIGHTS), record_of(manifest, Layer.OPTIMIZER)
    changed = sum(p.nbytes for p in (model.down.weight, model.up.weight)) + (
        optimizer.payload_bytes - optimizer.header_bytes
    )
    allowance = (
        weights.header_bytes
        + optimizer.header_bytes
        + sum(
            record_of(manifest, layer).payload_bytes
            for layer in Layer
            if layer not in (Layer.WEIGHTS, Layer.OPTIMIZER)
        )
    )
    assert changed <= second.new_bytes <= changed + allowance
    first_blobs = {b.sha256: b.size for b in record_of(manifest_at(store, 1), Layer.WEIGHTS).blobs}
    kept = sum(b.size for b in weights.blobs if b.sha256 in first_blobs)
    assert kept >= frozen

    assert first.copied_bytes >= frozen and first.hashed_bytes == first.payload_bytes
    assert second.copied_bytes <= second.payload_bytes - frozen
    assert second.hashed_bytes <= second.payload_bytes - frozen

    assert_same(resumed_state(tmp_path / "store", lora, step=2), at_second)


def _add_in_place(model: LoRA) -> None:
    with torch.no_grad():
        model.base.weight.add_(0.5)


def _replace(model: LoRA) -> None:
    values = torch.randn(model.base.weight.shape, generator=torch.Generator().manual_seed(7))
    model.base.weight = nn.Parameter(values, requires_grad=False)


def _add_through_data(model: LoRA) -> None:
    model.base.weight.data.add_(0.5)  # the EMA / momentum-encoder idiom


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_add_in_place, id="add_ under no_grad"),
        pytest.param(_replace, id="a new Parameter"),
        # .data bypasses the version counter; the sampled comparison catches it.
        pytest.param(_add_through_data, id="add_ through .data"),
    ],
)
def test_a_changed_frozen_weight_is_saved_again(
    tmp_path: Path, change: Callable[[LoRA], None]
) -> None:
    rig = lora(width=512)
    model = rig.model
    assert isinstance(model, LoRA)
    with rig.checkpointer(DirectoryStore(tmp_path / "store"), blob_bytes=MIB) as ckpt:
        rig.train(ckpt)
        ckpt.save().wait(TIMEOUT)
        before = model.base.weight.detach().clone()
        change(model)
        assert not torch.equal(model.base.weight, before)
        rig.train(ckpt)
        at_second = rig.state()
        ckpt.save().wait(TIMEOUT)

    assert_same(resumed_state(tmp_path / "store", lambda: lora(width=512), step=2), at_second)


def _poke_one_element_through_data(model: LoRA) -> None:
    model.base.weight.data[3, 5] += 1.0  # one element, behind the version counter's back


@pytest.mark.parametrize("skip_unchanged", [True, False])
def test_a_single_element_written_through_data_needs_skip_unchanged_off(
    tmp_path: Path, skip_unchanged: bool
) -> None:
    """The documented limit of the skip: one element changed through ``.data`` escapes both
    the version counter and (likely) the sample; ``skip_unchanged=False`` saves it."""
    rig = lora(width=512)
    model = rig.model
    assert isinstance(model, LoRA)
    with rig.checkpointer(
        DirectoryStore(tmp_path / "store"), blob_bytes=MIB, skip_unchanged=skip_unchanged
    ) as ckpt:
        rig.train(ckpt)
        ckpt.save().wait(TIMEOUT)
        _poke_one_element_through_data(model)
        rig.train(ckpt)
        at_second = rig.state()
        ckpt.save().wait(TIMEOUT)
    resumed = resumed_state(tmp_path / "store", lambda: lora(width=512), step=2)
    if skip_unchanged:
        with pytest.raises(AssertionError):
            assert_same(resumed, at_second)
    else:
        assert_same(resumed, at_second)


def test_fused_adam_and_batch_norm_are_captured_at_every_save(tmp_path: Path) -> None:
    rig = fused_with_batch_norm()
    with rig.checkpointer(DirectoryStore(tmp_path / "store")) as ckpt:
        rig.train(ckpt)
        ckpt.save().wait(TIMEOUT)
        at_first = rig.state()
        rig.train(ckpt, steps=2)
        at_second = rig.state()
        ckpt.save().wait(TIMEOUT)

    moved = [name for name in at_first if not torch.equal(at_first[name], at_second[name])]
    frozen = {"model/0.weight", "model/0.bias"}
    assert set(moved) == at_first.keys() - frozen  # every other tensor changed in between
    assert {"model/1.running_mean", "model/1.running_var"} <= set(moved)
    assert_same(resumed_state(tmp_path / "store", fused_with_batch_norm, step=3), at_second)


# -- staging buffers, configuration, lifecycle ---------------------------------------------


def test_staging_buffers_are_reused_across_saves(tmp_path: Path) -> None:
    rig = mlp()
    addresses: list[dict[str, int]] = []
    with rig.checkpointer(DirectoryStore(tmp_path / "store")) as ckpt:
        for _ in range(3):
            rig.train(ckpt)
            ckpt.save().wait(TIMEOUT)
            addresses.append({n: b.data_ptr() for n, b in ckpt._staging._buffers.items()})

    assert any(name.startswith("weights/") for name in addresses[0])
    assert any(name.startswith("optimizer/") for name in addresses[0])
    assert addresses[0] == addresses[1] == addresses[2]


@pytest.mark.parametrize(
    ("keyword", "expected"),
    [("skip", InFlight.SKIP), ("WAIT", InFlight.WAIT), (InFlight.SKIP, InFlight.SKIP)],
)
def test_in_flight_is_taken_by_keyword(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyword: str, expected: InFlight
) -> None:
    monkeypatch.delenv("CKPT_IN_FLIGHT", raising=False)
    with mlp().checkpointer(DirectoryStore(tmp_path), in_flight=keyword) as ckpt:
        assert ckpt.config.in_flight is expected


def test_in_flight_comes_from_the_environment_unless_a_keyword_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPT_IN_FLIGHT", "Skip")
    with mlp().checkpointer(DirectoryStore(tmp_path)) as ckpt:
        assert ckpt.config.in_flight is InFlight.SKIP
    with mlp().checkpointer(DirectoryStore(tmp_path), in_flight="wait") as ckpt:
        assert ckpt.config.in_flight is InFlight.WAIT


def test_a_bad_in_flight_setting_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPT_IN_FLIGHT", "bogus")
    with pytest.raises(ValueError, match=r"CKPT_IN_FLIGHT.*wait, skip.*'bogus'"):
        mlp().checkpointer(DirectoryStore(tmp_path))


def test_leaving_the_with_block_makes_the_save_durable(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "store")
    rig = mlp()
    with rig.checkpointer(store) as ckpt:
        rig.train(ckpt)
        pending = ckpt.save()
        assert store.entered.wait(TIMEOUT)
        assert not pending.done()
        threading.Timer(0.05, store.gate.set).start()  # opens while __exit__ waits

    assert pending.durable
    assert manifest_at(store, 1).step == 1


def test_resume_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "store")
    rig = mlp()
    with rig.checkpointer(store) as ckpt:
        rig.train(ckpt)
        pending = ckpt.save()
        assert store.entered.wait(TIMEOUT)
        threading.Timer(0.05, store.gate.set).start()
        resumed = ckpt.resume()
        assert pending.durable
        assert (resumed.bundle, resumed.step) == (pending.bundle, 1)
