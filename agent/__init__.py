"""ckpt agent: capture, store and bit-exactly restore the six layers of a training run.

from agent import Checkpointer, ResumableSampler, PerSampleRNG
"""

from agent.checkpointer import Checkpointer, ResumeResult, SaveResult
from agent.counters import Counters
from agent.data import PerSampleRNG, ResumableSampler
from agent.errors import (
    BundleExistsError,
    BundleFormatError,
    CkptError,
    CorruptBundleError,
    IncompatibleBundleError,
    StoreError,
    UnrepresentableStateError,
)
from service import __version__
from service.contract import Layer

__all__ = [
    "BundleExistsError",
    "BundleFormatError",
    "Checkpointer",
    "CkptError",
    "CorruptBundleError",
    "Counters",
    "IncompatibleBundleError",
    "Layer",
    "PerSampleRNG",
    "ResumableSampler",
    "ResumeResult",
    "SaveResult",
    "StoreError",
    "UnrepresentableStateError",
    "__version__",
]
