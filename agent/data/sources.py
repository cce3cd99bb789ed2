"""How the checkpointer drives and captures each kind of data pipeline: the data layer.

``data_source`` picks the adapter for what the loop iterates: a ``DataLoader`` over ckpt's
``ResumableSampler`` (``sampling``) or over torch's ``DistributedSampler``, a bare sampler,
or any stateful object such as torchdata's ``StatefulDataLoader``.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from agent.data.sampling import PerSampleRNG, ResumableSampler
from agent.stateful import Stateful


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
    if saved is not None and inspect.isgenerator(iterator):
        # A loader whose ``__iter__`` is a generator function (Accelerate's) creates the
        # DataLoader iterator, and draws the seed, only at the first batch.
        return _keeping_state(iterator, generator)
    if saved is not None:
        generator.set_state(saved)
    return iterator


def _keeping_state(iterator: Iterator[Any], generator: torch.Generator) -> Iterator[Any]:
    """``iterator``, with ``generator`` as it was before the first batch was drawn."""
    saved = generator.get_state()
    first = next(iterator, _END)
    generator.set_state(saved)
    if first is not _END:
        yield first
        yield from iterator


_END = object()


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
        sampler, batch_size = _resumable_batches(loader)
        if sampler is None or batch_size is None:
            raise ValueError(
                "a plain DataLoader resumes only through ckpt's sampler or torch's "
                "DistributedSampler: DataLoader(dataset, batch_size=..., "
                "sampler=ResumableSampler(dataset, seed=...)); or use torchdata's StatefulDataLoader"
            )
        self.loader = loader
        self.sampler: ResumableSampler = sampler
        self.batch_size: int = batch_size

    def begin_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        _set_epoch(self.loader.dataset, epoch)
        # A loader that keeps its own epoch and hands it to its sampler at each iterator
        # (Accelerate's DataLoaderShard) is told the epoch too, or it would rewind it.
        _set_epoch(self.loader, epoch)

    def batches(self, *, resumed: Resumed | None) -> Iterator[Any]:
        return _iterate_loader(self.loader, resumed=resumed, generator_in_state=False)

    def consumed(self) -> None:
        self.sampler.advance(self.batch_size)

    def state_dict(self) -> Any:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Any) -> None:
        self.sampler.load_state_dict(state["sampler"])


def _resumable_batches(loader: DataLoader[Any]) -> tuple[ResumableSampler | None, int | None]:
    """The loader's ``ResumableSampler`` and batch size: its own, or those of the batch
    sampler it was given (Accelerate's prepared loaders pass one built over the sampler)."""
    if isinstance(loader.sampler, ResumableSampler):
        return loader.sampler, loader.batch_size
    inner = getattr(loader.batch_sampler, "sampler", None)
    if isinstance(inner, ResumableSampler) and type(loader.batch_sampler) is BatchSampler:
        return inner, loader.batch_sampler.batch_size
    return None, None


def _batches_over_resumable_sampler(loader: DataLoader[Any]) -> bool:
    """Whether the loader draws batches from a batch sampler over a ``ResumableSampler``."""
    return not isinstance(loader.sampler, ResumableSampler) and (
        _resumable_batches(loader)[0] is not None
    )


_SKIPPING: dict[type, type] = {}


def _skipping(kind: type[DistributedSampler[Any]]) -> type[DistributedSampler[Any]]:
    """A subclass of ``kind`` whose next iterator starts ``skip`` indices in: a resumed epoch
    goes on without loading the samples it had consumed. (Only a plain subclass: with a
    mixin first, CPython refuses the ``__class__`` assignment for a layout mismatch.)"""
    if kind not in _SKIPPING:

        def iterate(self: Any) -> Iterator[int]:
            skip, self.skip = self.skip, 0
            return itertools.islice(kind.__iter__(self), skip, None)

        namespace = {"__iter__": iterate, "skip": 0, "__module__": kind.__module__}
        _SKIPPING[kind] = type(kind.__name__, (kind,), namespace)
    return _SKIPPING[kind]


class DistributedLoader:
    """A plain ``DataLoader`` over torch's ``DistributedSampler``, one per rank.

    Its position is the epoch and the samples this rank consumed in it. The sampler's order
    is a function of (seed, epoch), so a resume only skips that many indices: the sampler's
    class becomes a subclass of itself whose next iterator starts there (``_skipping``).
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        sampler = loader.sampler
        if not isinstance(sampler, DistributedSampler) or loader.batch_size is None:
            raise TypeError(
                "DistributedLoader needs a DataLoader(batch_size=..., sampler=DistributedSampler)"
            )
        if type(sampler) not in _SKIPPING.values():
            sampler.__class__ = _skipping(type(sampler))
        self.loader = loader
        self.sampler: DistributedSampler[Any] = sampler
        self.batch_size: int = loader.batch_size
        self.epoch = 0
        self.offset = 0

    def begin_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.offset = epoch, 0
        self.sampler.set_epoch(epoch)
        _set_epoch(self.loader.dataset, epoch)

    def batches(self, *, resumed: Resumed | None) -> Iterator[Any]:
        self.sampler.skip = self.offset  # type: ignore[attr-defined]
        return _iterate_loader(self.loader, resumed=resumed, generator_in_state=False)

    def consumed(self) -> None:
        self.offset = min(self.offset + self.batch_size, self.sampler.num_samples)

    def state_dict(self) -> Any:
        sampler = self.sampler
        return {
            "samples": len(sampler.dataset),  # type: ignore[arg-type]
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "drop_last": sampler.drop_last,
            "num_replicas": sampler.num_replicas,
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state: Any) -> None:
        """Take the position back; saved by another number of replicas, the epoch goes on
        from the same number of samples consumed in all, rounded down (as ``ResumableSampler``)."""
        sampler = self.sampler
        saved = {key: state[key] for key in ("samples", "seed", "shuffle", "drop_last")}
        here = {key: self.state_dict()[key] for key in saved}
        if saved != here:
            raise ValueError(
                f"the checkpoint's DistributedSampler had {saved}; this one has {here}: "
                "resuming would replay a different order"
            )
        self.epoch = int(state["epoch"])
        consumed = int(state["offset"]) * int(state["num_replicas"])
        self.offset = min(consumed // sampler.num_replicas, sampler.num_samples)


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
    or a sampler whose position converts (``ResumableSampler``, ``DistributedSampler``)."""
    return source is None or isinstance(source, SamplerLoader | SamplerItems | DistributedLoader)


def data_source(data: object) -> DataSource:
    """The adapter for what the loop iterates.

    Raises:
        ValueError: a loader that cannot resume, with what to change.
        TypeError: an object with no state to capture.
    """
    if isinstance(data, ResumableSampler):
        return SamplerItems(data)
    if isinstance(data, DataLoader) and _batches_over_resumable_sampler(data):
        return SamplerLoader(data)  # Accelerate's prepared loader, stateful or not
    if isinstance(data, DataLoader) and not isinstance(data, Stateful):
        _refuse_frozen_epoch(data)
        if isinstance(data.sampler, DistributedSampler) and data.batch_size is not None:
            return DistributedLoader(data)
        return SamplerLoader(data)
    if isinstance(data, Stateful):
        return StatefulSource(data)
    raise TypeError(
        f"data={type(data).__name__} has no state_dict()/load_state_dict(); pass a DataLoader "
        "with ckpt's ResumableSampler, a torchdata StatefulDataLoader, or a stateful object"
    )
