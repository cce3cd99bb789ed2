"""Capture and restore of each of the six layers, given the training objects.

Each ``capture_*`` returns a plain state object (dicts, lists, tensors, numbers) that the
format turns into a payload; each ``restore_*`` puts such an object back. Capture returns
live references: the caller must not let training mutate them before they are written.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from agent.ranks.buckets import bucket_layout, lay_out_buckets, warn_unsaved_layout
from agent.state.objects import Generator, TrainingObjects
from agent.state.sharded import Saved, is_sharded, place, place_all
from ckpt.core.errors import IncompatibleBundleError

State = dict[str, Any]


# -- weights ----------------------------------------------------------------------------


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in the order ``Optimizer.state_dict`` numbers them."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def _masters(objects: TrainingObjects) -> dict[str, dict[int, torch.Tensor]]:
    """Optimizer parameters that belong to no model: fp32 master copies kept by training.

    Only optimizers that have any are listed, so a warm start need not bring the others.
    """
    in_models = {id(p) for model in objects.models.values() for p in model.parameters()}
    masters = {
        name: {i: p for i, p in enumerate(_optimizer_params(opt)) if id(p) not in in_models}
        for name, opt in objects.optimizers.items()
    }
    return {name: params for name, params in masters.items() if params}


def capture_weights(objects: TrainingObjects) -> State:
    masters = _masters(objects)
    models = {name: model.state_dict() for name, model in objects.models.items()}
    state: State = {
        "models": models,
        # Modules read their format version from this attribute of the state dict on load.
        "module_versions": {name: getattr(sd, "_metadata", None) for name, sd in models.items()},
        "masters": {
            name: {i: p.detach() for i, p in params.items()} for name, params in masters.items()
        },
        "extras": {name: extra.state_dict() for name, extra in objects.extras.items()},
        "grads": None,
        # DDP's rebuilt gradient buckets: the order the next step's gradients are summed in.
        "buckets": {name: bucket_layout(model) for name, model in objects.models.items()},
    }
    if objects.counters.micro_step != 0:  # mid-accumulation: the partial sums are state too
        state["grads"] = {
            "models": {
                name: {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
                for name, model in objects.models.items()
            },
            "masters": {
                name: {i: p.grad for i, p in params.items() if p.grad is not None}
                for name, params in masters.items()
            },
        }
    return state


def restore_weights(objects: TrainingObjects, state: State) -> None:
    _same_names("models", objects.models, state["models"])
    layouts = state.get("buckets")  # absent from the bundles of older versions
    for name, model in objects.models.items():
        model_state = OrderedDict(place_all(state["models"][name], model.state_dict().__getitem__))
        model_state._metadata = state["module_versions"][name]  # type: ignore[attr-defined]
        model.load_state_dict(model_state, strict=True)
        if layouts is None:
            warn_unsaved_layout(model, name=name)
        else:
            lay_out_buckets(model, layouts[name], name=name)
    masters = _masters(objects)
    _same_names("fp32 master weights of optimizers", masters, state["masters"])
    with torch.no_grad():
        for name, params in masters.items():
            _same_names(f"master weights of optimizer {name!r}", params, state["masters"][name])
            for i, param in params.items():
                saved = state["masters"][name][i]
                param.copy_(place(saved, param) if is_sharded(saved) else saved)
    _same_names("extras", objects.extras, state["extras"])
    for name, extra in objects.extras.items():
        extra.load_state_dict(state["extras"][name])
    if state["grads"] is not None:
        _restore_grads(objects, masters, state["grads"])


def _restore_grads(
    objects: TrainingObjects, masters: Mapping[str, Mapping[int, torch.Tensor]], grads: State
) -> None:
    for name, model in objects.models.items():
        params = dict(model.named_parameters())
        for param_name, grad in grads["models"][name].items():
            _set_grad(params[param_name], grad)
    for name, params_by_index in masters.items():
        for i, grad in grads["masters"][name].items():
            _set_grad(params_by_index[i], grad)


def _set_grad(param: torch.Tensor, grad: torch.Tensor | Saved) -> None:
    if is_sharded(grad):
        grad = place(grad, param)  # type: ignore[arg-type]
    assert isinstance(grad, torch.Tensor)
    if param.grad is None:
        param.grad = grad.to(device=param.device, dtype=param.dtype, copy=True)
    else:
        param.grad.copy_(grad)


# -- optimizer, scheduler ----------------------------------------------------------------


def capture_optimizer(objects: TrainingObjects) -> State:
    return {
        "optimizers": {name: opt.state_dict() for name, opt in objects.optimizers.items()},
        "scaler": objects.scaler.state_dict() if objects.scaler is not None else None,
    }


def restore_optimizer(objects: TrainingObjects, state: State) -> None:
    _same_names("optimizers", objects.optimizers, state["optimizers"])
    for name, optimizer in objects.optimizers.items():
        optimizer.load_state_dict(_placed_optimizer_state(optimizer, state["optimizers"][name]))
    if (objects.scaler is None) != (state["scaler"] is None):
        raise IncompatibleBundleError(
            "the bundle was saved with"
            + ("out" if state["scaler"] is None else "")
            + " a GradScaler; pass the same scaler= to resume it"
        )
    if objects.scaler is not None:
        objects.scaler.load_state_dict(state["scaler"])


def _placed_optimizer_state(optimizer: torch.optim.Optimizer, saved: State) -> State:
    """The saved state with sharded moments laid out like the parameters they belong to."""
    params = _optimizer_params(optimizer)

    def like(index: int) -> Callable[[object], torch.Tensor]:
        return lambda _key: params[index]

    per_param = {index: place_all(values, like(index)) for index, values in saved["state"].items()}
    return {**saved, "state": per_param}


def capture_scheduler(objects: TrainingObjects) -> State:
    return {name: scheduler.state_dict() for name, scheduler in objects.schedulers.items()}


def restore_scheduler(objects: TrainingObjects, state: State) -> None:
    _same_names("schedulers", objects.schedulers, state)
    for name, scheduler in objects.schedulers.items():
        scheduler.load_state_dict(state[name])


# -- rng ---------------------------------------------------------------------------------


def capture_rng(objects: TrainingObjects) -> State:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "generators": {name: _generator_state(g) for name, g in objects.generators.items()},
    }


def _generator_kind(generator: Generator) -> str:
    if isinstance(generator, torch.Generator):
        return "torch"
    return (
        "numpy.RandomState" if isinstance(generator, np.random.RandomState) else "numpy.Generator"
    )


def _generator_state(generator: Generator) -> State:
    if isinstance(generator, np.random.Generator):
        return {"numpy.Generator": generator.bit_generator.state}
    if isinstance(generator, np.random.RandomState):
        return {"numpy.RandomState": generator.get_state(legacy=False)}
    return {"torch": generator.get_state()}


def _set_generator_state(name: str, generator: Generator, saved: State) -> None:
    kind = _generator_kind(generator)
    if set(saved) != {kind}:
        raise IncompatibleBundleError(
            f"generator {name!r}: the bundle holds a {sorted(saved)} state, this is a {kind}"
        )
    if isinstance(generator, np.random.Generator):
        generator.bit_generator.state = saved[kind]
    else:
        generator.set_state(saved[kind])


def restore_rng(objects: TrainingObjects, state: State) -> None:
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(state["cuda"]) != devices:
        raise IncompatibleBundleError(
            f"the bundle holds RNG state for {len(state['cuda'])} CUDA devices; this process "
            f"sees {devices}: a bit-exact resume needs the same devices"
        )
    _same_names("registered generators", objects.generators, state["generators"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if devices:
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, generator in objects.generators.items():
        _set_generator_state(name, generator, state["generators"][name])


# -- data ---------------------------------------------------------------------------------


def capture_data(objects: TrainingObjects) -> State:
    return {"source": objects.data.state_dict() if objects.data is not None else None}


def restore_data(objects: TrainingObjects, state: State) -> None:
    if (objects.data is None) != (state["source"] is None):
        raise IncompatibleBundleError(
            "the bundle's data layer does not match data= (one is absent)"
        )
    if objects.data is not None:
        objects.data.load_state_dict(state["source"])


# -- counters ----------------------------------------------------------------------------


def capture_counters(objects: TrainingObjects) -> State:
    return objects.counters.to_state()


def restore_counters(objects: TrainingObjects, state: State) -> None:
    objects.counters.load_state(state)


def _same_names(what: str, have: Mapping[Any, Any], saved: Mapping[Any, Any]) -> None:
    if set(have) != set(saved):
        raise IncompatibleBundleError(
            f"{what}: the bundle holds {sorted(map(str, saved))}, this process has "
            f"{sorted(map(str, have))}; pass the same objects under the same names"
        )
