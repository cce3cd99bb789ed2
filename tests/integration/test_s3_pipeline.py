"""The whole save and restore pipeline against S3 (moto over HTTP on 127.0.0.1).

A LoRA-style run deduplicates its frozen base on S3, store-only and through a ``ckpt server``
process; the agent saves and restores through a proxy that injects throttling, 500s, resets
and stalls while the control plane reads the store directly; a bundle whose blob cannot be
read is quarantined and the run falls back to the bundle before it, bit-exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import pytest
import torch
from torch import nn

from agent.catalog.manifests import load_manifest
from ckpt import Checkpointer, Layer, StoreError
from ckpt.core.contract import Manifest
from ckpt.core.storage import keys
from ckpt.core.storage.s3 import S3ObjectStore
from tests.fault_proxy import FaultProxy, Faults
from tests.s3_server import S3Server, aws_environment, moto_server
from tests.server_process import ServerProcess, ckpt_server

MIB = 1 << 20
# A 576x576 fp32 base matrix is 1.27 MiB: large enough to get blobs of its own under the
# default blob layout, small enough that three of them cost moto well under a second.
WIDTH = 576
RANK = 8


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with aws_environment(), moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


# -- the training job ----------------------------------------------------------------------


class LoraLinear(nn.Module):
    """A frozen projection and a trainable low-rank update beside it, laid out as PEFT does."""

    def __init__(self, width: int, *, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width, bias=False).requires_grad_(False)
        self.lora_a = nn.Linear(width, rank, bias=False)
        self.lora_b = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + self.lora_b(self.lora_a(x))
        return out


@dataclass
class Job:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    ckpt: Checkpointer
    inputs: int

    def train_step(self) -> None:
        self.model(torch.randn(16, self.inputs)).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.ckpt.counters.step += 1

    def frozen(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if not p.requires_grad]


def checkpointer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    store: S3ObjectStore,
    *,
    run: str,
    server: ServerProcess | None,
) -> Checkpointer:
    return Checkpointer(
        run=run,
        models=model,
        optimizers=optimizer,
        store=store,
        server=server.url if server else None,
        token=server.token if server else None,
    )


def lora_job(
    store: S3ObjectStore, *, run: str, server: ServerProcess | None = None, seed: int = 0
) -> Job:
    """Three frozen 1.27 MiB matrices with rank-8 adapters, a trainable head, and Adam over
    what trains. A different ``seed`` gives different initial values of the same shapes."""
    torch.manual_seed(seed)
    model = nn.Sequential(*(LoraLinear(WIDTH, rank=RANK) for _ in range(3)), nn.Linear(WIDTH, 16))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return Job(
        model, optimizer, checkpointer(model, optimizer, store, run=run, server=server), WIDTH
    )


def wide_job(store: S3ObjectStore, *, run: str, server: ServerProcess | None = None) -> Job:
    """One 5.1 MiB matrix: with 5 MiB parts (S3's smallest), its blob goes up in two."""
    torch.manual_seed(0)
    model = nn.Linear(1024, 1300, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Job(
        model, optimizer, checkpointer(model, optimizer, store, run=run, server=server), 1024
    )


def snapshot(job: Job) -> dict[str, object]:
    """Clones of every tensor, and every other value, of the model and optimizer state."""
    found: dict[str, object] = {}

    def walk(value: object, path: str) -> None:
        if isinstance(value, Mapping):
            for name, item in value.items():
                walk(item, f"{path}/{name}")
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, f"{path}/{i}")
        elif isinstance(value, torch.Tensor):
            found[path] = value.detach().clone()
        else:
            found[path] = value

    walk({"model": job.model.state_dict(), "optimizer": job.optimizer.state_dict()}, "")
    return found


def differences(expected: dict[str, object], actual: dict[str, object]) -> list[str]:
    """The paths whose values differ (tensors: dtype, shape and every bit)."""
    if expected.keys() != actual.keys():
        return [f"entries differ: {sorted(expected.keys() ^ actual.keys())}"]
    found = []
    for path, value in expected.items():
        other = actual[path]
        if isinstance(value, torch.Tensor):
            same = (
                isinstance(other, torch.Tensor)
                and value.dtype == other.dtype
                and torch.equal(value, other)
            )
        else:
            same = value == other
        if not same:
            found.append(path)
    return found


# -- looking at the store -----------------------------------------------------------------


class Request(NamedTuple):
    method: str
    key: str


@dataclass
class Requests:
    """Every HTTP request a store's S3 client sends (each retry too), by store key."""

    store: S3ObjectStore
    sent: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store._client.meta.events.register("before-send.s3", self._record)

    def _record(self, request: Any, **_: Any) -> None:
        path = unquote(urlsplit(request.url).path)
        key = path.removeprefix(f"/{self.store.bucket}/{self.store.prefix}")
        self.sent.append(Request(request.method, key))

    def put_blobs(self) -> set[str]:
        return {r.key for r in self.sent if r.method == "PUT" and r.key.startswith("blobs/")}


def blob_keys(manifest: Manifest) -> set[str]:
    return {
        keys.blob_key(blob.sha256)
        for rank in manifest.ranks
        for record in rank.layers.values()
        for blob in record.blobs
    }


def tensor_blob_key(tensor: torch.Tensor) -> str:
    """The key of the blob that holds exactly this tensor's bytes."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return keys.blob_key(hashlib.sha256(data).hexdigest())


def stored_sizes(s3: S3Server, bucket: str, prefix: str) -> dict[str, int]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {
        item["Key"].removeprefix(prefix): int(item["Size"])
        for page in pages
        for item in page.get("Contents", [])
    }


@contextlib.contextmanager
def proxied(s3: S3Server, faults: Faults) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3.endpoint, faults)
    try:
        yield proxy
    finally:
        proxy.close()


@contextlib.contextmanager
def control_plane(s3: S3Server, url: str, root: Path) -> Iterator[ServerProcess]:
    """A ``ckpt server`` on SQLite whose store is ``url``, reached directly (no proxy)."""
    with ckpt_server(root, store=url, env=s3.env()) as server:
        yield server


def catalog(server: ServerProcess, run: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's resumable bundle and its lineage, as the control plane answers them."""
    with server.client() as client:
        resumable = client.get(f"/v1/runs/{run}/resumable")
        lineage = client.get(f"/v1/runs/{run}/lineage")
    assert resumable.status_code == lineage.status_code == 200, (resumable.text, lineage.text)
    return resumable.json(), lineage.json()


# -- 1. LoRA-style deduplication ------------------------------------------------------------


@pytest.mark.parametrize("plane", ["store-only", "control-plane"])
def test_a_lora_run_uploads_its_frozen_base_once_and_resumes_bit_exactly(
    s3: S3Server, tmp_path: Path, plane: str
) -> None:
    url = f"s3://{s3.bucket()}/lora"
    with contextlib.ExitStack() as stack:
        server = (
            stack.enter_context(control_plane(s3, url, tmp_path))
            if plane == "control-plane"
            else None
        )
        store = S3ObjectStore(url, endpoint_url=s3.endpoint)
        requests = Requests(store)
        job = lora_job(store, run="lora", server=server)
        assert not job.ckpt.resume().resumed
        frozen_keys = {tensor_blob_key(t) for t in job.frozen()}
        frozen_bytes = sum(t.nbytes for t in job.frozen())
        assert len(frozen_keys) == 3 and frozen_bytes > 3 * MIB

        job.train_step()
        first = job.ckpt.save().wait()
        assert first.new_bytes == first.payload_bytes  # an empty bucket: everything goes up
        assert requests.put_blobs() >= frozen_keys, "each frozen matrix is a blob of its own"

        job.train_step()
        requests.sent.clear()
        second = job.ckpt.save().wait()
        saved = snapshot(job)
        during_second = list(requests.sent)
        job.ckpt.close()

        manifests = [load_manifest(store, keys.manifest_key("lora", step)) for step in (1, 2)]
        # Each frozen matrix is one blob, referenced by both bundles and sent once.
        assert frozen_keys <= blob_keys(manifests[0]) & blob_keys(manifests[1])
        touched = {r.method for r in during_second if r.key in frozen_keys}
        # Store-only, the agent checks that each is still there with its size (HEAD); with a
        # control plane it asks POST /v1/blobs/missing and sends S3 nothing about them.
        assert touched == ({"HEAD"} if server is None else set()), during_second
        written = {r.key for r in during_second if r.method == "PUT"}
        uploaded = {key for key in written if key.startswith("blobs/")}
        # Store-only, the agent commits by writing the manifest; else the control plane does.
        assert written - uploaded == ({keys.manifest_key("lora", 2)} if server is None else set())
        assert uploaded <= blob_keys(manifests[1]) - blob_keys(manifests[0])
        assert not uploaded & frozen_keys
        sizes = stored_sizes(s3, store.bucket, store.prefix)
        assert sum(sizes[key] for key in uploaded) == second.new_bytes

        # The changed tensors: the adapters, the head, Adam's state and the small layers.
        changed_bytes = second.payload_bytes - frozen_bytes
        changed_fraction = changed_bytes / second.payload_bytes
        assert changed_fraction < 0.15  # the frozen base is the bulk of the bundle
        assert 0 < second.new_bytes <= changed_bytes, (second, changed_bytes)
        assert second.new_bytes / second.payload_bytes <= changed_fraction + 0.01
        assert second.dedup_ratio == second.new_bytes / second.payload_bytes

        fresh_store = S3ObjectStore(url, endpoint_url=s3.endpoint)
        fresh = lora_job(fresh_store, run="lora", server=server, seed=1)
        assert differences(saved, snapshot(fresh))  # different values before the resume
        assert fresh.ckpt.resume().step == 2
        fresh.ckpt.close()
    assert differences(saved, snapshot(fresh)) == []


# -- 2. faults between the agent and S3 ------------------------------------------------------


def test_saves_and_restore_through_faults_with_the_control_plane_in_the_loop(
    s3: S3Server, tmp_path: Path
) -> None:
    url = f"s3://{s3.bucket()}/faulty"
    save_faults = Faults(rates={"slowdown": 0.07, "error": 0.07, "reset": 0.06}, seed=7)
    restore_faults = Faults(rates={"slowdown": 0.1, "error": 0.1, "reset": 0.1}, seed=11)
    with (
        control_plane(s3, url, tmp_path) as server,
        proxied(s3, save_faults) as save_proxy,
        proxied(s3, restore_faults) as restore_proxy,
    ):
        store = S3ObjectStore(url, endpoint_url=save_proxy.url, max_attempts=10)
        job = lora_job(store, run="faulty", server=server)
        job.ckpt.resume()
        for step in (1, 2, 3):
            job.train_step()
            assert job.ckpt.save().wait().step == step
        saved = snapshot(job)
        job.ckpt.end("finished", final_save_committed=True)
        job.ckpt.close()
        assert save_faults.seen["slowdown"] and save_faults.seen["error"]
        assert save_faults.seen["reset"]

        resumable, lineage = catalog(server, "faulty")
        assert resumable["step"] == 3
        assert resumable["bundle_id"] == lineage["head_id"]
        assert {b["step"]: b["status"] for b in lineage["bundles"]} == {
            1: "complete",
            2: "complete",
            3: "complete",
        }

        faulty_store = S3ObjectStore(url, endpoint_url=restore_proxy.url, max_attempts=10)
        fresh = lora_job(faulty_store, run="faulty", server=server, seed=1)
        assert fresh.ckpt.resume().step == 3
        fresh.ckpt.close()
    injected = sum(restore_faults.seen[f] for f in ("slowdown", "error", "reset"))
    assert injected > 0 and restore_faults.seen["forwarded"] > 0, restore_faults.seen
    assert differences(saved, snapshot(fresh)) == []


# -- 3. a stalled store --------------------------------------------------------------------

CONNECT_TIMEOUT = 1.0
READ_TIMEOUT = 1.0
MAX_ATTEMPTS = 2
STALL_SECONDS = 60.0


@pytest.mark.parametrize(
    "stalled",
    [None, frozenset({"PUT"})],
    ids=["every-request", "uploads-only"],  # uploads only: a multipart upload is opened first
)
def test_a_stalled_store_fails_the_save_in_bounded_time_and_leaves_nothing_partial(
    s3: S3Server, tmp_path: Path, stalled: frozenset[str] | None
) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/stalled"
    faults = Faults(stall_seconds=STALL_SECONDS, methods=stalled)
    with control_plane(s3, url, tmp_path) as server, proxied(s3, faults) as proxy:
        store = S3ObjectStore(
            url,
            endpoint_url=proxy.url,
            part_bytes=5 * MIB,
            connect_timeout=CONNECT_TIMEOUT,
            read_timeout=READ_TIMEOUT,
            max_attempts=MAX_ATTEMPTS,
        )
        requests = Requests(store)
        job = wide_job(store, run="stalled", server=server)
        job.ckpt.resume()
        job.train_step()
        job.ckpt.save().wait()
        opened = [r for r in requests.sent if r.method == "POST" and r.key.startswith("blobs/")]
        assert opened  # the weights went up as a multipart upload

        faults.rates = {"stall": 1.0}
        job.train_step()
        started = time.monotonic()
        pending = job.ckpt.save()
        with pytest.raises(StoreError, match=r"[Tt]imeout on endpoint"):
            pending.wait()
        elapsed = time.monotonic() - started
        job.ckpt.close()  # the failure was raised by wait(): close does not raise it again
        # The layers go up one after another and a layer's blobs in parallel, so the save
        # costs a few requests' attempts, each bounded by the timeouts, plus retry backoff.
        bound = 3 * MAX_ATTEMPTS * (CONNECT_TIMEOUT + READ_TIMEOUT) + 5
        assert elapsed < min(bound, STALL_SECONDS / 2), elapsed
        assert faults.seen["stall"] > 0

        resumable, lineage = catalog(server, "stalled")
    assert resumable["step"] == 1
    assert [b["status"] for b in lineage["bundles"] if b["step"] == 2] in ([], ["pending"])
    assert lineage["head_id"] == resumable["bundle_id"]
    client = s3.client()
    sizes = stored_sizes(s3, bucket, "stalled/")
    assert keys.manifest_key("stalled", 2) not in sizes
    assert keys.manifest_key("stalled", 1) in sizes
    for key, size in sizes.items():
        if key.startswith("blobs/"):
            data = client.get_object(Bucket=bucket, Key=f"stalled/{key}")["Body"].read()
            assert len(data) == size and keys.blob_key(hashlib.sha256(data).hexdigest()) == key
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


# -- 4. a blob that cannot be read ----------------------------------------------------------


def test_a_bundle_with_an_unreadable_blob_is_quarantined_and_the_one_before_restored(
    s3: S3Server, tmp_path: Path
) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/unreadable"
    # Faults pick requests by method, not key: the blob is deleted, so that its GET fails
    # every time, while the other reads go through occasional injected 500s.
    faults = Faults(rates={"error": 0.2}, methods=frozenset({"GET"}), seed=3)
    with control_plane(s3, url, tmp_path) as server, proxied(s3, faults) as proxy:
        store = S3ObjectStore(url, endpoint_url=s3.endpoint)
        job = lora_job(store, run="unreadable", server=server)
        job.ckpt.resume()
        job.train_step()
        job.ckpt.save().wait()
        at_first = snapshot(job)
        job.train_step()
        job.ckpt.save().wait()
        job.ckpt.close()
        second = load_manifest(store, keys.manifest_key("unreadable", 2))
        first = load_manifest(store, keys.manifest_key("unreadable", 1))
        # The counters layer's one blob holds the step: only the second bundle has it.
        (lost,) = second.ranks[0].layers[Layer.COUNTERS].blobs
        assert keys.blob_key(lost.sha256) not in blob_keys(first)
        s3.client().delete_object(Bucket=bucket, Key=f"unreadable/{keys.blob_key(lost.sha256)}")

        faulty_store = S3ObjectStore(url, endpoint_url=proxy.url, max_attempts=10)
        fresh = lora_job(faulty_store, run="unreadable", server=server, seed=1)
        result = fresh.ckpt.resume()
        fresh.ckpt.close()
        resumable, lineage = catalog(server, "unreadable")
    assert result.step == 1
    assert differences(at_first, snapshot(fresh)) == []
    assert faults.seen["error"] > 0
    statuses = {b["step"]: b["status"] for b in lineage["bundles"]}
    assert statuses == {1: "complete", 2: "quarantined"}
    assert resumable["step"] == 1
    assert lineage["resumable_id"] == resumable["bundle_id"]
    # Having quarantined the second bundle, the agent registered again to resume the first.
    assert lineage["attempts"][-1]["resumed_from_id"] == resumable["bundle_id"]


def test_a_store_that_keeps_failing_reads_quarantines_nothing(s3: S3Server, tmp_path: Path) -> None:
    """An outage is not corruption: when every blob GET gets a 500 through all retries, the
    resume fails with ``StoreError`` and the bundle stays resumable for the next attempt."""
    bucket = s3.bucket()
    url = f"s3://{bucket}/outage"
    faults = Faults(rates={"error": 1.0}, methods=frozenset({"GET"}), seed=5)
    with control_plane(s3, url, tmp_path) as server, proxied(s3, faults) as proxy:
        job = lora_job(S3ObjectStore(url, endpoint_url=s3.endpoint), run="outage", server=server)
        job.ckpt.resume()
        job.train_step()
        job.ckpt.save().wait()
        saved = snapshot(job)
        job.ckpt.close()

        down = S3ObjectStore(url, endpoint_url=proxy.url, max_attempts=2)
        blocked = lora_job(down, run="outage", server=server, seed=1)
        with pytest.raises(StoreError, match="nothing was quarantined"):
            blocked.ckpt.resume()
        blocked.ckpt.close()
        resumable, lineage = catalog(server, "outage")
        assert {b["step"]: b["status"] for b in lineage["bundles"]} == {1: "complete"}
        assert resumable["step"] == 1

        fresh = lora_job(
            S3ObjectStore(url, endpoint_url=s3.endpoint), run="outage", server=server, seed=1
        )
        assert fresh.ckpt.resume().step == 1
        fresh.ckpt.close()
    assert faults.seen["error"] > 0
    assert differences(saved, snapshot(fresh)) == []
