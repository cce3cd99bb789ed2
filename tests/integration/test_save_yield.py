"""A save's hashing and writing pause while the optimizer steps (issue 32,
``agent.save.yielding``): a real checkpointer writing to a directory, with the step held
open by the test while the save's writer threads are mid-blob."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt import Checkpointer
from ckpt.core.storage import DirectoryStore

HELD = 0.5  # how long the test's step watches the writers: less than the 1 s a step may hold them


class HeldStore(DirectoryStore):
    """The directory store, counting the blob pieces its writers take; each writer waits at
    its first piece until the test lets them all go."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.taken = 0
        self.moved = threading.Condition()
        self.writing = threading.Event()
        self.go = threading.Event()

    def put(self, key: str, pieces: Iterable[memoryview | bytes]) -> None:
        if key.startswith("blobs/"):
            pieces = self._counted(pieces)
        super().put(key, pieces)

    def _counted(self, pieces: Iterable[memoryview | bytes]) -> Iterator[memoryview | bytes]:
        for piece in pieces:
            with self.moved:
                self.taken += 1
                self.moved.notify_all()
            self.writing.set()
            self.go.wait()
            yield piece


def job() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2048, bias=False))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 2048)).square().mean().backward()
    optimizer.step()  # 96 MB of state: 24 pieces of 4 MiB to write
    return model, optimizer


def open_checkpointer(
    store: DirectoryStore, model: nn.Module, optimizer: torch.optim.Optimizer
) -> Checkpointer:
    return Checkpointer(
        run="yield",
        store=store,
        models=model,
        optimizers=optimizer,
        handle_signals=False,
        quiet=True,
    )


@pytest.mark.parametrize(
    ("setting", "cuda", "pauses"),
    [("60", False, True), ("0", False, False), (None, False, False), (None, True, True)],
)
def test_a_saves_writers_wait_while_the_optimizer_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None, cuda: bool, pauses: bool
) -> None:
    """Inside the step no writer takes another piece, though they were let go at its start;
    once it ends the save completes and holds the state as it was saved. With 0, or unset in
    a process that trains on the CPU alone, they go on writing; unset, they pause once the
    process uses CUDA (this machine has no GPU: that flag is the one thing faked)."""
    if setting is not None:
        monkeypatch.setenv("CKPT_SAVE_YIELD_SECONDS", setting)  # 60: longer than it watches
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    store = HeldStore(tmp_path)
    model, optimizer = job()
    moved_in_step: list[bool] = []

    def watch_the_writers(*_: object) -> None:  # a pre-hook after the checkpointer's
        with store.moved:
            before = store.taken
            store.go.set()
            moved_in_step.append(store.moved.wait_for(lambda: store.taken > before, HELD))

    with open_checkpointer(store, model, optimizer) as ckpt:
        optimizer.register_step_pre_hook(watch_the_writers)
        saved = {name: t.clone() for name, t in model.state_dict().items()}
        ckpt.counters.step = 1
        pending = ckpt.save()
        assert store.writing.wait(30)
        optimizer.step()
        result = pending.wait(timeout=60)
    assert moved_in_step == [not pauses]
    assert result.new_bytes > 90e6
    fresh, fresh_optimizer = job()
    with open_checkpointer(DirectoryStore(tmp_path), fresh, fresh_optimizer) as again:
        assert again.resume() is not None
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[name])


def test_a_step_that_raises_holds_the_save_no_longer_than_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises runs no post-hook, so the gate stays closed: the writers go on
    once it has been closed ``CKPT_SAVE_YIELD_SECONDS``."""
    monkeypatch.setenv("CKPT_SAVE_YIELD_SECONDS", "0.2")
    store = HeldStore(tmp_path)
    model, optimizer = job()

    def fail(*_: object) -> None:
        store.go.set()
        raise RuntimeError("the loop's step failed")

    with open_checkpointer(store, model, optimizer) as ckpt:
        optimizer.register_step_pre_hook(fail)
        ckpt.counters.step = 1
        pending = ckpt.save()
        assert store.writing.wait(30)
        with pytest.raises(RuntimeError, match="step failed"):
            optimizer.step()
        result = pending.wait(timeout=60)
    assert result.new_bytes > 90e6
