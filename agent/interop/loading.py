"""Reading other tools' files without unpickling untrusted input.

``torch.load(weights_only=True)`` reads tensors, containers and numbers; NumPy arrays (the
RNG state the Hugging Face Trainer saves) are allowed too, through the NumPy types
torch's own safe unpickler knows. Anything else needs the user's ``unsafe`` opt-in. Every
failure is an ``ImportSourceError`` that names the file.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckpt.core.errors import ImportSourceError

# What NumPy's RNG state pickles to: arrays of fixed-width numbers, nothing callable.
_NUMPY_SAFE: list[Any] = [
    np.ndarray,
    np.dtype,
    np._core.multiarray._reconstruct,  # type: ignore[attr-defined]
    *(type(np.dtype(code)) for code in ("uint32", "int64", "float64", "uint64")),
]


def load_torch(path: Path, *, unsafe: bool) -> Any:
    """What ``torch.save`` wrote to ``path``, on the CPU.

    Raises:
        ImportSourceError: the file is missing or damaged, or (without ``unsafe``) holds
            objects beyond tensors, containers, numbers and NumPy arrays.
    """
    try:
        with torch.serialization.safe_globals(_NUMPY_SAFE):
            return torch.load(path, map_location="cpu", weights_only=not unsafe, mmap=False)
    except pickle.UnpicklingError as err:
        if unsafe:
            raise _damaged(path, err) from err
        raise ImportSourceError(
            f"{path}: holds Python objects that only an unsafe unpickling loads "
            f"({_unsafe_names(path)}); unpickling runs code the file chooses. If you trust "
            "the file, pass --unsafe-unpickle (unsafe_unpickle=True)"
        ) from err
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as err:
        raise _damaged(path, err) from err


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (no pickle involved).

    Raises:
        ImportSourceError: the file is missing or damaged.
        ImportError: the ``safetensors`` package is not installed (the ``hf`` extra has it).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise _damaged(path, err) from err


def load_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``.

    Raises:
        ImportSourceError: the file is missing, damaged or not an object.
    """
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise _damaged(path, err) from err
    if not isinstance(value, dict):
        raise ImportSourceError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def expect_dict(value: object, *, path: Path, what: str) -> dict[Any, Any]:
    """``value`` if it is a dict, else an error naming the file and what it should hold."""
    if not isinstance(value, dict):
        raise ImportSourceError(f"{path}: expected {what} (a dict), found {type(value).__name__}")
    return value


def _damaged(path: Path, err: BaseException) -> ImportSourceError:
    return ImportSourceError(f"{path}: cannot be read, damaged or not what its name says ({err})")


def _unsafe_names(path: Path) -> str:
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # a file too damaged to list: the load's own error is raised
        return "objects it names"
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
