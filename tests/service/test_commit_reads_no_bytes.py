"""A commit reads no blob bytes: it checks each blob's presence and size from the store's
metadata (and the store's own checksum, where it keeps one); the scrubber and restores hash
the bytes. Counted by a store that tallies every byte read from it, in place of the
control plane's, and by ``ckpt_blob_read_bytes``; the scrubber's reads show the tally works.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckpt.core.contract import RESTORE_ORDER
from ckpt.core.storage import DirectoryStore, StoredObject, keys
from ckpt.core.storage.s3 import whole_object_sha256
from service.bundles.blobs import stored_blobs
from service.metrics import Metrics
from service.models import Blob
from service.scrub.service import scrub
from tests.service.conftest import Server
from tests.service.helpers import (
    commit,
    layer_of_blobs,
    make_layer,
    open_bundle,
    record,
    register,
    save,
    statements,
)


class TallyingStore(DirectoryStore):
    """The server's store, tallying the bytes read from it and the stats made of it."""

    def __init__(self, root: Path) -> None:
        super().__init__(str(root))
        self.read = 0
        self.stats = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        data = super().get(key)
        with self._lock:
            self.read += len(data)
        return data

    def read_into(self, key: str, buffer: memoryview) -> int:
        size = super().read_into(key, buffer)
        with self._lock:
            self.read += size
        return size

    def stat(self, key: str) -> StoredObject | None:
        with self._lock:
            self.stats += 1
        return super().stat(key)


def tallied(server: Server) -> TallyingStore:
    store = TallyingStore(server.store.root)
    server.context.store = store
    return store


def blob_rows(server: Server, shas: Iterable[str]) -> dict[str, Blob]:
    with server.context.transaction() as session:
        found = {sha: session.get(Blob, sha) for sha in shas}
        session.expunge_all()
    assert all(row is not None for row in found.values())
    return {sha: row for sha, row in found.items() if row is not None}


def shas_of(bundle: dict[str, Any]) -> set[str]:
    ranks = bundle["manifest"]["ranks"]
    return {
        b["sha256"] for rank in ranks for layer in rank["layers"].values() for b in layer["blobs"]
    }


def metric(client: httpx.Client, line_start: str) -> float:
    found = [
        float(line.split()[-1])
        for line in client.get("/metrics").text.splitlines()
        if line.startswith(line_start)
    ]
    return sum(found)


def test_a_commit_reads_no_blob_bytes(server: Server, run_name: str) -> None:
    store = tallied(server)
    with server.client() as client:
        attempt = register(client, run_name)
        bundles = [
            save(client, server.store, run_name, attempt, step=step, world_size=4)
            for step in (10, 20)
        ]
        shas = set().union(*(shas_of(bundle) for bundle in bundles))
        assert len(shas) > 40
        assert store.read == 0
        assert store.stats >= len(shas)  # each blob was looked at, by its metadata
        assert metric(client, "ckpt_blob_read_bytes_total") == 0
        rows = blob_rows(server, shas)
        assert all(row.verified_at is not None and row.hashed_at is None for row in rows.values())

        report = scrub(server.context)  # the control: the scrubber's reads are tallied
        assert report.damaged == [] and report.blobs == len(shas)
        assert store.read == report.bytes > 0
        assert metric(client, 'ckpt_blob_read_bytes_total{by="scrubber"}') == report.bytes
    rows = blob_rows(server, shas)
    assert all(row.hashed_at is not None for row in rows.values())


def test_a_commit_makes_as_many_statements_however_many_sizes_its_blobs_have(
    server: Server, run_name: str
) -> None:
    """A statement per distinct blob size made a real bundle's commit a round trip per
    tensor shape."""
    counted: dict[int, int] = {}
    with server.client() as client:
        attempt = register(client, run_name)
        save(client, server.store, run_name, attempt, step=5)  # each commit has a parent
        for step, sizes in ((10, 2), (20, 40)):
            bundle_id: int = open_bundle(client, run_name, attempt, step=step).json()["id"]
            for layer in RESTORE_ORDER:
                if layer == "weights":  # one tensor, in blobs of 1, 2, ... bytes
                    rec = layer_of_blobs(server.store, [bytes([n]) * (n + 1) for n in range(sizes)])
                else:
                    rec, _ = make_layer(server.store)
                assert record(client, bundle_id, 0, layer, attempt["epoch"], rec).is_success
            counted[sizes] = statements(
                server, functools.partial(commit, client, bundle_id, attempt["epoch"])
            )
            answer = client.get(f"/v1/bundles/{bundle_id}").json()
            assert answer["status"] == "complete", answer
            rows = blob_rows(server, shas_of(answer))
            assert all(row.verified_at is not None for row in rows.values())
    assert counted[40] == counted[2], counted


def test_wrong_bytes_of_the_right_size_commit_and_the_scrubber_quarantines_them(
    server: Server, run_name: str
) -> None:
    with server.client() as client:
        attempt = register(client, run_name)
        older = save(client, server.store, run_name, attempt, step=10)
        head = save(client, server.store, run_name, attempt, step=20)
        [sha] = sorted(shas_of(head) - shas_of(older))[:1]
        path = server.store.root / keys.blob_key(sha)
        path.write_bytes(bytes(len(path.read_bytes())))  # rotten after the upload, same size
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == head["id"]

        report = scrub(server.context)

        assert [(d.sha256, d.problem) for d in report.damaged] == [(sha, "wrong_hash")]
        assert report.quarantined == [head["id"]]
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == older["id"]


def checksum(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        ({"ChecksumSHA256": checksum(b"abc")}, hashlib.sha256(b"abc").hexdigest()),
        (
            {"ChecksumSHA256": checksum(b"abc"), "ChecksumType": "FULL_OBJECT"},
            hashlib.sha256(b"abc").hexdigest(),
        ),
        ({"ChecksumSHA256": checksum(b"abc") + "-3"}, None),  # a multipart upload's
        ({"ChecksumSHA256": checksum(b"abc"), "ChecksumType": "COMPOSITE"}, None),
        ({"ChecksumSHA256": "not base64!"}, None),
        ({"ChecksumSHA256": base64.b64encode(b"short").decode()}, None),
        ({"ChecksumCRC32": "AAAAAA=="}, None),
        ({}, None),
    ],
)
def test_the_whole_object_sha256_from_a_head_object_answer(
    head: dict[str, str], expected: str | None
) -> None:
    assert whole_object_sha256(head) == expected


class ChecksumStore(DirectoryStore):
    """A directory store that answers like S3: the SHA-256 it computed on upload."""

    def stat(self, key: str) -> StoredObject | None:
        found = super().stat(key)
        if found is None:
            return None
        return found._replace(sha256=hashlib.sha256(self.get(key)).hexdigest())


def test_the_stores_own_checksum_confirms_a_blobs_bytes(tmp_path: Path) -> None:
    store = ChecksumStore(str(tmp_path))
    good, bad = b"a" * 100, b"b" * 100
    for data in (good, bad):
        store.put(keys.blob_key(hashlib.sha256(data).hexdigest()), [data])
    renamed = hashlib.sha256(b"c" * 100).hexdigest()  # bytes that are not its name's
    store.put(keys.blob_key(renamed), [bad])
    sizes = {hashlib.sha256(good).hexdigest(): 100, renamed: 100}
    found = stored_blobs(store, sizes, metrics=Metrics())
    assert found[hashlib.sha256(good).hexdigest()].sha256_ok is True
    assert found[renamed].sha256_ok is None  # unconfirmed, not damaged: the scrubber decides
