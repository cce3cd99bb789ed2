"""How the checkpointer drives and captures each kind of data pipeline: the data layer.

``data_source`` picks the adapter for what the loop iterates: a ``DataLoader`` over ckpt's
``ResumableSampler`` (``sampling``), a bare sampler, or any stateful object such as
torchdata's ``StatefulDataLoader``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, RandomSampler

from ckpt.agent.sampling import PerSampleRNG, ResumableSampler
from ckpt.agent.stateful import Stateful


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


def reshardable(source: DataSource | None) -> bool:
    """Whether a data position saved by one world size can continue at another: no data,
    or ckpt's sampler, which converts its position (``ResumableSampler.load_state_dict``)."""
    return source is None or isinstance(source, SamplerLoader | SamplerItems)


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
