"""DDP's gradient buckets across a resume: their layout read at a save, laid out again at
a restore, so that the resumed run sums its gradients in the order of the run it continues.

DDP reduces each bucket (its parameters' gradients, flattened) with one allreduce. On more
than two ranks the ring (gloo's, NCCL's) adds an element's values in an order set by its
offset in the bucket, so a different layout gives sums that differ in the last bits. A
fresh DDP lays its buckets out by parameter order and, after its first iteration, rebuilds
them once in the order the gradients became ready. A resumed run's DDP is fresh: without
the saved layout its first iteration would use the initial one, where the run it continues
had long rebuilt them.

torch has no public API for either half, so this module is the one place that reads and
writes DDP's internals (``_get_ddp_logging_data``, ``_ddp_init_helper``, the reducer). Every
use fails soft: a torch that lacks them, or a DDP configured so that its reducer cannot be
rebuilt faithfully, is left as it is, with a warning that the first iteration after the
resume may not be bit-exact.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn

log = logging.getLogger("ckpt")

Layout = list[list[int]]  # the reducer's parameter indices, bucket by bucket, in order

_DDP = nn.parallel.DistributedDataParallel
_dist: Any = dist  # its private names, which its stubs do not export
_NOT_EXACT = "the first iteration after the resume may not be bit-exact on more than 2 ranks"


def bucket_layout(model: nn.Module) -> Layout | None:
    """The layout DDP rebuilt its buckets in; None for another model, or a DDP that has
    not rebuilt them (before its second iteration, or never: ``find_unused_parameters``)."""
    if not isinstance(model, _DDP):
        return None
    ddp: Any = model
    try:
        logged = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
        if isinstance(logged, str):  # "7 6 5 4, 2 3 1 0": buckets by ", ", indices by " "
            return [[int(index) for index in bucket.split()] for bucket in logged.split(",")]
        if getattr(ddp, "_has_rebuilt_buckets", False):
            return _layout_of_buckets(ddp)  # rebuilt in an iteration not logged yet
    except (AttributeError, RuntimeError, ValueError) as err:
        log.warning("ckpt: cannot read DDP's bucket layout (%s): %s", err, _NOT_EXACT)
    return None


def _layout_of_buckets(model: Any) -> Layout:
    """The layout read off the reducer's buckets (each a zero copy of its gradients: the
    memory of one replica's gradients, for a moment, in the few saves that need it)."""
    index = {id(param): i for i, param in enumerate(model._build_params_for_reducer()[0])}
    buckets = model.reducer._get_zeros_like_grad_buckets()
    return [[index[id(param)] for param in bucket.parameters()] for bucket in buckets]


def lay_out_buckets(model: nn.Module, layout: Layout | None, *, name: str) -> None:
    """Rebuild a DDP's reducer with the saved ``layout`` before its first iteration.

    Without a saved layout (a bundle of an older ckpt, or saved before DDP rebuilt its
    buckets) nothing changes. A configuration whose reducer cannot be rebuilt faithfully
    is left as it is, with a warning naming it.
    """
    if not isinstance(model, _DDP) or layout is None:
        return
    reason = _cannot_lay_out(model, layout)
    if reason is not None:
        log.warning("ckpt: model %r: %s, so %s", name, reason, _NOT_EXACT)
        return
    try:
        _rebuild_reducer(model, layout)
    except (AttributeError, TypeError, RuntimeError) as err:
        log.warning(
            "ckpt: model %r: cannot rebuild DDP's buckets in the saved layout (%s): %s",
            name,
            err,
            _NOT_EXACT,
        )


def warn_unsaved_layout(model: nn.Module, *, name: str) -> None:
    """Warn when a DDP resumes on more than 2 ranks, where the layout changes the sums,
    from a bundle that holds no bucket layout (saved by an older ckpt)."""
    rebuilds = isinstance(model, _DDP) and (model.static_graph or not model.find_unused_parameters)
    if rebuilds and dist.get_world_size() > 2:
        log.warning(
            "ckpt: model %r: the bundle holds no layout of DDP's gradient buckets (saved by "
            "an older ckpt), so %s",
            name,
            _NOT_EXACT,
        )


def _cannot_lay_out(model: Any, layout: Layout) -> str | None:
    """Why the reducer cannot be rebuilt in ``layout``, or None."""
    if getattr(model, "mixed_precision", None) is not None:
        return "DDP runs with mixed_precision"
    if getattr(model, "_use_python_reducer", False):
        return "DDP runs its Python reducer (compiled DDP)"
    hook = model._get_ddp_logging_data().get("comm_hook")
    if hook and not model._comm_hooks and _builtin_hook(hook) is None:
        return f"DDP runs a comm hook it does not list ({hook})"
    count = len(model._build_params_for_reducer()[0])
    if sorted(index for bucket in layout for index in bucket) != list(range(count)):
        return f"the saved bucket layout does not fit its {count} parameters"
    return None


def _rebuild_reducer(model: Any, layout: Layout) -> None:
    """A new reducer in ``layout``, as DDP's own ``__setstate__`` builds one, with the comm
    hooks of the old one registered again. The old reducer's autograd hooks go with it."""
    builtin = _builtin_hook(model._get_ddp_logging_data().get("comm_hook"))
    parameters, expect_sparse_gradient = model._build_params_for_reducer()
    names = model._build_debug_param_to_name_mapping(parameters)
    with _assigned(layout, limit=model.bucket_bytes_cap):
        model._ddp_init_helper(parameters, expect_sparse_gradient, names, model.static_graph)
    if model.static_graph:
        model.reducer._set_static_graph()
        model.logger._set_static_graph()
    for hook, state in model._comm_hooks:
        model.logger._set_comm_hook_name(hook.__qualname__)
        _dist._register_comm_hook(model.reducer, state, hook)
    if builtin is not None and not model._comm_hooks:
        model._register_builtin_comm_hook(builtin)


def _builtin_hook(name: object) -> object | None:
    """The built-in comm hook DDP logs as ``name`` ("BuiltinCommHookType.FP16_COMPRESS")."""
    if not isinstance(name, str) or not name.startswith("BuiltinCommHookType."):
        return None
    members: dict[str, object] = _dist.BuiltinCommHookType.__members__
    return members.get(name.removeprefix("BuiltinCommHookType."))


@contextlib.contextmanager
def _assigned(layout: Layout, *, limit: int) -> Iterator[None]:
    """DDP's bucket assignment answering ``layout`` for as long as the block runs.

    ``_ddp_init_helper`` computes the assignment with this function and hands it to the
    reducer reversed; it runs on the caller's thread, before training goes on.
    """
    original = _dist._compute_bucket_assignment_by_size

    def saved(*_args: object, **_kwargs: object) -> tuple[Layout, list[int]]:
        return [list(bucket) for bucket in reversed(layout)], [limit] * len(layout)

    _dist._compute_bucket_assignment_by_size = saved
    try:
        yield
    finally:
        _dist._compute_bucket_assignment_by_size = original
