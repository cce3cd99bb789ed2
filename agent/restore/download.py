"""The read side of a restore: download one layer's payload, verify every blob, parse it."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping

import torch

from agent.catalog.manifests import bundle_name, layer_record
from agent.format import payload
from agent.format.skeleton import JSON
from ckpt.core.contract import BlobRef, Layer, Manifest
from ckpt.core.errors import (
    BadObjectError,
    BundleFormatError,
    CorruptBundleError,
    StoreAccessError,
    StoreError,
)
from ckpt.core.storage import ObjectStore, keys
from ckpt.core.threads import parallel


def read_layer(
    store: ObjectStore,
    manifest: Manifest,
    *,
    rank: int,
    layer: Layer,
    into: Mapping[str, torch.Tensor] | None = None,
    progress: Callable[[int], None] = lambda nbytes: None,
) -> tuple[JSON, dict[str, torch.Tensor]]:
    """Download one payload, verify every blob's size and SHA-256, and parse it.

    Tensors are filled blob by blob, in parallel: the live tensors of ``into`` (by name)
    where they match the manifest's index, fresh ones otherwise. A blob that fails its
    check raises, but may have been written into its tensor already.

    Raises:
        CorruptBundleError: a blob is missing or does not match the manifest.
        BundleFormatError: the payload is malformed or disagrees with the manifest.
    """
    record = layer_record(manifest, rank=rank, layer=layer)
    name = bundle_name(manifest)
    target = payload.allocate(record.tensors, header_bytes=record.header_bytes, into=into)
    if target.size != record.payload_bytes:
        raise BundleFormatError(
            f"bundle {name}: the {layer} tensor index covers {target.size} bytes, "
            f"the payload has {record.payload_bytes}"
        )
    offsets = itertools.accumulate((blob.size for blob in record.blobs), initial=0)

    def fetch(item: tuple[BlobRef, int]) -> None:
        blob, start = item
        pieces = list(target.pieces(start, start + blob.size))
        # A blob that is one piece (a chunk of a large tensor, or the header) is read in
        # place; a group of small tensors goes through a buffer of its own.
        direct = len(pieces) == 1
        buffer = pieces[0] if direct else torch.empty(blob.size, dtype=torch.uint8).numpy().data
        fetch_blob(store, manifest, blob, buffer)
        if not direct:
            payload.scatter(target, start, buffer)
        progress(blob.size)

    parallel(fetch, zip(record.blobs, offsets, strict=False))
    header = payload.parse_header(
        memoryview(target.header), data_size=record.payload_bytes - record.header_bytes
    )
    if header.size != record.header_bytes or header.index != record.tensors:
        raise BundleFormatError(
            f"bundle {name}: the {layer} payload's header disagrees with its manifest"
        )
    return header.skeleton, dict(target.tensors)


def referencing(manifest: Manifest, sha256: str) -> str:
    """Every (rank, layer) of the manifest whose payload holds the blob: ``rank 0 weights,
    rank 1 weights`` (replicated state is stored once, so one blob may serve many ranks)."""
    return ", ".join(
        f"rank {record.rank} {layer}"
        for record in manifest.ranks
        for layer, layer_record in record.layers.items()
        if any(blob.sha256 == sha256 for blob in layer_record.blobs)
    )


def fetch_blob(store: ObjectStore, manifest: Manifest, blob: BlobRef, target: memoryview) -> None:
    """Read one blob of the manifest into ``target`` and check its size and SHA-256."""
    bundle = bundle_name(manifest)

    def what() -> str:  # only on failure: it reads the whole manifest
        return f"bundle {bundle}: blob {blob.sha256} (of {referencing(manifest, blob.sha256)})"

    try:
        size = store.read_into(keys.blob_key(blob.sha256), target) if blob.size else 0
    except BadObjectError as err:
        raise CorruptBundleError(
            f"{what()} is unusable: {err}", bundle=bundle, blob=blob.sha256
        ) from err
    except StoreAccessError:
        raise  # no credentials, or refused: retrying the resume changes nothing
    except StoreError as err:
        raise StoreError(
            f"{what()}: the store failed while reading it ({err}); nothing was quarantined: "
            "retry when the store answers"
        ) from err
    if size != blob.size or hashlib.sha256(target).hexdigest() != blob.sha256:
        raise CorruptBundleError(
            f"{what()} does not match its SHA-256 or size ({size} bytes read, {blob.size} "
            "expected); refusing to restore it",
            bundle=bundle,
            blob=blob.sha256,
        )
