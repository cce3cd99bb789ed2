"""``ckpt import``: another tool's checkpoint as a bundle of a run."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ckpt.cli.config import Commands, add_command

if TYPE_CHECKING:
    from agent.interop.importing import ImportResult

IMPORT = """
    Commit a checkpoint another tool wrote as a bundle of RUN, at its step: a Hugging Face
    Trainer checkpoint-N/ folder, a Lightning .ckpt, a DCP directory, or a torch.save dict
    (docs/interop.md lists the keys read). The format is told from the path unless
    --format names it. Writes to the store (--store, else CKPT_STORE, else ./.ckpt/store),
    or through the control plane with --server (CKPT_SERVER) and --token (CKPT_TOKEN).

    A layer the checkpoint cannot fill is named and nothing is written, unless
    --accept-missing lists exactly those layers: the bundle is then "imported, partial", a
    resume restores the other layers only, and it is never a bit-exact resume. Files are
    read with torch.load(weights_only=True); --unsafe-unpickle allows other Python objects
    (only for a file you trust). Prints the bundle and its layers; exits 0 when committed,
    1 when refused.
"""


def add_commands(commands: Commands) -> None:
    """``import``."""
    command = add_command(
        commands,
        "import",
        summary="commit a Hugging Face, Lightning, DCP or torch.save checkpoint as a bundle",
        description=IMPORT,
    )
    command.add_argument("source", help="the checkpoint: a folder or a file")
    command.add_argument("--run", required=True, help="the run the bundle joins")
    command.add_argument("--store", help="the store (CKPT_STORE, default ./.ckpt/store)")
    command.add_argument("--server", help="the control plane's URL (CKPT_SERVER)")
    command.add_argument("--token", help="the control plane's bearer token (CKPT_TOKEN)")
    command.add_argument(
        "--format", choices=("hf", "lightning", "dcp", "torch"), help="the source's format"
    )
    command.add_argument(
        "--accept-missing",
        default="",
        metavar="LAYER,...",
        help="the layers the source cannot fill, accepted as missing (a partial bundle)",
    )
    command.add_argument(
        "--unsafe-unpickle",
        action="store_true",
        help="allow unpickling Python objects beyond tensors (a file you trust only)",
    )
    command.set_defaults(handler=_import)


def _import(args: argparse.Namespace) -> int:
    from agent.interop.importing import import_checkpoint
    from ckpt.core.errors import ImportSourceError

    accepted = [name.strip() for name in args.accept_missing.split(",") if name.strip()]
    try:
        result = import_checkpoint(
            args.source,
            run=args.run,
            store=args.store,
            server=args.server,
            token=args.token,
            source_format=args.format,
            accept_missing=accepted,
            unsafe_unpickle=args.unsafe_unpickle,
        )
    except ImportSourceError as err:
        print(f"ckpt import: {err}", file=sys.stderr)
        return 1
    print(format_result(result))
    return 0


def format_result(result: ImportResult) -> str:
    """The bundle, whether it is partial, and each layer filled or missing (and why)."""
    kind = "imported, partial" if result.partial else "imported"
    lines = [f"{result.bundle}: step {result.step}, {kind} from {result.format}"]
    lines += [f"  {layer:<10} filled" for layer in result.layers]
    lines += [f"  {layer:<10} MISSING: {why}" for layer, why in result.missing.items()]
    return "\n".join(lines)
