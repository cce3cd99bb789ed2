"""Build real bundles over the API: blobs in the store, layers recorded, commits."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy import event

from ckpt.core.contract import RESTORE_ORDER, BlobRef, Layer, LayerRecord, TensorEntry
from ckpt.core.storage import DirectoryStore, keys

if TYPE_CHECKING:
    from tests.service.conftest import Server

VERSIONS = {"ckpt": "0.1.0", "python": "3.11", "torch": "2.13.0"}


def put_blob(store: DirectoryStore, data: bytes) -> BlobRef:
    sha = hashlib.sha256(data).hexdigest()
    store.put(keys.blob_key(sha), [data])
    return BlobRef(sha256=sha, size=len(data))


def make_layer(
    store: DirectoryStore, *, size: int = 64, upload: bool = True, data: bytes | None = None
) -> tuple[LayerRecord, list[bytes]]:
    """A valid record of a one-tensor payload; its blobs are put in ``store`` if ``upload``."""
    data = os.urandom(size) if data is None else data
    header = b'{"t":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]}}' % (len(data), len(data))
    pieces = [header, data]
    blobs = [
        put_blob(store, piece)
        if upload
        else BlobRef(sha256=hashlib.sha256(piece).hexdigest(), size=len(piece))
        for piece in pieces
    ]
    record = LayerRecord(
        payload_bytes=len(header) + len(data),
        header_bytes=len(header),
        blobs=tuple(blobs),
        tensors={"t": TensorEntry(dtype="U8", shape=(len(data),), data_offsets=(0, len(data)))},
    )
    return record, pieces


def layer_of_blobs(store: DirectoryStore, data: list[bytes]) -> LayerRecord:
    """A valid record of one tensor whose bytes are split over the ``data`` blobs, after a
    header blob; all put in ``store``."""
    total = sum(map(len, data))
    header = b'{"t":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]}}' % (total, total)
    return LayerRecord(
        payload_bytes=len(header) + total,
        header_bytes=len(header),
        blobs=tuple(put_blob(store, piece) for piece in [header, *data]),
        tensors={"t": TensorEntry(dtype="U8", shape=(total,), data_offsets=(0, total))},
    )


def register(client: httpx.Client, run: str, **body: Any) -> dict[str, Any]:
    response = client.post(f"/v1/runs/{run}/attempts", json=body)
    assert response.status_code == 201, response.text
    result: dict[str, Any] = response.json()
    return result


def open_bundle(
    client: httpx.Client, run: str, attempt: dict[str, Any], *, step: int, world_size: int = 1
) -> httpx.Response:
    return client.post(
        f"/v1/runs/{run}/bundles",
        json={
            "attempt_id": attempt["attempt_id"],
            "epoch": attempt["epoch"],
            "step": step,
            "world_size": world_size,
            "versions": VERSIONS,
        },
    )


def record(  # noqa: PLR0917 (mirrors the URL: bundle, rank, layer)
    client: httpx.Client,
    bundle_id: int,
    rank: int,
    layer: Layer | str,
    epoch: int,
    rec: LayerRecord,
) -> httpx.Response:
    return client.put(
        f"/v1/bundles/{bundle_id}/layers/{rank}/{layer}",
        json={"epoch": epoch, "record": rec.model_dump(mode="json")},
    )


def commit(client: httpx.Client, bundle_id: int, epoch: int) -> httpx.Response:
    return client.post(f"/v1/bundles/{bundle_id}/commit", json={"epoch": epoch})


def save(
    client: httpx.Client,
    store: DirectoryStore,
    run: str,
    attempt: dict[str, Any],
    *,
    step: int,
    world_size: int = 1,
) -> dict[str, Any]:
    """Open, record every layer of every rank, and commit a bundle; returns the bundle."""
    opened = open_bundle(client, run, attempt, step=step, world_size=world_size)
    assert opened.status_code == 201, opened.text
    bundle_id = opened.json()["id"]
    for rank in range(world_size):
        for layer in RESTORE_ORDER:
            rec, _ = make_layer(store)
            response = record(client, bundle_id, rank, layer, attempt["epoch"], rec)
            assert response.status_code == 200, response.text
    done = commit(client, bundle_id, attempt["epoch"])
    assert done.status_code == 200, done.text
    bundle: dict[str, Any] = done.json()["bundle"]
    return bundle


def statements(server: Server, action: Callable[[], object]) -> int:
    """How many SQL statements ``action`` made the control plane run."""
    count = 0

    def counted(*_: Any) -> None:
        nonlocal count
        count += 1

    event.listen(server.context.engine, "before_cursor_execute", counted)
    try:
        action()
    finally:
        event.remove(server.context.engine, "before_cursor_execute", counted)
    return count
