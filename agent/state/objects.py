"""The training objects a checkpointer captures, gathered by name.

Objects come singly, as a list, or as a ``{name: object}`` dict; the names key them in the
bundle, so they must stay the same across restarts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

import numpy as np
import torch
from torch import nn

from agent.counters import Counters
from agent.data.sources import DataSource, data_source
from agent.stateful import Stateful
from ckpt.core.contract import Layer

T = TypeVar("T")

Generator = torch.Generator | np.random.Generator | np.random.RandomState
GENERATOR_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState)


@dataclass
class TrainingObjects:
    """Everything a training step mutates, by name."""

    models: dict[str, nn.Module]
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    schedulers: dict[str, Stateful] = field(default_factory=dict)
    scaler: Stateful | None = None
    data: DataSource | None = None
    extras: dict[str, Stateful] = field(default_factory=dict)
    generators: dict[str, Generator] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)


Some: TypeAlias = T | Iterable[T] | Mapping[str, T]  # one, a list, or a dict by name


def gather(
    *,
    models: Some[nn.Module],
    optimizers: Some[torch.optim.Optimizer] | None,
    schedulers: Some[Stateful] | None,
    data: object | None,
    scaler: Stateful | None,
    extras: Mapping[str, Stateful] | None,
    generators: Mapping[str, Generator] | None,
) -> TrainingObjects:
    """The objects by name, checked.

    Raises:
        ValueError: no model, a generator of an unknown kind, or a data pipeline that
            cannot resume (saying what to change).
    """
    objects = TrainingObjects(
        models=named(models, nn.Module),
        optimizers=named(optimizers, torch.optim.Optimizer),
        schedulers=named(schedulers, Stateful),
        scaler=scaler,
        data=data_source(data) if data is not None else None,
        extras=dict(extras or {}),
        generators=dict(generators or {}),
    )
    if not objects.models:
        raise ValueError("pass at least one model: Checkpointer(models=model, ...)")
    for name, generator in objects.generators.items():
        if not isinstance(generator, GENERATOR_TYPES):
            raise ValueError(
                f"generators[{name!r}] is a {type(generator).__name__}; pass torch.Generator, "
                "numpy.random.Generator or numpy.random.RandomState objects"
            )
    return objects


def replicated_layers(objects: TrainingObjects, *, world_size: int) -> frozenset[Layer]:
    """The layers every rank holds byte for byte: the weights and optimizer state when
    every model is wrapped in ``DistributedDataParallel`` (which keeps the replicas equal,
    buffers included), in a job of many ranks. Sharded (FSDP) or plain models: none."""
    ddp = nn.parallel.DistributedDataParallel
    if world_size > 1 and all(isinstance(model, ddp) for model in objects.models.values()):
        return frozenset((Layer.WEIGHTS, Layer.OPTIMIZER))
    return frozenset()


def named(objects: Some[T] | None, kind: type[Any]) -> dict[str, T]:
    """``{name: object}`` from one object (named "0"), a list (named by position) or a dict."""
    if objects is None:
        return {}
    if isinstance(objects, Mapping):
        return {str(name): value for name, value in objects.items()}
    if isinstance(objects, kind) or not isinstance(objects, Iterable):
        return {"0": objects}
    return {str(i): value for i, value in enumerate(objects)}
