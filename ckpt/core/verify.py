"""``ckpt verify``: read a bundle's blobs back from the store and check each SHA-256.

Needs only the store (not the control plane, not torch): an operator's answer to "would
this bundle restore?" before a job relies on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from ckpt.core.contract import BlobRef, Manifest, missing_parts
from ckpt.core.errors import StoreAccessError, StoreError
from ckpt.core.storage import ObjectStore, keys
from ckpt.core.threads import parallel

_THREADS = 8


@dataclass
class Verified:
    """What ``verify`` found: ``bad`` maps each failing blob to what is wrong with it;
    ``missing`` names the (rank, layer) parts the manifest lacks (``rank 0 counters``)."""

    bundle: str  # the manifest's key
    run: str
    step: int
    blobs: int = 0
    bytes: int = 0
    bad: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        """Whether a resume could restore the bundle: every part there, every blob whole."""
        return not self.bad and not self.missing


def find_manifest(store: ObjectStore, run: str, *, step: int | None) -> Manifest:
    """The manifest of ``run`` at ``step``; without a step, the newest one a resume would
    take (valid, with every layer of every rank), as resume picks it.

    Raises:
        LookupError: the run has no such bundle, or its manifest does not parse.
    """
    if step is None:
        return _newest_complete(store, run)
    key = keys.manifest_key(run, step)
    try:
        return Manifest.model_validate_json(store.get(key))
    except StoreAccessError:
        raise  # not "no bundle": the store cannot be read at all
    except StoreError as err:
        raise LookupError(f"run {run} has no bundle at step {step}: {err}") from err
    except ValidationError as err:
        raise LookupError(f"{key} is not a valid manifest: {err}") from err


def _newest_complete(store: ObjectStore, run: str) -> Manifest:
    keyed = {key: keys.manifest_position(key) for key in store.list_keys(keys.bundles_prefix(run))}
    found = sorted(((p, k) for k, p in keyed.items() if p is not None), reverse=True)
    if not found:
        raise LookupError(f"run {run} has no bundle in {store.url}")
    for _, key in found:
        try:
            manifest = Manifest.model_validate_json(store.get(key))
        except (StoreError, ValidationError):
            continue
        if not missing_parts(manifest):
            return manifest
    raise LookupError(
        f"run {run} has no complete bundle in {store.url} (the newest, at step {found[0][0][0]}, "
        f"lacks parts or does not parse): a resume would start it from scratch"
    )


def verify(
    store: ObjectStore, manifest: Manifest, *, progress: Callable[[int], None] = lambda n: None
) -> Verified:
    """Check that the manifest names every (rank, layer), then read every distinct blob and
    check its size and SHA-256."""
    blobs = {
        blob.sha256: blob
        for rank in manifest.ranks
        for record in rank.layers.values()
        for blob in record.blobs
    }
    report = Verified(
        bundle=keys.manifest_key(manifest.run, *manifest.position),
        run=manifest.run,
        step=manifest.step,
        missing=[f"rank {rank} {layer}" for rank, layer in missing_parts(manifest)],
    )

    def check(blob: BlobRef) -> None:
        problem = _problem(store, blob)
        if problem is not None:
            report.bad[blob.sha256] = problem
        progress(blob.size)

    parallel(check, blobs.values(), threads=_THREADS)
    report.blobs = len(blobs)
    report.bytes = sum(blob.size for blob in blobs.values())
    return report


def _problem(store: ObjectStore, blob: BlobRef) -> str | None:
    buffer = bytearray(blob.size)
    try:
        size = store.read_into(keys.blob_key(blob.sha256), memoryview(buffer)) if blob.size else 0
    except StoreError as err:
        return f"unreadable: {err}"
    if size != blob.size:
        return f"{size} bytes, expected {blob.size}"
    if hashlib.sha256(buffer).hexdigest() != blob.sha256:
        return "its SHA-256 does not match its name"
    return None
