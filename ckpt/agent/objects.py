"""The training objects a checkpointer captures, gathered by name.

Objects come singly, as a list, or as a ``{name: object}`` dict; the names key them in the
bundle, so they must stay the same across restarts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ckpt.agent.counters import Counters
from ckpt.agent.data import DataSource, data_source
from ckpt.agent.stateful import Stateful

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


def gather(
    *,
    models: nn.Module | Iterable[nn.Module] | Mapping[str, nn.Module],
    optimizers: object,
    schedulers: object,
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


def named(objects: Any, kind: type[Any]) -> dict[str, Any]:
    """``{name: object}`` from one object (named "0"), a list (named by position) or a dict."""
    if objects is None:
        return {}
    if isinstance(objects, Mapping):
        return {str(name): value for name, value in objects.items()}
    if isinstance(objects, kind) or not isinstance(objects, Iterable):
        return {"0": objects}
    return {str(i): value for i, value in enumerate(objects)}
