"""Framework checkpoints as ckpt's layers: a Hugging Face Trainer ``checkpoint-N/`` folder
and a Lightning ``.ckpt`` file, named as ``ckpt.integrations`` names their objects.

Neither framework saves the data position ckpt's integrations resume: the Trainer works it
out from ``global_step`` and skips batches, Lightning restarts the epoch's loader. So the
data layer is missing from both (and the rng layer from Lightning, which saves none); the
integrations then do on resume what the framework does on its own (docs/interop.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from agent.interop import found
from agent.interop.found import Found
from agent.interop.framework_keys import LIGHTNING_FIT_LOOP, TRAINER_STATE_FIELDS
from agent.interop.loading import expect_dict, load_json, load_safetensors, load_torch
from ckpt.core.contract import Layer
from ckpt.core.errors import ImportSourceError

_HF_NO_DATA = (
    "the Trainer saves no data position (it skips global_step's batches on resume, as ckpt's "
    "integration does without one)"
)


def read_hf(folder: Path, *, unsafe: bool) -> Found:
    """A Trainer ``checkpoint-N/`` folder, as ``ckpt.integrations.huggingface`` resumes it:
    model, optimizer and scheduler named "0", the Trainer's progress as the "trainer" extra.

    Raises:
        ImportSourceError: a file is damaged, or the folder is no Trainer checkpoint.
    """
    state_path = folder / "trainer_state.json"
    if not state_path.is_file():
        raise ImportSourceError(f"{folder}: no trainer_state.json: not a Trainer checkpoint")
    trainer_state = load_json(state_path)
    step = trainer_state.get("global_step")
    if type(step) is not int or step < 0:
        raise ImportSourceError(f"{state_path}: global_step must be a whole number, not {step!r}")
    result = Found(format="hf", path=folder, step=step)
    model = _hf_model(folder, unsafe=unsafe)
    result.fill(
        Layer.WEIGHTS,
        found.weights({"0": model}, extras={"trainer": _hf_progress(trainer_state)}),
        why_not="",
    )
    optimizer = _optional(folder / "optimizer.pt", unsafe=unsafe)
    scaler = _optional(folder / "scaler.pt", unsafe=unsafe)
    result.fill(
        Layer.OPTIMIZER,
        None if optimizer is None else found.optimizer({"0": optimizer}, scaler=scaler),
        why_not="no optimizer.pt",
    )
    scheduler = _optional(folder / "scheduler.pt", unsafe=unsafe)
    result.fill(
        Layer.SCHEDULER,
        None if scheduler is None else {"0": scheduler},
        why_not="no scheduler.pt",
    )
    result.fill(Layer.RNG, _hf_rng(folder, unsafe=unsafe), why_not="no rng_state.pth")
    result.fill(Layer.DATA, None, why_not=_HF_NO_DATA)
    epoch = float(trainer_state.get("epoch") or 0.0)
    result.fill(Layer.COUNTERS, found.counters(step=step, epoch=math.floor(epoch)), why_not="")
    return result


def _hf_model(folder: Path, *, unsafe: bool) -> dict[str, torch.Tensor]:
    """The model's tensors: ``model.safetensors`` (or its shards), else ``pytorch_model.bin``."""
    single = folder / "model.safetensors"
    if single.is_file():
        return load_safetensors(single)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = expect_dict(load_json(index).get("weight_map"), path=index, what="weight_map")
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_safetensors(folder / str(shard)))
        return tensors
    pickled = folder / "pytorch_model.bin"
    if pickled.is_file():
        return expect_dict(load_torch(pickled, unsafe=unsafe), path=pickled, what="a state dict")
    raise ImportSourceError(
        f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def _hf_progress(trainer_state: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's progress as its own resume sets it: the saved state, and the loss
    accumulators started again (``tr_loss`` 0, the last log at ``global_step``)."""
    return {
        "state": {name: trainer_state.get(name) for name in TRAINER_STATE_FIELDS},
        "tr_loss": torch.tensor(0.0),
        "total_loss": 0.0,
        "last_logged_step": trainer_state["global_step"],
        "flos": 0.0,
    }


def _hf_rng(folder: Path, *, unsafe: bool) -> dict[str, Any] | None:
    """The rng layer of a one-process run (``rng_state.pth``); a run of many processes
    saved one file per process, which ckpt's integration (one process) cannot resume."""
    path = folder / "rng_state.pth"
    if not path.is_file():
        return None
    saved = expect_dict(load_torch(path, unsafe=unsafe), path=path, what="an RNG state")
    return found.rng(saved, path=path)


def _optional(path: Path, *, unsafe: bool) -> Any:
    return load_torch(path, unsafe=unsafe) if path.is_file() else None


def read_lightning(path: Path, *, unsafe: bool) -> Found:
    """A Lightning ``.ckpt``, as ``ckpt.integrations.lightning`` resumes it: the module named
    "model", optimizers and schedulers by position, the fit loop's progress in the counters.

    Raises:
        ImportSourceError: the file is damaged, unsafe to unpickle, or no Lightning checkpoint.
    """
    checkpoint = expect_dict(load_torch(path, unsafe=unsafe), path=path, what="a checkpoint")
    missing = {"state_dict", "global_step", "epoch", "loops"} - checkpoint.keys()
    if missing:
        raise ImportSourceError(
            f"{path}: not a Lightning checkpoint (no {', '.join(sorted(missing))})"
        )
    step = checkpoint["global_step"]
    if type(step) is not int or step < 0:
        raise ImportSourceError(f"{path}: global_step must be a whole number, not {step!r}")
    result = Found(format="lightning", path=path, step=step)
    result.fill(Layer.WEIGHTS, found.weights({"model": checkpoint["state_dict"]}), why_not="")
    optimizers = checkpoint.get("optimizer_states")
    result.fill(
        Layer.OPTIMIZER,
        None if optimizers is None else found.optimizer(_by_position(optimizers)),
        why_not="the checkpoint holds no optimizer_states (saved with weights_only)",
    )
    schedulers = checkpoint.get("lr_schedulers")
    result.fill(
        Layer.SCHEDULER,
        None if schedulers is None else _by_position(schedulers),
        why_not="the checkpoint holds no lr_schedulers (saved with weights_only)",
    )
    result.fill(Layer.RNG, None, why_not="Lightning saves no RNG state")
    result.fill(
        Layer.DATA,
        None,
        why_not="Lightning saves no data position (its own resume restarts the epoch's loader)",
    )
    result.fill(Layer.COUNTERS, _lightning_counters(checkpoint, path=path), why_not="")
    return result


def _by_position(states: list[Any]) -> dict[str, Any]:
    """Optimizers or schedulers named as the integration names a list of them."""
    return {str(i): state for i, state in enumerate(states)}


def _lightning_counters(checkpoint: dict[str, Any], *, path: Path) -> dict[str, Any]:
    """Where the fit loop stands, as ckpt's Lightning integration counts it."""
    loops = expect_dict(checkpoint["loops"], path=path, what="loops")
    fit_loop = expect_dict(loops.get("fit_loop"), path=path, what="loops.fit_loop")
    fit_loop = {**fit_loop, "state_dict": dict(fit_loop.get("state_dict") or {})}
    fit_loop["state_dict"].pop("combined_loader", None)  # the data layer's, as ckpt saves it
    try:
        batch = fit_loop["epoch_loop.batch_progress"]["current"]["ready"]
    except (KeyError, TypeError) as err:
        raise ImportSourceError(f"{path}: the fit loop's batch progress is missing") from err
    return found.counters(
        step=checkpoint["global_step"],
        epoch=int(checkpoint["epoch"]),
        batch=int(batch),
        **{LIGHTNING_FIT_LOOP: fit_loop},
    )
