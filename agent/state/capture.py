"""The six layers in and out of the training objects: captured for a save (the rng layer
first), put back in the fixed order for a restore.

``layers`` knows each layer; this module runs them in order. A save hands the captured
tensors to the staging buffers (``save.staging``), which is the whole stall.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agent.format import skeleton
from agent.format.skeleton import JSON
from agent.state import layers
from agent.state.objects import TrainingObjects
from ckpt.core.contract import RESTORE_ORDER, Layer
from ckpt.core.errors import CkptError, IncompatibleBundleError

CAPTURE: dict[Layer, Callable[[TrainingObjects], layers.State]] = {
    Layer.WEIGHTS: layers.capture_weights,
    Layer.OPTIMIZER: layers.capture_optimizer,
    Layer.SCHEDULER: layers.capture_scheduler,
    Layer.RNG: layers.capture_rng,
    Layer.DATA: layers.capture_data,
    Layer.COUNTERS: layers.capture_counters,
}
RESTORE: dict[Layer, Callable[[TrainingObjects, layers.State], None]] = {
    Layer.WEIGHTS: layers.restore_weights,
    Layer.OPTIMIZER: layers.restore_optimizer,
    Layer.SCHEDULER: layers.restore_scheduler,
    Layer.RNG: layers.restore_rng,
    Layer.DATA: layers.restore_data,
    Layer.COUNTERS: layers.restore_counters,
}
# Capturing other objects' state can consume randomness, so the rng layer goes first.
CAPTURE_ORDER = (Layer.RNG, *(layer for layer in RESTORE_ORDER if layer is not Layer.RNG))


@dataclass
class LayerState:
    """One layer of one rank, split for storage: a JSON skeleton and its CPU tensors."""

    skeleton: JSON
    tensors: dict[str, torch.Tensor]


def capture(objects: TrainingObjects) -> dict[Layer, tuple[JSON, dict[str, torch.Tensor]]]:
    """The six layers out of the objects, the rng layer first: each a JSON skeleton and its
    tensors by name, live (``save.staging`` copies them before training goes on)."""
    return {
        layer: skeleton.encode(CAPTURE[layer](objects), root=(str(layer),))
        for layer in CAPTURE_ORDER
    }


def stable_memory(objects: TrainingObjects) -> set[int]:
    """Memory that changes only through ops that bump the version counter: the frozen
    parameters of the models. Kernels that write tensors without bumping it include fused
    optimizers (the parameters and their state) and batch norm (its running statistics),
    so everything else is copied and hashed at every save."""
    return {
        _local(param).untyped_storage().data_ptr()
        for model in objects.models.values()
        for param in model.parameters()
        if not param.requires_grad
    }


def optimizer_memory(objects: TrainingObjects) -> set[int]:
    """Memory that only an optimizer's step writes: its parameters and their state."""
    memory: set[int] = set()
    for optimizer in objects.optimizers.values():
        for group in optimizer.param_groups:
            memory.update(_local(p).untyped_storage().data_ptr() for p in group["params"])
        for state in optimizer.state.values():
            memory.update(
                _local(value).untyped_storage().data_ptr()
                for value in state.values()
                if isinstance(value, torch.Tensor)
            )
    return memory


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def live_tensors(objects: TrainingObjects, layer: Layer) -> dict[str, torch.Tensor]:
    """The tensors a layer's blobs are read straight into: the weights and optimizer state
    that exist already (restoring them then copies nothing)."""
    if layer not in (Layer.WEIGHTS, Layer.OPTIMIZER):
        return {}
    _, tensors = skeleton.encode(CAPTURE[layer](objects), root=(str(layer),))
    return tensors


def put_back(objects: TrainingObjects, states: dict[Layer, layers.State], *, bundle: str) -> None:
    """Restore ``states`` into the objects in the fixed order, emptying ``states`` as it
    goes (a restored layer's fresh tensors are freed before the next is put back).

    Raises:
        IncompatibleBundleError: a layer does not fit the objects; the layers before it
            are restored already.
    """
    if Layer.WEIGHTS in states and Layer.COUNTERS not in states:
        states[Layer.WEIGHTS]["grads"] = None  # partial sums belong to the old micro step
    for layer in RESTORE_ORDER:
        if layer in states:
            _put_back_layer(objects, layer, states.pop(layer), bundle=bundle)


def _put_back_layer(
    objects: TrainingObjects, layer: Layer, state: layers.State, *, bundle: str
) -> None:
    try:
        RESTORE[layer](objects, state)
    except CkptError:
        raise
    except (ValueError, RuntimeError, KeyError, TypeError, IndexError) as err:
        raise IncompatibleBundleError(
            f"bundle {bundle}: its {layer} layer does not fit these objects ({err}); "
            f"the layers before it are already restored, so rebuild the objects "
            "before training"
        ) from err
