"""Resumable sampling: a sampler that resumes in O(1), and per-sample RNG seeding.

Neither ``DataLoader`` nor torchdata's ``StatefulDataLoader`` restores the random streams
*inside* worker processes: after a mid-epoch resume each worker starts its stream from its
seed again, so random augmentation in a dataset no longer matches the uninterrupted run.
``PerSampleRNG`` fixes that by seeding Python ``random``, NumPy and torch in the worker
from (seed, epoch, sample index) before each sample, which makes a sample's randomness a
function of its position in the run rather than of the worker's history.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sized
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

T_co = TypeVar("T_co", covariant=True)
_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 rounds): stable across runs and platforms."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 29
    return state >> 1


class SampleIndex(int):
    """A dataset index that carries the seed of its sample's randomness."""

    seed: int

    def __new__(cls, index: int, seed: int) -> SampleIndex:
        value = super().__new__(cls, index)
        value.seed = seed
        return value

    def __reduce__(self) -> tuple[type[SampleIndex], tuple[int, int]]:
        return SampleIndex, (int(self), self.seed)


class ResumableSampler(Sampler[int]):
    """A shuffling sampler whose position is part of the checkpoint.

    Each epoch's order is a permutation drawn from its own generator seeded by
    (``seed``, epoch), so it never touches the global RNG, and resuming at sample ``k`` of an
    epoch costs one permutation, not ``k`` loaded samples. ``Checkpointer.batches`` advances
    the position as batches are *consumed*, which is what a resume needs even though the
    DataLoader's workers prefetch ahead of the training loop.

    Sharded (``num_replicas`` > 1, one sampler per rank, as ``DistributedSampler``): every
    rank draws the same permutation, padded by wrapping around to a multiple of
    ``num_replicas``, and takes every ``num_replicas``-th index from ``rank``.

    Args:
        data_source: the dataset (anything with ``len``) or the number of samples.
        seed: the run's data seed.
        shuffle: False walks the dataset in order every epoch.
        num_replicas, rank: the ranks sharing the data, and this one.
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        self.total = data_source if isinstance(data_source, int) else len(data_source)
        if self.total < 1:
            raise ValueError("ResumableSampler needs at least one sample")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not one of the {num_replicas} replicas (0 to N-1)")
        self.num_replicas, self.rank = num_replicas, rank
        self.num_samples = -(-self.total // num_replicas)  # this rank's share, padded
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        epoch_seed = mix_seed(self.seed, self.epoch)
        for position in range(self.offset, self.num_samples):
            index = order[position]
            yield SampleIndex(index, mix_seed(epoch_seed, index))

    def _order(self) -> list[int]:
        """This rank's indices of the epoch, in order."""
        if not self.shuffle:
            order = list(range(self.total))
        else:
            generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch, 1))
            order = torch.randperm(self.total, generator=generator).tolist()
        padded = self.num_samples * self.num_replicas
        order += (order * (padded // self.total + 1))[: padded - self.total]
        return order[self.rank :: self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first sample; calling it again for the same epoch keeps the position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.offset = 0

    def advance(self, count: int) -> None:
        """Mark ``count`` more samples of this epoch as consumed."""
        self.offset = min(self.offset + count, self.num_samples)

    def state_dict(self) -> dict[str, int | bool]:
        state: dict[str, int | bool] = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.total,
            "epoch": self.epoch,
            "offset": self.offset,
        }
        if self.num_replicas > 1:
            state["num_replicas"] = self.num_replicas
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the position back. Saved by another number of replicas (a resume to another
        world size), the epoch goes on from the same number of samples consumed in all,
        rounded down, in this world size's order: training continues, not bit-exactly."""
        if (state["num_samples"], state["shuffle"]) != (self.total, self.shuffle):
            raise ValueError(
                f"the checkpoint's sampler covered {state['num_samples']} samples "
                f"(shuffle={state['shuffle']}); this one covers {self.total} "
                f"(shuffle={self.shuffle}): resuming would replay a different order"
            )
        replicas = int(state.get("num_replicas", 1))
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.offset = min(int(state["offset"]) * replicas // self.num_replicas, self.num_samples)


class PerSampleRNG(Dataset[T_co], Generic[T_co]):
    """Wrap a map-style dataset so each sample's randomness depends only on its position.

    In a DataLoader worker, seeds ``random``, ``numpy.random`` and torch before fetching
    each sample: from the seed a ``ResumableSampler`` attaches to the index, or else from
    (``seed``, epoch, index). In the main process (``num_workers=0``) it seeds nothing: there
    the data pipeline draws from the global generators that the rng layer captures.
    """

    def __init__(self, dataset: Dataset[T_co], *, seed: int = 0) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> T_co:
        if get_worker_info() is not None:
            if isinstance(index, SampleIndex):
                seed = index.seed
            else:
                seed = mix_seed(mix_seed(self.seed, self.epoch), index)
            random.seed(seed)
            np.random.seed(seed & 0xFFFF_FFFF)
            torch.manual_seed(seed)
        return self.dataset[int(index)]
