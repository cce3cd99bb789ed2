"""What a reader found in another tool's checkpoint, in the shapes of ckpt's layers.

Each layer's state is the one ``agent.state.layers`` captures, for the objects named as
the integration that resumes it names them: a bundle made here restores as if a save of
that integration had written it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agent.counters import Counters
from agent.state.layers import State
from ckpt.core.contract import ImportFormat, Layer
from ckpt.core.errors import ImportSourceError


@dataclass
class Found:
    """The layers read from a checkpoint at ``step``; ``missing`` says why each other is not."""

    format: ImportFormat
    path: Path
    step: int
    layers: dict[Layer, State] = field(default_factory=dict)
    missing: dict[Layer, str] = field(default_factory=dict)

    def fill(self, layer: Layer, state: State | None, *, why_not: str) -> None:
        """Keep ``state`` as the layer, or note the layer as missing, and why."""
        if state is None:
            self.missing[layer] = why_not
        else:
            self.layers[layer] = state


def weights(
    models: dict[str, dict[str, torch.Tensor]], *, extras: dict[str, Any] | None = None
) -> State:
    """The weights layer of plain models: no fp32 masters, gradients or DDP buckets."""
    return {
        "models": models,
        "module_versions": {name: None for name in models},
        "masters": {},
        "extras": extras or {},
        "grads": None,
        "buckets": {name: None for name in models},
    }


def optimizer(optimizers: dict[str, State], *, scaler: State | None = None) -> State:
    return {"optimizers": optimizers, "scaler": scaler}


def counters(*, step: int, epoch: int = 0, batch: int = 0, **extras: Any) -> State:
    return Counters(step=step, epoch=epoch, batch=batch, extras=dict(extras)).to_state()


def rng(saved: dict[str, Any], *, path: Path) -> State:
    """The rng layer from the RNG dict the Hugging Face Trainer (and many loops) save:
    ``python`` (``random.getstate()``), ``numpy`` (``np.random.get_state()``, either
    form), ``cpu`` or ``torch`` (``torch.get_rng_state()``), ``cuda`` (optional)."""
    try:
        cpu = saved["cpu"] if "cpu" in saved else saved["torch"]
        state: State = {
            "python": _python_state(saved["python"]),
            "numpy": _numpy_state(saved["numpy"]),
            "torch": cpu,
            "cuda": _cuda_states(saved.get("cuda")),
            "generators": {},
        }
    except (KeyError, TypeError, ValueError) as err:
        raise ImportSourceError(
            f"{path}: not an RNG state of python, numpy and torch ({err!r} missing or malformed)"
        ) from err
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        raise ImportSourceError(f"{path}: the torch RNG state is not a uint8 tensor")
    return state


def _python_state(saved: Any) -> tuple[Any, ...]:
    version, internal, gauss = saved
    return (int(version), tuple(int(word) for word in internal), gauss)


def _numpy_state(saved: Any) -> dict[str, Any]:
    """NumPy's global state as ``get_state(legacy=False)`` gives it."""
    if isinstance(saved, dict):
        return saved
    name, key, pos, has_gauss, gauss = saved
    return {
        "bit_generator": str(name),
        "state": {"key": np.asarray(key, dtype=np.uint32), "pos": int(pos)},
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def _cuda_states(saved: Any) -> list[torch.Tensor]:
    """Every CUDA device's RNG state: HF saves all devices' as a list, or one tensor."""
    if saved is None:
        return []
    return list(saved) if isinstance(saved, list | tuple) else [saved]
