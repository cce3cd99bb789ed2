"""Write a bundle to an object store, find the latest one, and read its layers back.

Phases of a save, named as in the design: *layout* (plan each payload and its blobs),
*upload* (hash each blob and put the ones the store lacks), *commit* (write the manifest,
last). A bundle exists only once its manifest does.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import torch
from pydantic import ValidationError

import agent
from agent.errors import BundleFormatError, CorruptBundleError, StoreError
from agent.format import payload
from agent.format.chunking import plan_blobs
from agent.format.skeleton import JSON
from agent.storage import ObjectStore, keys
from service.contract import (
    BlobRef,
    Layer,
    LayerRecord,
    Manifest,
    RankRecord,
    Versions,
    missing_parts,
)

log = logging.getLogger("ckpt.bundle")


@dataclass
class LayerState:
    """One layer of one rank, split for storage: a JSON skeleton and its CPU tensors."""

    skeleton: JSON
    tensors: dict[str, torch.Tensor]


@dataclass
class WriteStats:
    """What one save wrote."""

    payload_bytes: int = 0
    new_bytes: int = 0
    blobs: int = 0
    new_blobs: int = 0
    seen: set[str] = field(default_factory=set)


def _sha256(pieces: Iterator[memoryview]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


def upload_layer(
    store: ObjectStore, state: LayerState, *, blob_bytes: int, stats: WriteStats
) -> LayerRecord:
    """Lay out one payload, hash its blobs and put those the store does not hold yet."""
    plan = payload.layout(state.skeleton, state.tensors)
    blobs: list[BlobRef] = []
    for start, end in plan_blobs(plan.spans(), blob_bytes=blob_bytes):
        sha = _sha256(plan.pieces(start, end))
        key = keys.blob_key(sha)
        if sha not in stats.seen and store.size(key) != end - start:
            store.put(key, plan.pieces(start, end))
            stats.new_bytes += end - start
            stats.new_blobs += 1
        stats.seen.add(sha)
        blobs.append(BlobRef(sha256=sha, size=end - start))
    stats.payload_bytes += plan.size
    stats.blobs += len(blobs)
    return LayerRecord(
        payload_bytes=plan.size,
        header_bytes=len(plan.header),
        blobs=tuple(blobs),
        tensors=plan.index,
    )


def commit_bundle(
    store: ObjectStore,
    *,
    run: str,
    step: int,
    world_size: int,
    ranks: Mapping[int, Mapping[Layer, LayerRecord]],
) -> Manifest:
    """Write the manifest, last: from now on the bundle is resumable."""
    manifest = Manifest(
        run=run,
        step=step,
        world_size=world_size,
        created_at=datetime.now(UTC).isoformat(),
        versions=Versions(
            ckpt=agent.__version__, python=platform.python_version(), torch=torch.__version__
        ),
        ranks=tuple(
            RankRecord(rank=rank, layers=dict(layers)) for rank, layers in sorted(ranks.items())
        ),
    )
    missing = missing_parts(manifest)
    assert not missing, f"refusing to commit an incomplete bundle: {missing}"
    store.put(keys.manifest_key(run, step), [manifest.model_dump_json(indent=1).encode()])
    return manifest


def bundle_name(manifest: Manifest) -> str:
    return keys.manifest_key(manifest.run, manifest.step).removesuffix("/manifest.json")


def load_manifest(store: ObjectStore, key: str) -> Manifest:
    """Parse and validate one manifest.

    Raises:
        BundleFormatError: the manifest is not valid JSON of a known format.
    """
    try:
        return Manifest.model_validate_json(store.get(key))
    except ValidationError as err:
        raise BundleFormatError(f"{key}: not a valid ckpt manifest: {err}") from err


def latest_manifest(store: ObjectStore, run: str) -> Manifest | None:
    """The newest bundle of ``run`` whose manifest is valid and complete, or None.

    Blobs without a manifest (an interrupted save) are not bundles and are ignored; a
    manifest that fails validation is skipped with a warning.
    """
    steps = {key: keys.manifest_step(key) for key in store.list_keys(keys.bundles_prefix(run))}
    manifests = {key: step for key, step in steps.items() if step is not None}
    for key in sorted(manifests, key=manifests.__getitem__, reverse=True):
        try:
            manifest = load_manifest(store, key)
        except BundleFormatError as err:
            log.warning("skipping unreadable bundle: %s", err)
            continue
        if manifest.run != run or missing_parts(manifest):
            log.warning("skipping %s: it is incomplete or belongs to another run", key)
            continue
        return manifest
    return None


def read_layer(
    store: ObjectStore, manifest: Manifest, *, rank: int, layer: Layer
) -> tuple[JSON, dict[str, torch.Tensor]]:
    """Download one payload, verify every blob's size and SHA-256, and parse it.

    Returns the skeleton and tensors that are views into one buffer (no second copy).

    Raises:
        CorruptBundleError: a blob is missing or does not match the manifest.
        BundleFormatError: the payload is malformed or disagrees with the manifest.
    """
    record = next(r for r in manifest.ranks if r.rank == rank).layers[layer]
    name = bundle_name(manifest)
    buffer = bytearray(record.payload_bytes)
    view = memoryview(buffer)
    offset = 0
    for blob in record.blobs:
        key = keys.blob_key(blob.sha256)
        target = view[offset : offset + blob.size]
        try:
            size = store.read_into(key, target) if blob.size else 0
        except StoreError as err:
            raise CorruptBundleError(
                f"bundle {name}: blob {blob.sha256} of {layer} is unreadable: {err}",
                bundle=name,
                blob=blob.sha256,
            ) from err
        if size != blob.size or hashlib.sha256(target).hexdigest() != blob.sha256:
            raise CorruptBundleError(
                f"bundle {name}: blob {blob.sha256} of rank {rank} {layer} does not match its "
                f"SHA-256 or size ({size} bytes read, {blob.size} expected); refusing to restore it",
                bundle=name,
                blob=blob.sha256,
            )
        offset += blob.size
    header = payload.parse_header(view)
    if header.index != record.tensors:
        raise BundleFormatError(
            f"bundle {name}: the {layer} payload's tensor index disagrees with its manifest"
        )
    return header.skeleton, payload.read_tensors(buffer, header)
