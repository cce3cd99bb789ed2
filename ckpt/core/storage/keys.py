"""Every object key ckpt writes comes from this module.

    blobs/sha256/<2 hex>/<64 hex>               content-addressed blob (shared by all runs)
    runs/<run>/bundles/<position>/manifest.json   a bundle's commit record
    runs/<run>/bundles/<position>/rank-<rank:05d>.json
                                                one rank's record, store-only, many ranks
    runs/<run>/fingerprints/<attempt>/rank-<rank:05d>.json
                                                one attempt's fingerprints of its steps since its
                                                newest bundle, store-only (agent.verify)
    runs/<run>/fingerprints/<attempt>/verification.json
                                                what that attempt's resume proved, store-only

A bundle is named by its training position: ``<step:012d>`` at micro step 0 (every bundle
before micro steps had keys), ``<step:012d>_<micro step:06d>`` within a gradient
accumulation. The hash prefix spreads blobs over S3 partitions; the zero padding (and ``_``
sorting after ``/``) makes a listing of a run's manifests sort by (step, micro step).
"""

from __future__ import annotations

import re

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FINGERPRINTS = re.compile(r"runs/[^/]+/fingerprints/(\d{20})/rank-(\d{5,})\.json")
_BLOB = re.compile(r"blobs/sha256/([0-9a-f]{2})/([0-9a-f]{64})")
_MANIFEST = re.compile(r"runs/[^/]+/bundles/(\d{12,})(?:_(\d{6,}))?/manifest\.json")


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


def blob_sha256(key: str) -> str | None:
    """The SHA-256 a blob's key names, which its bytes must have; None for any other key."""
    match = _BLOB.fullmatch(key)
    return match[2] if match and match[2].startswith(match[1]) else None


def bundles_prefix(run: str) -> str:
    return f"runs/{check_run_name(run)}/bundles/"


def bundle_key(run: str, step: int, micro_step: int = 0) -> str:
    """The folder of the bundle at this position: its manifest's and rank records' prefix."""
    position = f"{step:012d}" + (f"_{micro_step:06d}" if micro_step else "")
    return f"{bundles_prefix(run)}{position}"


def manifest_key(run: str, step: int, micro_step: int = 0) -> str:
    return f"{bundle_key(run, step, micro_step)}/manifest.json"


def rank_record_key(run: str, step: int, micro_step: int, rank: int) -> str:
    """Where one rank of a job of many ranks leaves its layers' records, store-only, for
    rank 0 to gather into the manifest."""
    return f"{bundle_key(run, step, micro_step)}/rank-{rank:05d}.json"


def manifest_position(key: str) -> tuple[int, int] | None:
    """The (step, micro step) of a manifest key, or None for any other key."""
    match = _MANIFEST.fullmatch(key)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def fingerprints_prefix(run: str) -> str:
    return f"runs/{check_run_name(run)}/fingerprints/"


def fingerprints_key(run: str, attempt: str, rank: int) -> str:
    """One rank's fingerprints in one attempt (store-only), named by when it started
    (``<nanoseconds:020d>``, so that a listing sorts the attempts by age)."""
    return f"{fingerprints_prefix(run)}{attempt}/rank-{rank:05d}.json"


def verification_key(run: str, attempt: str) -> str:
    return f"{fingerprints_prefix(run)}{attempt}/verification.json"


def fingerprints_owner(key: str) -> tuple[str, int] | None:
    """The (attempt, rank) of a fingerprints key, or None for any other key."""
    match = _FINGERPRINTS.fullmatch(key)
    return (match.group(1), int(match.group(2))) if match else None
