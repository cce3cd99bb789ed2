"""ckpt: bit-exact checkpoints for PyTorch training on preemptible GPUs.

    from ckpt import Checkpointer, PerSampleRNG, ResumableSampler

The names below load on first use from the in-job agent (the package ``agent``), so
``import ckpt`` costs nothing and loads no torch. Beside them, this package holds what the
agent and the control plane (``service``) share (``ckpt.core``), the ``ckpt`` command
(``ckpt.cli``) and the framework integrations (``ckpt.integrations``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.checkpointer import Checkpointer
    from agent.config import InFlight
    from agent.counters import Counters
    from agent.data.sampling import PerSampleRNG, ResumableSampler
    from agent.interop.importing import ImportResult, import_checkpoint
    from agent.restore.resume import ResumeResult
    from agent.save.result import PendingSave, SaveResult
    from agent.verify.compare import Verdict, Verification
    from ckpt.core.contract import Layer
    from ckpt.core.errors import (
        BundleExistsError,
        BundleFormatError,
        CkptError,
        ControlPlaneError,
        CorruptBundleError,
        FencedError,
        ImportSourceError,
        IncompatibleBundleError,
        ResumeDivergedError,
        SaveLostError,
        StateChangedError,
        StoreAccessError,
        StoreError,
        UnrepresentableStateError,
    )
    from ckpt.core.version import __version__

_EXPORTS = {
    "Checkpointer": "agent.checkpointer",
    "ResumeResult": "agent.restore.resume",
    "SaveResult": "agent.save.result",
    "PendingSave": "agent.save.result",
    "InFlight": "agent.config",
    "Counters": "agent.counters",
    "PerSampleRNG": "agent.data.sampling",
    "ResumableSampler": "agent.data.sampling",
    "ImportResult": "agent.interop.importing",
    "import_checkpoint": "agent.interop.importing",
    "Verdict": "agent.verify.compare",
    "Verification": "agent.verify.compare",
    "Layer": "ckpt.core.contract",
    "BundleExistsError": "ckpt.core.errors",
    "BundleFormatError": "ckpt.core.errors",
    "CkptError": "ckpt.core.errors",
    "ControlPlaneError": "ckpt.core.errors",
    "CorruptBundleError": "ckpt.core.errors",
    "FencedError": "ckpt.core.errors",
    "ResumeDivergedError": "ckpt.core.errors",
    "SaveLostError": "ckpt.core.errors",
    "ImportSourceError": "ckpt.core.errors",
    "IncompatibleBundleError": "ckpt.core.errors",
    "StateChangedError": "ckpt.core.errors",
    "StoreAccessError": "ckpt.core.errors",
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
    "ImportResult",
    "ImportSourceError",
    "InFlight",
    "IncompatibleBundleError",
    "Layer",
    "PendingSave",
    "PerSampleRNG",
    "ResumableSampler",
    "ResumeDivergedError",
    "ResumeResult",
    "SaveLostError",
    "SaveResult",
    "StateChangedError",
    "StoreAccessError",
    "StoreError",
    "UnrepresentableStateError",
    "Verdict",
    "Verification",
    "__version__",
    "import_checkpoint",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    value = getattr(_load(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def _load(module: str) -> ModuleType:
    """``module``, or an ImportError naming the file that hides ckpt's own package of that
    name (a training script's ``agent.py`` beside it, say)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.partition(".")[0]
        where = getattr(sys.modules.get(package), "__file__", None)
        ours = Path(__file__).resolve().parents[1]
        if where is None or Path(where).resolve().parent in (ours, ours / package):
            raise
        raise ImportError(
            f"ckpt cannot load {module}: {where} hides ckpt's package {package!r}; "
            "rename that file or folder, or run from another directory"
        ) from err


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
