"""Saves to S3 through a proxy that injects 503 SlowDown, 500s, connection resets and stalls."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ckpt import Checkpointer, StoreError
from ckpt.core.storage import keys
from ckpt.core.storage.s3 import S3ObjectStore
from tests.fault_proxy import FaultProxy, Faults
from tests.s3_server import S3Server, aws_environment, moto_server

MIB = 1 << 20


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with aws_environment(), moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


def job(store: S3ObjectStore, run: str) -> tuple[Checkpointer, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))  # ~4 MiB
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return Checkpointer(run=run, models=model, optimizers=optimizer, store=store), model, optimizer


def step(ckpt: Checkpointer, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 512)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    ckpt.counters.step += 1


@pytest.mark.slow
def test_saves_succeed_through_throttling_errors_and_resets(s3: S3Server) -> None:
    faults = Faults(rates={"slowdown": 0.1, "error": 0.1, "reset": 0.1})
    proxy = FaultProxy(s3.endpoint, faults)
    bucket = s3.bucket()
    try:
        store = S3ObjectStore(
            f"s3://{bucket}/ckpt", endpoint_url=proxy.url, part_bytes=5 * MIB, max_attempts=10
        )
        ckpt, model, optimizer = job(store, "faulty")
        for _ in range(3):
            step(ckpt, model, optimizer)
            ckpt.save().wait()
    finally:
        proxy.close()
    assert faults.seen["slowdown"] and faults.seen["error"] and faults.seen["reset"]
    direct = S3ObjectStore(f"s3://{bucket}/ckpt", endpoint_url=s3.endpoint)
    restored, restored_model, _ = job(direct, "faulty")
    assert restored.resume().step == 3
    for a, b in zip(model.state_dict().values(), restored_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_stalled_store_fails_the_save_within_its_timeout_and_leaves_no_bundle(
    s3: S3Server,
) -> None:
    # Reads answer; every upload stalls.
    faults = Faults(rates={"stall": 1.0}, stall_seconds=30, methods=frozenset({"PUT", "POST"}))
    proxy = FaultProxy(s3.endpoint, faults)
    bucket = s3.bucket()
    try:
        store = S3ObjectStore(
            f"s3://{bucket}/ckpt",
            endpoint_url=proxy.url,
            connect_timeout=1,
            read_timeout=1,
            max_attempts=2,
        )
        ckpt, model, optimizer = job(store, "stalled")
        step(ckpt, model, optimizer)
        started = time.monotonic()
        with pytest.raises(StoreError, match=r"cannot write 'blobs/.*[Tt]imeout on endpoint"):
            ckpt.save().wait()
        elapsed = time.monotonic() - started
    finally:
        proxy.close()
    assert elapsed < 30, elapsed
    direct = S3ObjectStore(f"s3://{bucket}/ckpt", endpoint_url=s3.endpoint)
    assert direct.size(keys.manifest_key("stalled", 1)) is None
    assert list(direct.list_objects("runs/")) == []
