"""``torch.save`` dicts and DCP directories as ckpt's layers, for a ``Checkpointer`` given
one model, one optimizer and one scheduler (each named "0").

The keys read (docs/interop.md): ``model`` (a state dict, required), ``optimizer``,
``scheduler``, ``scaler`` (state dicts), ``rng`` (``python``, ``numpy``, ``torch`` or
``cpu``, ``cuda``), ``data`` (the data source's state dict), ``step`` (required),
``epoch``, ``batch``. A DCP checkpoint holds the same keys; its optimizer state may be
keyed by parameter name (``get_optimizer_state_dict``), and is renumbered.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from agent.interop import found
from agent.interop.found import Found
from agent.interop.loading import expect_dict, load_torch
from ckpt.core.contract import Layer
from ckpt.core.errors import ImportSourceError

KEYS = ("model", "optimizer", "scheduler", "scaler", "rng", "data", "step", "epoch", "batch")


def read_torch(path: Path, *, unsafe: bool) -> Found:
    """A ``torch.save`` dict with the documented keys.

    Raises:
        ImportSourceError: the file is damaged, unsafe to unpickle, or lacks ``model``/``step``.
    """
    saved = expect_dict(load_torch(path, unsafe=unsafe), path=path, what="a dict of states")
    return from_dict(saved, path=path, format_name="torch")


def read_dcp(folder: Path, *, unsafe: bool) -> Found:
    """A ``torch.distributed.checkpoint`` directory, saved at any world size, read whole in
    this process (no process group).

    DCP keeps its metadata as a pickle and reads non-tensor values with
    ``torch.load(weights_only=False)``: reading one unpickles, so ``unsafe`` must be given.

    Raises:
        ImportSourceError: ``unsafe`` not given, or the directory is damaged or no DCP.
    """
    if not (folder / ".metadata").is_file():
        raise ImportSourceError(f"{folder}: no .metadata: not a DCP checkpoint directory")
    if not unsafe:
        raise ImportSourceError(
            f"{folder}: a DCP checkpoint's .metadata is a pickle and its non-tensor values "
            "are read with torch.load(weights_only=False): reading it runs code the files "
            "choose. If you trust it, pass --unsafe-unpickle (unsafe_unpickle=True)"
        )
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        with warnings.catch_warnings():  # that it reads in one process, as meant
            warnings.filterwarnings("ignore", message="torch.distributed is unavailable")
            saved = _load_state_dict_from_keys(checkpoint_id=str(folder))
    # DCP wraps a reader's failure in its CheckpointException, a BaseException; the
    # planning before the reads raises plain errors.
    except (Exception, CheckpointException) as err:
        raise ImportSourceError(
            f"{folder}: cannot be read, damaged or incomplete ({_first_line(err)})"
        ) from err
    return from_dict(saved, path=folder, format_name="dcp")


def from_dict(saved: dict[str, Any], *, path: Path, format_name: str) -> Found:
    """The layers a dict with the documented keys fills."""
    unknown = saved.keys() - set(KEYS)
    if unknown:
        raise ImportSourceError(
            f"{path}: unknown keys {sorted(map(str, unknown))}; the keys read are "
            f"{', '.join(KEYS)} (docs/interop.md)"
        )
    step = saved.get("step")
    if type(step) is not int or step < 0 or "model" not in saved:
        raise ImportSourceError(
            f"{path}: needs 'model' (a state dict) and 'step' (a whole number, found {step!r})"
        )
    result = Found(format=format_name, path=path, step=step)  # type: ignore[arg-type]
    model = expect_dict(saved["model"], path=path, what="'model', a state dict")
    result.fill(Layer.WEIGHTS, found.weights({"0": model}), why_not="")
    optimizer = saved.get("optimizer")
    result.fill(
        Layer.OPTIMIZER,
        None
        if optimizer is None
        else found.optimizer({"0": _numbered(optimizer, path=path)}, scaler=saved.get("scaler")),
        why_not="no 'optimizer' key",
    )
    scheduler = saved.get("scheduler")
    result.fill(
        Layer.SCHEDULER,
        None if scheduler is None else {"0": scheduler},
        why_not="no 'scheduler' key",
    )
    rng = saved.get("rng")
    result.fill(
        Layer.RNG,
        None if rng is None else found.rng(expect_dict(rng, path=path, what="'rng'"), path=path),
        why_not="no 'rng' key",
    )
    data = saved.get("data")
    result.fill(Layer.DATA, None if data is None else {"source": data}, why_not="no 'data' key")
    position = {name: int(saved.get(name) or 0) for name in ("epoch", "batch")}
    result.fill(Layer.COUNTERS, found.counters(step=step, **position), why_not="")
    return result


def _numbered(optimizer: Any, *, path: Path) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter index, as ``Optimizer.load_state_dict``
    reads it; one keyed by parameter name (DCP's ``get_optimizer_state_dict``) is
    renumbered in the order its param groups list the names."""
    optimizer = expect_dict(optimizer, path=path, what="'optimizer', a state dict")
    groups = optimizer.get("param_groups")
    if not isinstance(groups, list) or "state" not in optimizer:
        raise ImportSourceError(f"{path}: 'optimizer' lacks 'state' or 'param_groups'")
    names = [param for group in groups for param in group["params"]]
    if all(isinstance(name, int) for name in names):
        return dict(optimizer)
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in optimizer["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in groups
        ],
    }


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[-1] if text else type(err).__name__
