"""ckpt: bit-exact checkpoints for PyTorch training on preemptible GPUs.

    from ckpt import Checkpointer, PerSampleRNG, ResumableSampler

The names below load on first use, so ``import ckpt`` costs nothing and loads no torch:
the control plane (``ckpt.service``) and the ``ckpt`` command (``ckpt.cli``) share this
package with the training agent (``ckpt.agent``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpt.agent.checkpointer import Checkpointer
    from ckpt.agent.config import InFlight
    from ckpt.agent.counters import Counters
    from ckpt.agent.persist import PendingSave, SaveResult
    from ckpt.agent.restore import ResumeResult
    from ckpt.agent.sampling import PerSampleRNG, ResumableSampler
    from ckpt.core.contract import Layer
    from ckpt.core.errors import (
        BundleExistsError,
        BundleFormatError,
        CkptError,
        ControlPlaneError,
        CorruptBundleError,
        FencedError,
        IncompatibleBundleError,
        StateChangedError,
        StoreError,
        UnrepresentableStateError,
    )
    from ckpt.core.version import __version__

_EXPORTS = {
    "Checkpointer": "ckpt.agent.checkpointer",
    "ResumeResult": "ckpt.agent.restore",
    "SaveResult": "ckpt.agent.persist",
    "PendingSave": "ckpt.agent.persist",
    "InFlight": "ckpt.agent.config",
    "Counters": "ckpt.agent.counters",
    "PerSampleRNG": "ckpt.agent.sampling",
    "ResumableSampler": "ckpt.agent.sampling",
    "Layer": "ckpt.core.contract",
    "BundleExistsError": "ckpt.core.errors",
    "BundleFormatError": "ckpt.core.errors",
    "CkptError": "ckpt.core.errors",
    "ControlPlaneError": "ckpt.core.errors",
    "CorruptBundleError": "ckpt.core.errors",
    "FencedError": "ckpt.core.errors",
    "IncompatibleBundleError": "ckpt.core.errors",
    "StateChangedError": "ckpt.core.errors",
    "StoreError": "ckpt.core.errors",
    "UnrepresentableStateError": "ckpt.core.errors",
    "__version__": "ckpt.core.version",
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
    "StateChangedError",
    "StoreError",
    "UnrepresentableStateError",
    "__version__",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
