"""Every object key ckpt writes comes from this module.

    blobs/sha256/<2 hex>/<64 hex>               content-addressed blob (shared by all runs)
    runs/<run>/bundles/<step:012d>/manifest.json  a bundle's commit record
    runs/<run>/bundles/<step:012d>/rank-<rank:05d>.json
                                                one rank's record, store-only, many ranks

The hash prefix spreads blobs over S3 partitions; the zero-padded step makes a listing of
a run's manifests sort by step.
"""

from __future__ import annotations

import re

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MANIFEST = re.compile(r"runs/[^/]+/bundles/(\d{12,})/manifest\.json")


def check_run_name(run: str) -> str:
    """Return ``run`` if it is a valid run name, else raise ``ValueError``."""
    if not _RUN_NAME.fullmatch(run):
        raise ValueError(
            f"invalid run name {run!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run


def blob_key(sha256: str) -> str:
    return f"blobs/sha256/{sha256[:2]}/{sha256}"


def bundles_prefix(run: str) -> str:
    return f"runs/{check_run_name(run)}/bundles/"


def manifest_key(run: str, step: int) -> str:
    return f"{bundles_prefix(run)}{step:012d}/manifest.json"


def rank_record_key(run: str, step: int, rank: int) -> str:
    """Where one rank of a job of many ranks leaves its layers' records, store-only, for
    rank 0 to gather into the manifest."""
    return f"{bundles_prefix(run)}{step:012d}/rank-{rank:05d}.json"


def manifest_step(key: str) -> int | None:
    """The step of a manifest key, or None for any other key."""
    match = _MANIFEST.fullmatch(key)
    return int(match.group(1)) if match else None
