"""``ckpt verify``: would this bundle restore? Every blob read back and checked, from the
store alone."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ckpt.cli.config import Commands, add_command, settings

if TYPE_CHECKING:
    from ckpt.core.verify import Verified

VERIFY = """
    Read every blob of a bundle back from the store and check its size and SHA-256: would
    this bundle restore? Needs only the store (--store, else CKPT_STORE, else
    ./.ckpt/store), neither the control plane nor torch.

    Prints each bad blob and a summary line; --json prints one JSON document instead:
    {"bundle": the manifest's key, "run", "step", "blobs": distinct blobs read, "bytes":
    their total size, "bad": {sha256: problem}, "missing": [parts the manifest lacks],
    "intact": true or false}; when there is no such bundle (or no store), {"run", "step":
    the step asked for or null, "error": what failed, "intact": false}. Exits 0 when every
    blob is intact, 1 when one is not, 2 when there is no such bundle.
"""


def add_commands(commands: Commands) -> None:
    """``verify``."""
    verify = add_command(
        commands,
        "verify",
        summary="read a bundle's blobs back from the store and check every SHA-256",
        description=VERIFY,
    )
    verify.add_argument("run", help="the run's name")
    verify.add_argument("--step", type=int, help="the bundle's step (default: the newest)")
    verify.add_argument("--store", help="the store (CKPT_STORE, default ./.ckpt/store)")
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.set_defaults(handler=_verify)


def _verify(args: argparse.Namespace) -> int:
    from ckpt.core.errors import StoreError
    from ckpt.core.progress import Progress
    from ckpt.core.storage import open_store
    from ckpt.core.verify import find_manifest, verify

    try:
        store = open_store(args.store or settings().store)
        manifest = find_manifest(store, args.run, step=args.step)
    except (LookupError, ValueError, StoreError) as err:
        print(f"ckpt verify: {err}", file=sys.stderr)
        if args.json:
            print(format_json_error(run=args.run, step=args.step, error=str(err)))
        return 2
    blobs = {b.sha256: b.size for r in manifest.ranks for x in r.layers.values() for b in x.blobs}
    progress = Progress(f"verifying {args.run} step {manifest.step}", sum(blobs.values()))
    try:
        report = verify(store, manifest, progress=progress.advance)
    finally:
        progress.close()
    print(format_json(report) if args.json else format_report(report))
    return 0 if report.intact else 1


def format_report(report: Verified) -> str:
    """A line per missing part and per bad blob, then ``<bundle>: N blobs, B bytes, <verdict>``."""
    from ckpt.core.storage.keys import blob_key

    lines = [f"MISSING  {part}" for part in report.missing]
    lines += [
        f"BAD  {blob_key(sha256)}: {problem}" for sha256, problem in sorted(report.bad.items())
    ]
    problems = [f"{len(report.missing)} part(s) missing"] if report.missing else []
    problems += [f"{len(report.bad)} bad blob(s)"] if report.bad else []
    verdict = ", ".join(problems) or "intact"
    lines.append(f"{report.bundle}: {report.blobs} blobs, {report.bytes} bytes, {verdict}")
    return "\n".join(lines)


def format_json_error(*, run: str, step: int | None, error: str) -> str:
    """What ``ckpt verify --json`` prints when it found no bundle to verify."""
    import json

    return json.dumps({"run": run, "step": step, "error": error, "intact": False}, indent=2)


def format_json(report: Verified) -> str:
    """The report as the JSON document ``ckpt verify --json`` prints (keys in this order)."""
    import json

    document = {
        "bundle": report.bundle,
        "run": report.run,
        "step": report.step,
        "blobs": report.blobs,
        "bytes": report.bytes,
        "bad": dict(sorted(report.bad.items())),
        "missing": report.missing,
        "intact": report.intact,
    }
    return json.dumps(document, indent=2)
