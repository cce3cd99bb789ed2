"""``export``: a bundle's weights, or its whole state, as files other tools read.

    from agent.interop.exporting import export

    export("./.ckpt/store", "my-run", "out/", to="transformers", config="hf-model/")

Formats (``Format``): ``safetensors`` (one file, or Hugging Face's shards and index past
``max_shard_bytes``), ``transformers`` (the same with the model's ``config.json``, loadable
by ``AutoModel*.from_pretrained``), ``dcp`` (a ``torch.distributed.checkpoint`` folder that
``dcp.load`` reads at any world size) and ``torch`` (one ``torch.save`` file).

The export streams: it lays the files out first (``export_files``), then reads each needed
blob once, checks its SHA-256 and writes its bytes in place (``export_fill``); memory holds a
few blobs, never a second copy of the state. Files appear at ``out`` only once complete.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.catalog.manifests import bundle_name, load_manifest
from agent.interop.export_files import (
    Placed,
    dcp_folder,
    safetensors_file,
    safetensors_folder,
    torch_file,
)
from agent.interop.export_fill import fill
from agent.interop.export_plan import Entry, Plan, by_name, transform
from ckpt.core.contract import RESTORE_ORDER, Layer, Manifest, missing_parts
from ckpt.core.progress import Progress
from ckpt.core.storage import ObjectStore, keys, open_store
from ckpt.core.verify import find_manifest

log = logging.getLogger("ckpt")

DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's default max_shard_size, "5GB"
# The prefixes wrappers put before a model's own names: DDP's, torch.compile's.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_REF = re.compile(r"(?P<run>[^@]+)(?:@(?P<step>\d+)(?:\.(?P<micro>\d+))?)?")


class Format(enum.StrEnum):
    SAFETENSORS = "safetensors"
    TRANSFORMERS = "transformers"
    DCP = "dcp"
    TORCH = "torch"


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the bundle, and ``tensors`` of ``bytes`` in all at ``path``."""

    bundle: str
    step: int
    path: str
    tensors: int
    bytes: int


def export(
    store: ObjectStore | str,
    ref: str,
    out: str,
    *,
    to: Format | str,
    config: str | Mapping[str, Any] | None = None,
    whole_state: bool = False,
    allow_incomplete: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    find: Callable[[str, int | None], Manifest | None] | None = None,
    quiet: bool = False,
) -> Exported:
    """Export the bundle ``ref`` names as ``to`` at ``out``.

    Args:
        store: the store (or its URL) that holds the bundle's blobs.
        ref: ``RUN`` (its newest resumable bundle), ``RUN@STEP`` (``RUN@STEP.MICRO``), or a
            bundle's name, ``runs/RUN/bundles/000000000020``.
        out: a folder to create (a file for ``torch``, and for ``safetensors`` when it ends
            in ``.safetensors``); it must not exist, or be an empty folder.
        to: the format.
        config: ``transformers`` only: the model's ``config.json``, its folder, its JSON
            text or the parsed mapping.
        whole_state: every layer (``torch``, ``safetensors``), or the model, optimizer and
            scheduler (``dcp``), not only the models' weights.
        allow_incomplete: export a bundle that lacks parts (not resumable) from what it
            holds; without it such a bundle is refused, naming what it lacks.
        max_shard_bytes: past this, a safetensors folder is cut into shards.
        find: how to find a bundle by run and step (a control plane's); default: the store.
        quiet: no progress line.

    Raises:
        ValueError: a bad argument, an existing ``out``, no such bundle, or a bundle that
            lacks what the export needs.
        CorruptBundleError: a blob is missing or damaged (named, with its tensors); nothing
            is left at ``out``.
        BundleFormatError, StoreError: an unreadable bundle or store.
    """
    to = _format(to)
    if config is not None and to is not Format.TRANSFORMERS:
        raise ValueError("config is for the transformers format only")
    if to is Format.TRANSFORMERS and config is None:
        raise ValueError("the transformers format needs the model's config (config=... / --config)")
    if to is Format.TRANSFORMERS and whole_state:
        raise ValueError("a Transformers folder holds weights only; drop whole_state")
    model_config = _config(config) if config is not None else None
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    store = open_store(store) if isinstance(store, str) else store
    manifest = _find(store, ref, find)
    layers = _layers(manifest, whole_state=whole_state, allow_incomplete=allow_incomplete)
    plan = Plan(store, manifest, layers)
    staging = _staging(out)
    try:
        placed, target = _lay_out(
            plan, to, staging, out, model_config, max_shard_bytes=max_shard_bytes
        )
        streamed = sum(entry.nbytes for entry, _ in placed if entry.sources)
        progress = (
            Progress(f"ckpt: exporting {bundle_name(manifest)}", streamed) if not quiet else None
        )
        try:
            fill(store, manifest, placed, progress=progress.advance if progress else lambda n: None)
        finally:
            if progress is not None:
                progress.close()
        os.replace(target, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    unique = {id(entry): entry.nbytes for entry, _ in placed}
    return Exported(bundle_name(manifest), manifest.step, out, len(placed), sum(unique.values()))


def _format(to: Format | str) -> Format:
    try:
        return Format(to)
    except ValueError:
        raise ValueError(f"unknown format {to!r}: use one of {', '.join(Format)}") from None


def _config(config: str | Mapping[str, Any]) -> dict[str, Any]:
    """The model's config as a mapping, from a mapping, a folder, a file or JSON text."""
    if isinstance(config, Mapping):
        parsed: object = dict(config)
    elif config.lstrip().startswith("{"):
        parsed = _parse(config, "the config text")
    else:
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        if not os.path.isfile(path):
            raise ValueError(
                f"config {config!r}: no such file (give config.json, its folder or JSON)"
            )
        with open(path) as file:
            parsed = _parse(file.read(), path)
    if not isinstance(parsed, dict) or "model_type" not in parsed:
        raise ValueError(
            "the config is not a Transformers model config (a JSON object with model_type): "
            "give the model's config.json, as save_pretrained writes it"
        )
    return parsed


def _parse(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except ValueError as err:
        raise ValueError(f"{what} is not JSON: {err}") from err


def _find(
    store: ObjectStore, ref: str, find: Callable[[str, int | None], Manifest | None] | None
) -> Manifest:
    """The manifest ``ref`` names (see ``export``)."""
    position = keys.manifest_position(ref.rstrip("/") + "/manifest.json")
    step: int | None
    if position is not None:
        run = ref.split("/")[1]
        step, micro = position
    else:
        match = _REF.fullmatch(ref)
        if match is None:
            raise ValueError(f"bundle {ref!r}: give RUN, RUN@STEP or runs/RUN/bundles/POSITION")
        run, micro = match["run"], int(match["micro"] or 0)
        step = int(match["step"]) if match["step"] is not None else None
    keys.check_run_name(run)
    if find is not None:
        found = find(run, step)
        if found is None:
            at = f" at step {step}" if step is not None else ""
            raise ValueError(f"run {run} has no resumable bundle{at} in the control plane")
        return found
    try:
        if micro:
            return load_manifest(store, keys.manifest_key(run, step or 0, micro))
        return find_manifest(store, run, step=step)
    except LookupError as err:
        raise ValueError(str(err)) from err


def _layers(manifest: Manifest, *, whole_state: bool, allow_incomplete: bool) -> tuple[Layer, ...]:
    """The layers to read: weights, or every layer; what the bundle lacks is refused,
    or, with ``allow_incomplete``, left out with a warning."""
    missing = missing_parts(manifest)
    name = bundle_name(manifest)
    lacks = ", ".join(f"rank {rank} {layer}" for rank, layer in missing)
    if missing and not allow_incomplete:
        raise ValueError(
            f"bundle {name} is not resumable: it lacks {lacks}; pass allow_incomplete=True "
            "(--allow-incomplete) to export what it holds"
        )
    if missing:
        log.warning("bundle %s lacks %s: exporting what it holds", name, lacks)
    held = {layer for record in manifest.ranks if record.rank == 0 for layer in record.layers}
    if Layer.WEIGHTS not in held:
        raise ValueError(f"bundle {name} has no weights (rank 0 weights): nothing to export")
    wanted = RESTORE_ORDER if whole_state else (Layer.WEIGHTS,)
    return tuple(layer for layer in wanted if layer in held)


def _staging(out: str) -> str:
    """A fresh folder beside ``out`` to write into; ``out`` must not be in use."""
    if (os.path.isdir(out) and os.listdir(out)) or os.path.isfile(out):
        raise ValueError(f"{out} exists: export to a new path (or an empty folder)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ValueError(f"{parent} does not exist: create it first")
    staging = os.path.join(
        parent, f".{os.path.basename(os.path.abspath(out))}.partial-{os.getpid()}"
    )
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(os.path.join(staging, "out"))
    return staging


def _lay_out(
    plan: Plan,
    to: Format,
    staging: str,
    out: str,
    model_config: dict[str, Any] | None,
    *,
    max_shard_bytes: int,
) -> tuple[Placed, str]:
    """The files of the export in ``staging``, and the path to move to ``out``."""
    folder = os.path.join(staging, "out")
    whole = len(plan.states) > 1
    metadata = {"format": "pt", "ckpt.bundle": bundle_name(plan.manifest)}
    if to is Format.TORCH:
        path = os.path.join(staging, "export.pt")
        state = _whole(plan) if whole else dict(weights(plan))
        return torch_file(path, state, _is_entry), path
    if to is Format.DCP:
        state = _dcp_whole(plan) if whole else dict(weights(plan))
        return dcp_folder(folder, state, _is_entry), folder
    tensors = list(plan.leaves(plan.states)) if whole else weights(plan)
    if to is Format.TRANSFORMERS:
        assert model_config is not None
        tensors = [(_unwrapped(key), entry) for key, entry in tensors]
        with open(os.path.join(folder, "config.json"), "w") as file:
            json.dump(model_config, file, indent=2)
    if to is Format.SAFETENSORS and out.endswith(".safetensors"):
        path = os.path.join(staging, "export.safetensors")
        return safetensors_file(path, tensors, metadata), path
    return safetensors_folder(folder, tensors, max_bytes=max_shard_bytes, metadata=metadata), folder


def weights(plan: Plan) -> list[tuple[str, Entry]]:
    """The models' tensors by their ``state_dict`` names (``MODEL.name`` for several models)."""
    models = plan.states[Layer.WEIGHTS]["models"]
    found = []
    for model, state in models.items():
        for key, value in state.items():
            entry = plan.entry(value)
            if entry is not None:
                found.append((key if len(models) == 1 else f"{model}.{key}", entry))
    return found


def _whole(plan: Plan) -> dict[str, Any]:
    """Every layer, as ``torch.load`` gives it back: tensors whole, the rest as saved."""
    manifest = plan.manifest
    layers = {str(layer): _entries(plan, state) for layer, state in plan.states.items()}
    return {
        "run": manifest.run,
        "step": manifest.step,
        "world_size": manifest.world_size,
        "layers": layers,
    }


def _dcp_whole(plan: Plan) -> dict[str, Any]:
    """The model, optimizer and scheduler states, as a DCP training loop keys them."""
    state = {"model": by_name(_entries(plan, plan.states[Layer.WEIGHTS]["models"]))}
    if Layer.OPTIMIZER in plan.states:
        state["optimizer"] = by_name(_entries(plan, plan.states[Layer.OPTIMIZER]["optimizers"]))
    schedulers = plan.states.get(Layer.SCHEDULER) or {}
    if schedulers:
        state["scheduler"] = by_name(schedulers)
    return state


def _entries(plan: Plan, state: Any) -> Any:
    return transform(state, lambda value: plan.entry(value) or value)


def _is_entry(value: object) -> Entry | None:
    return value if isinstance(value, Entry) else None


def _unwrapped(key: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        key = key.removeprefix(prefix)
    return key


__all__ = ["DEFAULT_SHARD_BYTES", "Exported", "Format", "export"]
