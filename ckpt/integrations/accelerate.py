"""Bit-exact checkpoints for a bare ``accelerate.Accelerator`` loop (``pip install
'ckpt-spot[hf]'``), in place of ``save_state`` / ``load_state``:

    from ckpt.integrations.accelerate import checkpointer

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    with checkpointer(accelerator, run="my-run", every_steps=50) as ckpt:
        ckpt.resume()  # the run's latest bundle, or a fresh start
        for batch in ckpt.batches(): ...; ckpt.counters.step += 1; ckpt.maybe_save()

``checkpointer`` registers what ``save_state`` would save, taken from the accelerator: the
prepared models, the optimizers and schedulers inside Accelerate's wrappers, the prepared
data loader (its ``ResumableSampler``), the gradient scaler, the objects passed to
``register_for_checkpointing`` and the accelerator's own step counter (which decides when
gradient accumulation syncs). The random streams are the checkpointer's own layer.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from agent.checkpointer import Checkpointer

__all__ = ["checkpointer"]

_TAKEN = {"models", "optimizers", "schedulers", "scaler", "extras"}


class AcceleratorStep:
    """The accelerator's micro-batch counter (``Accelerator.step``) as a stateful object:
    ``accumulate()`` syncs gradients when it reaches a multiple of the accumulation steps."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.accelerator.step = state["step"]


def checkpointer(
    accelerator: Accelerator, *, run: str | None = None, data: object | None = None, **config: Any
) -> Checkpointer:
    """A ``Checkpointer`` of everything ``accelerator.prepare`` and
    ``register_for_checkpointing`` gave the accelerator; call it after ``prepare``.

    Args:
        accelerator: the loop's accelerator.
        run: the run's name (``CKPT_RUN``); every restart of the job uses the same one.
        data: what the loop iterates through ``Checkpointer.batches``; default: the one
            data loader the accelerator prepared (none: no data layer).
        **config: passed on to ``Checkpointer`` (``store``, ``server``, ``every_steps``...).

    Raises:
        ValueError: nothing prepared, several data loaders without ``data=``, or a
            training object passed here (they come from the accelerator).
    """
    taken = _TAKEN & config.keys()
    if taken:
        raise ValueError(
            f"checkpointer() takes the training objects from the accelerator; leave out "
            f"{', '.join(sorted(taken))} (register more with accelerator.register_for_checkpointing)"
        )
    if not accelerator._models:
        raise ValueError("the accelerator has no model: call accelerator.prepare(model, ...) first")
    loaders = accelerator._dataloaders
    if data is None and len(loaders) > 1:
        raise ValueError(
            f"the accelerator prepared {len(loaders)} data loaders: pass the one the loop "
            "trains on as data="
        )
    extras: dict[str, Any] = {"accelerator": AcceleratorStep(accelerator)}
    extras |= {f"custom_{i}": obj for i, obj in enumerate(accelerator._custom_objects)}
    return Checkpointer(
        run=run,
        models=list(accelerator._models),
        optimizers=[getattr(o, "optimizer", o) for o in accelerator._optimizers],
        schedulers=[getattr(s, "scheduler", s) for s in accelerator._schedulers],
        data=data if data is not None else (loaders[0] if loaders else None),
        scaler=accelerator.scaler,
        extras=extras,
        **config,
    )
