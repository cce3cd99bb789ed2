"""Which data pipelines the checkpointer accepts, and what it refuses with advice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ckpt import Checkpointer, PerSampleRNG, ResumableSampler
from ckpt.core.errors import IncompatibleBundleError
from ckpt.core.storage import DirectoryStore

DATASET = TensorDataset(torch.arange(16))


def checkpointer(tmp_path: Path, data: object, **kwargs: Any) -> Checkpointer:
    return Checkpointer(
        run="data", store=DirectoryStore(tmp_path), models=nn.Linear(1, 1), data=data, **kwargs
    )


@pytest.mark.parametrize(
    ("make", "advice"),
    [
        (lambda: DataLoader(DATASET, batch_size=4, shuffle=True), "ResumableSampler"),
        (
            lambda: DataLoader(DATASET, batch_size=None, sampler=ResumableSampler(DATASET)),
            "ResumableSampler",
        ),
        (
            lambda: StatefulDataLoader(DATASET, batch_size=4, shuffle=True, num_workers=0),
            "num_workers",
        ),
        (
            lambda: StatefulDataLoader(DATASET, batch_size=4, shuffle=True, num_workers=1),
            "generator=",
        ),
        (
            lambda: StatefulDataLoader(
                PerSampleRNG(DATASET),
                batch_size=4,
                shuffle=True,
                num_workers=1,
                persistent_workers=True,
                generator=torch.Generator(),
            ),
            "persistent",
        ),
        (
            lambda: DataLoader(
                PerSampleRNG(DATASET),
                batch_size=4,
                shuffle=False,
                num_workers=1,
                persistent_workers=True,
            ),
            "persistent",
        ),
    ],
    ids=[
        "shuffle",
        "no-batch-size",
        "stateful-no-workers",
        "stateful-no-generator",
        "stateful-persistent-per-sample",
        "plain-persistent-per-sample",
    ],
)
def test_loaders_that_cannot_resume_are_refused_with_advice(
    tmp_path: Path, make: object, advice: str
) -> None:
    with pytest.raises(ValueError, match=advice):
        checkpointer(tmp_path, make())  # type: ignore[operator]


def test_objects_without_state_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="state_dict"):
        checkpointer(tmp_path, [1, 2, 3])


def test_generators_must_be_generators(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"generators\['g'\]"):
        checkpointer(tmp_path, None, generators={"g": 3})


def test_a_bare_sampler_resumes_after_the_last_consumed_index(tmp_path: Path) -> None:
    def consume(ckpt: Checkpointer, count: int) -> list[int]:
        taken: list[int] = []
        while len(taken) < count:
            for index in ckpt.batches():
                taken.append(int(index))
                if len(taken) == count:
                    break
        return taken

    uninterrupted = consume(checkpointer(tmp_path / "a", ResumableSampler(8, seed=3)), 20)
    first = checkpointer(tmp_path / "b", ResumableSampler(8, seed=3))
    head = consume(first, 13)
    first.save().wait()
    second = checkpointer(tmp_path / "b", ResumableSampler(8, seed=3))
    second.resume()
    assert head + consume(second, 7) == uninterrupted


def test_a_random_state_generator_round_trips(tmp_path: Path) -> None:
    state = np.random.RandomState(5)
    ckpt = checkpointer(tmp_path, None, generators={"legacy": state})
    state.random_sample(3)
    ckpt.save().wait()
    expected = state.random_sample(4)
    fresh_state = np.random.RandomState(0)
    checkpointer(tmp_path, None, generators={"legacy": fresh_state}).resume()
    assert np.array_equal(fresh_state.random_sample(4), expected)


def test_a_resumable_sampler_inside_a_stateful_loader_is_refused(tmp_path: Path) -> None:
    loader = StatefulDataLoader(
        DATASET, batch_size=4, sampler=ResumableSampler(DATASET), num_workers=1
    )
    with pytest.raises(ValueError, match="plain DataLoader"):
        checkpointer(tmp_path, loader)


def test_a_loader_generator_also_used_for_augmentation_resumes_exactly(tmp_path: Path) -> None:
    # The first iterator after a resume must not draw the base seed from the loader's own
    # generator again: here that generator also drives augmentation, registered with ckpt.
    def run(store: Path, *, stop_at: int | None, resume: bool) -> list[float]:
        generator = torch.Generator().manual_seed(3)
        loader = DataLoader(
            DATASET, batch_size=2, sampler=ResumableSampler(DATASET, seed=1), generator=generator
        )
        ckpt = checkpointer(store, loader, generators={"augment": generator})
        if resume:
            ckpt.resume()
        draws: list[float] = []
        while ckpt.counters.epoch < 3:
            for _ in ckpt.batches():
                draws.append(torch.rand(1, generator=generator).item())
                if len(draws) == stop_at:
                    ckpt.save().wait()
                    return draws
        return draws

    uninterrupted = run(tmp_path / "a", stop_at=None, resume=False)
    head = run(tmp_path / "b", stop_at=11, resume=False)
    assert head + run(tmp_path / "b", stop_at=None, resume=True) == uninterrupted


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_over_torchs_distributed_sampler_resumes_mid_epoch(
    tmp_path: Path, workers: int
) -> None:
    # One rank's view (rank 1 of 3, no process group needed): a resume in the middle of the
    # second epoch skips the indices it had consumed and goes on in the same order.
    def run(store: Path, *, stop_at: int | None, resume: bool) -> list[list[int]]:
        sampler: DistributedSampler[Any] = DistributedSampler(
            DATASET, num_replicas=3, rank=1, seed=7
        )
        loader = DataLoader(DATASET, batch_size=2, sampler=sampler, num_workers=workers)
        ckpt = checkpointer(store, loader)
        if resume:
            ckpt.resume()
        taken: list[list[int]] = []
        while ckpt.counters.epoch < 3:
            for (batch,) in ckpt.batches():
                taken.append(batch.tolist())
                if len(taken) == stop_at:
                    ckpt.save().wait()
                    return taken
        return taken

    uninterrupted = run(tmp_path / "a", stop_at=None, resume=False)
    assert len(uninterrupted) == 9 and uninterrupted[:3] != uninterrupted[3:6]  # shuffled
    head = run(tmp_path / "b", stop_at=4, resume=False)
    assert head + run(tmp_path / "b", stop_at=None, resume=True) == uninterrupted


def test_a_distributed_sampler_position_carries_over_to_another_world_size(
    tmp_path: Path,
) -> None:
    def loader(replicas: int, rank: int, seed: int = 7) -> DataLoader[Any]:
        sampler: DistributedSampler[Any] = DistributedSampler(
            DATASET, num_replicas=replicas, rank=rank, seed=seed
        )
        return DataLoader(DATASET, batch_size=2, sampler=sampler)

    saved = checkpointer(tmp_path, loader(2, 0))
    for _ in zip(range(2), saved.batches(), strict=False):
        pass
    saved.save().wait()
    # 2 ranks x 2 batches x 2 samples = 8 consumed in all: 2 per rank at 4 ranks.
    resumed = checkpointer(tmp_path, loader(4, 3))
    resumed.resume(layers=["data"])
    permutation = torch.randperm(16, generator=torch.Generator().manual_seed(7)).tolist()
    assert [batch.tolist() for (batch,) in resumed.batches()] == [permutation[8 + 3 :: 4]]
    with pytest.raises(IncompatibleBundleError, match="different order"):
        checkpointer(tmp_path, loader(2, 0, seed=8)).resume(layers=["data"])
