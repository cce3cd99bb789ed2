"""Resumable data pipelines: a sampler that resumes in O(1), and per-sample RNG seeding.

Neither ``DataLoader`` nor torchdata's ``StatefulDataLoader`` restores the random streams
*inside* worker processes: after a mid-epoch resume each worker starts its stream from its
seed again, so random augmentation in a dataset no longer matches the uninterrupted run.
``PerSampleRNG`` fixes that by seeding Python ``random``, NumPy and torch in the worker
from (seed, epoch, sample index) before each sample, which makes a sample's randomness a
function of its position in the run rather than of the worker's history.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, get_worker_info

from ckpt.agent.stateful import Stateful

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

    Args:
        data_source: the dataset (anything with ``len``) or the number of samples.
        seed: the run's data seed.
        shuffle: False walks the dataset in order every epoch.
    """

    def __init__(self, data_source: Sized | int, *, seed: int = 0, shuffle: bool = True) -> None:
        self.num_samples = data_source if isinstance(data_source, int) else len(data_source)
        if self.num_samples < 1:
            raise ValueError("ResumableSampler needs at least one sample")
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
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch, 1))
        order: list[int] = torch.randperm(self.num_samples, generator=generator).tolist()
        return order

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first sample; calling it again for the same epoch keeps the position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.offset = 0

    def advance(self, count: int) -> None:
        """Mark ``count`` more samples of this epoch as consumed."""
        self.offset = min(self.offset + count, self.num_samples)

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["num_samples"], state["shuffle"]) != (self.num_samples, self.shuffle):
            raise ValueError(
                f"the checkpoint's sampler covered {state['num_samples']} samples "
                f"(shuffle={state['shuffle']}); this one covers {self.num_samples} "
                f"(shuffle={self.shuffle}): resuming would replay a different order"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])


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


# -- how the checkpointer drives each kind of data pipeline ------------------------------


@dataclass(frozen=True)
class Resumed:
    """Where the restored run stood in its data when the first iterator is created."""

    epoch: int
    batch: int


class DataSource(Protocol):
    """How the checkpointer drives and captures one kind of data pipeline."""

    def begin_epoch(self, epoch: int) -> None: ...

    def batches(self, *, resumed: Resumed | None) -> Iterator[Any]: ...

    def consumed(self) -> None: ...

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def _set_epoch(target: object, epoch: int) -> None:
    set_epoch = getattr(target, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def _iterate_loader(
    loader: DataLoader[Any], *, resumed: Resumed | None, generator_in_state: bool
) -> Iterator[Any]:
    """``iter(loader)``, leaving the generators as the uninterrupted run had them.

    Creating a DataLoader iterator draws the workers' base seed from ``loader.generator``, or
    from the global generator when that is None. The uninterrupted run drew it when the
    epoch started (``Checkpointer.batches`` keeps one iterator per epoch), or only once per
    run with ``persistent_workers``; the first iterator after a resume must not draw again
    from a generator the checkpoint just restored. ``generator_in_state``: the loader's own
    generator is part of its state (a ``StatefulDataLoader``), which its restore manages.
    """
    redundant = resumed is not None and (
        resumed.batch > 0 or (loader.persistent_workers and resumed.epoch > 0)
    )
    generator = loader.generator
    if generator is None:
        generator = torch.default_generator
    elif generator_in_state:
        redundant = False
    saved = generator.get_state() if redundant else None
    iterator = iter(loader)
    if saved is not None:
        generator.set_state(saved)
    return iterator


def _refuse_frozen_epoch(loader: DataLoader[Any]) -> None:
    if (
        loader.persistent_workers
        and isinstance(loader.dataset, PerSampleRNG)
        and not isinstance(loader.sampler, ResumableSampler)
    ):
        raise ValueError(
            "PerSampleRNG cannot see the epoch inside persistent workers unless the indices "
            "come from ResumableSampler (which carries it): use a plain DataLoader with "
            "sampler=ResumableSampler(...), or persistent_workers=False"
        )


class SamplerLoader:
    """A plain ``DataLoader`` shuffling through a ``ResumableSampler``."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        if not isinstance(loader.sampler, ResumableSampler) or loader.batch_size is None:
            raise ValueError(
                "a plain DataLoader resumes only through ckpt's sampler: "
                "DataLoader(dataset, batch_size=..., sampler=ResumableSampler(dataset, seed=...)); "
                "or use torchdata's StatefulDataLoader"
            )
        self.loader = loader
        self.sampler: ResumableSampler = loader.sampler
        self.batch_size: int = loader.batch_size

    def begin_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        _set_epoch(self.loader.dataset, epoch)

    def batches(self, *, resumed: Resumed | None) -> Iterator[Any]:
        return _iterate_loader(self.loader, resumed=resumed, generator_in_state=False)

    def consumed(self) -> None:
        self.sampler.advance(self.batch_size)

    def state_dict(self) -> Any:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Any) -> None:
        self.sampler.load_state_dict(state["sampler"])


class SamplerItems:
    """A bare ``ResumableSampler`` iterated for its indices, one consumed per item."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    def begin_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def batches(self, *, resumed: Resumed | None) -> Iterator[Any]:
        return iter(self.sampler)

    def consumed(self) -> None:
        self.sampler.advance(1)

    def state_dict(self) -> Any:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.sampler.load_state_dict(state)


def _is_shuffling_sampler(sampler: object) -> bool:
    try:
        from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler
    except ImportError:
        return isinstance(sampler, RandomSampler)
    return isinstance(sampler, RandomSampler | StatefulRandomSampler)


class StatefulSource:
    """Any iterable (or not) with ``state_dict``/``load_state_dict``: a ``StatefulDataLoader``,
    a user's stream. Its own state says which batch comes next."""

    def __init__(self, source: Stateful) -> None:
        if isinstance(source, DataLoader):
            _check_stateful_loader(source)
        self.source = source

    def begin_epoch(self, epoch: int) -> None:
        _set_epoch(getattr(self.source, "sampler", None), epoch)
        _set_epoch(getattr(self.source, "dataset", self.source), epoch)

    def batches(self, *, resumed: Resumed | None) -> Iterator[Any]:
        if isinstance(self.source, DataLoader):
            return _iterate_loader(self.source, resumed=resumed, generator_in_state=True)
        if not isinstance(self.source, Iterable):
            raise TypeError(f"{type(self.source).__name__} is not iterable; iterate it yourself")
        return iter(self.source)

    def consumed(self) -> None:
        return None

    def state_dict(self) -> Any:
        return self.source.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.source.load_state_dict(state)


def _check_stateful_loader(loader: DataLoader[Any]) -> None:
    if isinstance(loader.sampler, ResumableSampler):
        raise ValueError(
            "a StatefulDataLoader restores its sampler from the sampler's own state, which "
            "ResumableSampler advances only through a plain DataLoader: use "
            "DataLoader(dataset, batch_size=..., sampler=ResumableSampler(...)) instead"
        )
    if loader.num_workers == 0:
        raise ValueError(
            "a StatefulDataLoader with num_workers=0 does not restore the shuffle order of the "
            "epochs after a resume (torchdata 0.11); use num_workers >= 1, or a plain "
            "DataLoader with ckpt's ResumableSampler"
        )
    if loader.generator is None and _is_shuffling_sampler(loader.sampler):
        raise ValueError(
            "this loader shuffles with a generator seeded from the global RNG; pass "
            "generator=torch.Generator().manual_seed(SEED) to it (or use a plain DataLoader "
            "with ckpt's ResumableSampler) so a resume does not shift the global random stream"
        )
    _refuse_frozen_epoch(loader)


def data_source(data: object) -> DataSource:
    """The adapter for what the loop iterates.

    Raises:
        ValueError: a loader that cannot resume, with what to change.
        TypeError: an object with no state to capture.
    """
    if isinstance(data, ResumableSampler):
        return SamplerItems(data)
    if isinstance(data, DataLoader) and not isinstance(data, Stateful):
        _refuse_frozen_epoch(data)
        return SamplerLoader(data)
    if isinstance(data, Stateful):
        return StatefulSource(data)
    raise TypeError(
        f"data={type(data).__name__} has no state_dict()/load_state_dict(); pass a DataLoader "
        "with ckpt's ResumableSampler, a torchdata StatefulDataLoader, or a stateful object"
    )
