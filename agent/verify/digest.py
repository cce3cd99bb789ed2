"""A cheap digest of the parameters after an optimizer step: a fixed sample of their elements.

Chosen once, at startup, from the names and sizes alone (a seeded generator of its own: the
run's random streams are never touched), so every attempt samples the same elements. A
divergence of the data, a random stream, the optimizer state or the weights reaches every
trained parameter within one optimizer step, so a few hundred elements of a few dozen
parameters see it; a full hash of the model per step would cost a pass over every byte
(bench/fingerprint.py measures both).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping

import torch
from torch import nn

from agent.verify.compare import PARAMS

ELEMENTS = 512  # sampled in all
MAX_TENSORS = 32  # parameters sampled, evenly spaced among the trained ones


class ParamSample:
    """Gathers the same elements of the same parameters at every step."""

    def __init__(self, models: Mapping[str, nn.Module]) -> None:
        named = sorted(
            (f"{model}/{name}", param)
            for model, module in models.items()
            for name, param in module.named_parameters()
            if param.requires_grad and param.is_floating_point() and param.numel()
        )
        if len(named) > MAX_TENSORS:
            stride = len(named) / MAX_TENSORS
            named = [named[int(index * stride)] for index in range(MAX_TENSORS)]
        each = max(1, ELEMENTS // max(1, len(named)))
        self._picks = [
            (param, _indices(name, _local(param).numel(), each)) for name, param in named
        ]

    def take(self) -> torch.Tensor | None:
        """The sampled elements now, on the parameters' device (one ``take`` per parameter
        and one ``cat``): reading them back and converting them is left to ``digest``."""
        if not self._picks:
            return None
        with torch.no_grad():
            pieces = []
            for number, (param, picked) in enumerate(self._picks):
                local, index = _local(param), picked
                if index.device != local.device:  # the model moved: once
                    index = index.to(local.device)
                    self._picks[number] = (param, index)
                pieces.append(torch.take(local, index))
            return torch.cat(pieces)  # a new tensor: the next step does not change it


def digest(sample: torch.Tensor) -> dict[str, str]:
    """A sample's parts of a fingerprint: its bytes' BLAKE2b (bit-exact) and its L2 norm as
    ``float.hex`` (for the tolerance mode)."""
    values = sample.detach().to("cpu", torch.float64).contiguous()  # exact for every float
    hashed = hashlib.blake2b(values.numpy().tobytes(), digest_size=16).hexdigest()
    return {PARAMS: hashed, "params_norm": float(values.norm()).hex()}


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (``DTensor``) parameter; the tensor itself otherwise."""
    to_local = getattr(param, "to_local", None)
    tensor: torch.Tensor = to_local() if callable(to_local) else param
    return tensor.detach()


def _indices(name: str, numel: int, count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if numel <= count:
        return torch.arange(numel)
    return torch.randint(numel, (count,), generator=generator)
