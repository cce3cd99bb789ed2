"""ckpt agent: capture, store and bit-exactly restore the six layers of a training run.

from agent import Checkpointer, ResumableSampler, PerSampleRNG

The public names load lazily, so that the torch-free parts (``agent.storage``,
``agent.errors``) can serve the control plane without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.checkpointer import Checkpointer, PendingSave, ResumeResult, SaveResult
    from agent.config import InFlight
    from agent.counters import Counters
    from agent.data import PerSampleRNG, ResumableSampler
    from agent.errors import (
        BundleExistsError,
        BundleFormatError,
        CkptError,
        ControlPlaneError,
        CorruptBundleError,
        FencedError,
        IncompatibleBundleError,
        StoreError,
        UnrepresentableStateError,
    )
    from service import __version__
    from service.contract import Layer

_EXPORTS = {
    "Checkpointer": "agent.checkpointer",
    "ResumeResult": "agent.checkpointer",
    "SaveResult": "agent.checkpointer",
    "PendingSave": "agent.checkpointer",
    "InFlight": "agent.config",
    "Counters": "agent.counters",
    "PerSampleRNG": "agent.data",
    "ResumableSampler": "agent.data",
    "BundleExistsError": "agent.errors",
    "BundleFormatError": "agent.errors",
    "CkptError": "agent.errors",
    "ControlPlaneError": "agent.errors",
    "CorruptBundleError": "agent.errors",
    "FencedError": "agent.errors",
    "IncompatibleBundleError": "agent.errors",
    "StoreError": "agent.errors",
    "UnrepresentableStateError": "agent.errors",
    "__version__": "service",
    "Layer": "service.contract",
}

__all__ = [
    "BundleExistsError",
    "BundleFormatError",
    "Checkpointer",
    "CkptError",
    "ControlPlaneError",
    "CorruptBundleError",
    "Counters",
    "FencedError",
    "InFlight",
    "IncompatibleBundleError",
    "Layer",
    "PendingSave",
    "PerSampleRNG",
    "ResumableSampler",
    "ResumeResult",
    "SaveResult",
    "StoreError",
    "UnrepresentableStateError",
    "__version__",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agent' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
