"""The S3 object store against a real S3 server over HTTP on 127.0.0.1 (moto)."""

from __future__ import annotations

import base64
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.demo.compare import differences
from ckpt.core.contract import Manifest
from ckpt.core.errors import StoreError
from ckpt.core.storage import keys, open_store
from ckpt.core.storage import s3 as s3_module
from ckpt.core.storage.s3 import S3ObjectStore
from tests.conftest import run_trainer
from tests.s3_server import S3Server, aws_environment, moto_server
from tests.server_process import ckpt_server

MIB = 1 << 20


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with aws_environment(), moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture
def store(s3: S3Server) -> S3ObjectStore:
    return S3ObjectStore(f"s3://{s3.bucket()}/ckpt", endpoint_url=s3.endpoint, part_bytes=5 * MIB)


def test_objects_round_trip(store: S3ObjectStore) -> None:
    store.put("runs/a/x", [b"hello ", memoryview(b"world")])
    assert store.get("runs/a/x") == b"hello world"
    assert store.size("runs/a/x") == 11
    assert store.size("runs/a/nothing") is None
    buffer = bytearray(16)
    assert store.read_into("runs/a/x", memoryview(buffer)) == 11
    assert bytes(buffer[:11]) == b"hello world"
    assert [(o.key, o.size) for o in store.list_objects("runs/")] == [("runs/a/x", 11)]
    store.delete("runs/a/x")
    store.delete("runs/a/x")  # absent: ignored
    assert store.size("runs/a/x") is None
    with pytest.raises(StoreError, match="no object 'runs/a/x'"):
        store.get("runs/a/x")
    with pytest.raises(StoreError, match="no object"):
        store.read_into("runs/a/x", memoryview(buffer))


def test_delete_many_sends_one_request_per_thousand_keys(
    s3: S3Server, store: S3ObjectStore
) -> None:
    kept = ["blobs/0/kept", "runs/a/kept"]
    doomed = [f"blobs/0/{i:04}" for i in range(1001)]  # most are absent: ignored
    for key in [*kept, doomed[0], doomed[999], doomed[1000]]:
        store.put(key, [b"x"])
    requests: list[int] = []
    store._client.meta.events.register(
        "before-call.s3.DeleteObjects",
        lambda params, **_: requests.append(len(params["body"])),  # a request was sent
    )

    store.delete_many(doomed)

    assert len(requests) == 2
    assert sorted(store.list_keys("")) == kept
    # The prefix is the store's: the bucket's other keys are not touched.
    assert s3.client().list_objects_v2(Bucket=store.bucket)["KeyCount"] == len(kept)


def test_delete_many_of_a_missing_bucket_says_so(s3: S3Server) -> None:
    missing = S3ObjectStore("s3://no-such-bucket/ckpt", endpoint_url=s3.endpoint)
    with pytest.raises(StoreError, match="cannot delete 2 objects"):
        missing.delete_many(["blobs/a", "blobs/b"])


def test_stat_gives_the_size_and_last_modified(store: S3ObjectStore) -> None:
    before = time.time()
    store.put("blobs/stat", [b"12345"])
    found = store.stat("blobs/stat")
    assert found is not None
    assert (found.key, found.size) == ("blobs/stat", 5)
    # LastModified has whole seconds; allow for that and a little clock difference.
    assert before - 2 <= found.modified <= time.time() + 2
    assert store.stat("blobs/nothing") is None


def test_a_large_object_goes_up_in_several_checksummed_parts(
    s3: S3Server, store: S3ObjectStore
) -> None:
    # Pieces that straddle the 5 MiB part boundaries, as a payload's tensors do.
    pieces = [os.urandom(3 * MIB), os.urandom(7 * MIB + 5), os.urandom(2 * MIB)]
    store.put("blobs/big", [memoryview(p) for p in pieces])
    whole = b"".join(pieces)
    assert store.get("blobs/big") == whole
    head = s3.client().head_object(
        Bucket=store.bucket, Key="ckpt/blobs/big", ChecksumMode="ENABLED"
    )
    # A multipart object's checksum is the SHA-256 of its parts' SHA-256s, with a part count.
    parts = [whole[i : i + 5 * MIB] for i in range(0, len(whole), 5 * MIB)]
    assert len(parts) == 3
    combined = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in parts)).digest()
    assert head["ChecksumSHA256"].split("-")[0] == base64.b64encode(combined).decode()
    buffer = bytearray(len(whole))
    assert store.read_into("blobs/big", memoryview(buffer)) == len(whole)
    assert bytes(buffer) == whole
    with pytest.raises(StoreError, match="expected at most"):
        store.read_into("blobs/big", memoryview(bytearray(10)))


def test_a_blob_of_any_size_the_agent_cuts_is_one_put_with_a_whole_object_sha256(
    s3: S3Server,
) -> None:
    # Above the 64 MiB parts this store once used: still one request carrying the SHA-256 of
    # the whole object, which S3 and MinIO check and keep (a multipart object keeps only a
    # checksum of its parts'), so a commit confirms the blob from a HEAD. moto keeps no
    # checksum of a PutObject: what is sent is checked here.
    store = S3ObjectStore(f"s3://{s3.bucket()}/ckpt", endpoint_url=s3.endpoint)
    sent: list[tuple[str, str, str]] = []

    def capture(request: Any, **_: Any) -> None:
        header = request.headers.get("x-amz-checksum-sha256", b"")
        header = header.decode() if isinstance(header, bytes) else header
        sent.append((request.method, request.url, header))

    store._client.meta.events.register("before-send.s3.*", capture)
    data = os.urandom(65 * MIB)
    store.put("blobs/large", [memoryview(data)[: 33 * MIB], memoryview(data)[33 * MIB :]])
    whole = base64.b64encode(hashlib.sha256(data).digest()).decode()
    assert [(method, header) for method, _, header in sent] == [("PUT", whole)]
    assert "uploadId" not in sent[0][1]
    assert store.get("blobs/large") == data
    with pytest.raises(ValueError, match="part_bytes must be from"):
        S3ObjectStore("s3://bucket", part_bytes=(5 << 30) + 1)


def test_every_request_carries_the_sha256_of_its_bytes(store: S3ObjectStore) -> None:
    sent: list[tuple[str, str]] = []

    def capture(request: Any, **_: Any) -> None:
        sent.append((request.headers.get("x-amz-checksum-sha256", b""), request.url))

    store._client.meta.events.register("before-send.s3.*", capture)
    data = os.urandom(1000)
    store.put("blobs/small", [data])
    checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()
    assert any(
        (header.decode() if isinstance(header, bytes) else header) == checksum for header, _ in sent
    ), sent


def test_a_blob_goes_up_with_the_sha256_its_key_names_and_is_not_hashed_again(
    store: S3ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent hashed the blob to name it; S3 and MinIO refuse bytes that do not match the
    # checksum sent (moto does not check: what is sent is checked here).
    sent: list[str] = []

    def capture(request: Any, **_: Any) -> None:
        header = request.headers.get("x-amz-checksum-sha256", b"")
        sent.append(header.decode() if isinstance(header, bytes) else header)

    def hashed_again(views: object) -> str:
        raise AssertionError("a blob's bytes were hashed again")

    store._client.meta.events.register("before-send.s3.*", capture)
    monkeypatch.setattr(s3_module, "_sha256", hashed_again)
    data = os.urandom(1000)
    digest = hashlib.sha256(data)
    store.put(keys.blob_key(digest.hexdigest()), [data[:300], data[300:]])
    assert sent == [base64.b64encode(digest.digest()).decode()]
    assert store.get(keys.blob_key(digest.hexdigest())) == data


def test_a_failed_multipart_upload_is_aborted_and_leaves_nothing(
    s3: S3Server, store: S3ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(**_: Any) -> None:
        raise StoreError("the network went away")

    monkeypatch.setattr(store._client, "complete_multipart_upload", fail)
    with pytest.raises(StoreError, match="went away"):
        store.put("blobs/partial", [os.urandom(11 * MIB)])
    assert store.size("blobs/partial") is None
    uploads = s3.client().list_multipart_uploads(Bucket=store.bucket)
    assert uploads.get("Uploads", []) == []


def test_open_store_selects_s3_with_the_configured_endpoint(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPT_S3_ENDPOINT", s3.endpoint)
    bucket = s3.bucket()
    opened = open_store(f"s3://{bucket}/a/b")
    assert isinstance(opened, S3ObjectStore)
    opened.put(keys.blob_key("0" * 64), [b"x"])
    objects = s3.client().list_objects_v2(Bucket=bucket)["Contents"]
    assert [o["Key"] for o in objects] == [f"a/b/{keys.blob_key('0' * 64)}"]
    with pytest.raises(ValueError, match="not an S3 URL"):
        S3ObjectStore("s3:///prefix-only")


@pytest.mark.slow
def test_a_killed_run_resumes_from_s3_bit_exactly(s3: S3Server, tmp_path: Path) -> None:
    steps = ("--steps", "24", "--total-steps", "32")
    reference = run_trainer(tmp_path / "local", tmp_path / "reference.pt", *steps)
    url = f"s3://{s3.bucket()}/checkpoints"
    env = s3.env()
    run_trainer(
        url,
        tmp_path / "killed.pt",
        *steps,
        "--save-at",
        "12.2",
        "--kill-after-save",
        expect_rc=-9,
        env=env,
    )
    resumed = run_trainer(url, tmp_path / "resumed.pt", *steps, env=env)
    assert resumed["positions"][0] == (12, 3)
    assert differences(reference, resumed) == []


@pytest.mark.slow
def test_the_control_plane_verifies_and_serves_bundles_in_s3(s3: S3Server, tmp_path: Path) -> None:
    steps = ("--steps", "16", "--total-steps", "24")
    reference = run_trainer(tmp_path / "local", tmp_path / "reference.pt", *steps)
    url = f"s3://{s3.bucket()}/plane"
    plane_env = {**s3.env(), "CKPT_BLOB_GRACE_SECONDS": "0"}  # the sweep below may delete
    with ckpt_server(tmp_path, store=url, env=plane_env) as server:
        env = {**s3.env(), **server.env(), "CKPT_RUN": "s3-run"}
        args = (*steps, "--run", "s3-run")
        run_trainer(
            url,
            tmp_path / "killed.pt",
            *args,
            "--save-at",
            "8.1",
            "--kill-after-save",
            expect_rc=-9,
            env=env,
        )
        resumed = run_trainer(url, tmp_path / "resumed.pt", *args, "--every", "4", env=env)
        with server.client() as client:
            found = client.get("/v1/runs/s3-run/resumable").json()
            ready = client.get("/readyz").json()
            complete = [
                b
                for b in client.get("/v1/runs/s3-run/lineage").json()["bundles"]
                if b["status"] == "complete"
            ]
            # Retention and the sweep delete from S3 too (DeleteObjects, 1,000 keys a request).
            assert client.patch("/v1/runs/s3-run", json={"keep_last": 1}).status_code == 200
            report = client.post("/v1/gc").json()
            head = client.get("/v1/runs/s3-run/resumable").json()
    assert differences(reference, resumed) == []
    assert found["step"] == 16  # saved at 8 (then killed), 12 and 16
    assert ready["checks"]["store"] == "ok"
    stored = S3ObjectStore(url, endpoint_url=s3.endpoint)
    assert [b["step"] for b in complete] == [8, 12, 16]
    newest = max(complete, key=lambda b: b["id"])
    assert report["deleted_bundles"] == [b["id"] for b in complete if b is not newest]
    assert report["deleted_blobs"] > 0
    assert head["bundle_id"] == newest["id"]
    manifests = [
        k for k in stored.list_keys("runs/s3-run/") if keys.manifest_position(k) is not None
    ]
    assert manifests == [keys.manifest_key("s3-run", newest["step"])]
    kept = Manifest.model_validate_json(stored.get(manifests[0]))
    needed = {
        blob.sha256 for rank in kept.ranks for layer in rank.layers.values() for blob in layer.blobs
    }
    assert {k.rsplit("/", 1)[-1] for k in stored.list_keys("blobs/")} == needed
