"""``ckpt export``: a bundle's weights, or its whole state, as safetensors, a Transformers
folder, a DCP folder or a ``torch.save`` file (``agent.interop.exporting``)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING

from ckpt.cli.config import Commands, add_command, settings, usage_error

if TYPE_CHECKING:
    from ckpt.core.contract import Manifest

Find = Callable[[str, "int | None"], "Manifest | None"]

EXPORT = """
    Write the bundle BUNDLE (RUN: its newest resumable bundle; RUN@STEP; or a bundle's name,
    runs/RUN/bundles/000000000020) as files other tools read, at OUT (a new path):

    safetensors: the models' weights by their state_dict names; OUT ending in .safetensors
    is one file, else a folder with model.safetensors, or past --max-shard-size Hugging
    Face's shards and model.safetensors.index.json. transformers: the same folder with the
    model's config.json (--config: the config.json, its folder, or its JSON text), which
    AutoModel*.from_pretrained loads. dcp: a torch.distributed.checkpoint folder that
    dcp.load reads at any world size. torch: one torch.save file.

    --whole-state: every layer (torch, safetensors: tensors only), or the model, optimizer
    and scheduler (dcp: keys model, optimizer, scheduler). Every blob read is checked
    against its SHA-256 before its bytes are written; a damaged blob stops the export,
    naming the blob and its tensors, and leaves nothing at OUT. A bundle that lacks parts
    (not resumable) is refused unless --allow-incomplete.

    Reads the store (--store, else CKPT_STORE, else ./.ckpt/store); with --server (and
    --token, else CKPT_TOKEN) the control plane says which bundle is resumable. Needs the
    agent extra (torch). Exits 0 when written, 1 when the bundle is damaged or
    unreadable, 2 on a usage error (no such bundle, OUT exists).
"""

_SIZE = re.compile(r"(?i)\s*(\d+(?:\.\d+)?)\s*(|b|kb|mb|gb|tb|kib|mib|gib|tib)\s*")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def add_commands(commands: Commands) -> None:
    """``export``."""
    export = add_command(
        commands,
        "export",
        summary="write a bundle as safetensors, a Transformers folder, DCP or torch.save",
        description=EXPORT,
    )
    export.add_argument("bundle", help="RUN, RUN@STEP or runs/RUN/bundles/POSITION")
    export.add_argument("out", help="the file or folder to create")
    export.add_argument(
        "--to",
        required=True,
        choices=["safetensors", "transformers", "dcp", "torch"],
        help="the format",
    )
    export.add_argument("--config", help="transformers: config.json, its folder or JSON text")
    export.add_argument("--whole-state", action="store_true", help="every layer, not weights only")
    export.add_argument(
        "--allow-incomplete", action="store_true", help="export a bundle that lacks parts"
    )
    export.add_argument(
        "--max-shard-size", default="5GB", help="safetensors folders: shard past this (5GB)"
    )
    export.add_argument("--store", help="the store (CKPT_STORE, default ./.ckpt/store)")
    export.add_argument("--server", help="find the bundle through this control plane")
    export.add_argument("--token", help="the control plane's bearer token (CKPT_TOKEN)")
    export.set_defaults(handler=_export)


def parse_size(text: str) -> int:
    """Bytes from ``5GB``, ``500MiB`` or ``123`` (decimal units as Hugging Face's)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"size {text!r}: give bytes, or a number with KB, MB, GB (or KiB...)")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def _export(args: argparse.Namespace) -> int:
    from agent.interop.exporting import export
    from ckpt.core.errors import CkptError

    try:
        max_bytes = parse_size(args.max_shard_size)
    except ValueError as err:
        usage_error("ckpt export", str(err))
    with ExitStack() as stack:
        find = _finder(args, stack) if args.server else None
        try:
            done = export(
                args.store or settings().store,
                args.bundle,
                args.out,
                to=args.to,
                config=args.config,
                whole_state=args.whole_state,
                allow_incomplete=args.allow_incomplete,
                max_shard_bytes=max_bytes,
                find=find,
            )
        except ValueError as err:
            usage_error("ckpt export", str(err))
        except CkptError as err:
            print(f"ckpt export: {err}", file=sys.stderr)
            return 1
    print(
        f"{done.bundle} (step {done.step}): {done.tensors} tensors, {done.bytes} bytes -> {done.path}"
    )
    return 0


def _finder(args: argparse.Namespace, stack: ExitStack) -> Find:
    """Find bundles through the control plane (closed with ``stack``): its resumable
    answer, or its complete bundle at a step."""
    from agent.catalog.client import ControlPlane
    from ckpt.cli.ask import resolve

    url, token = resolve(args.server, args.token)
    control = ControlPlane(url, token=token, retry_seconds=10.0)
    stack.callback(control.close)

    def find(run: str, step: int | None) -> Manifest | None:
        return control.resumable(run) if step is None else control.bundle_at(run, step)

    return find
