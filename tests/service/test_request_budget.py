"""A save costs the control plane a fixed number of requests, however many layers and
tensors it holds (docs/control-plane.md, "Requests per save"): counted at a real proxy in
front of a real control plane, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from ckpt import Checkpointer
from tests.fault_proxy import FaultProxy, Faults
from tests.service.conftest import Server

# What a single process's save sends, in order: open the bundle, ask which blobs the store
# lacks, record every layer (with the figures of the save before), commit.
BUDGET = [
    "POST /v1/runs/{run}/bundles",
    "POST /v1/blobs/missing",
    "POST /v1/bundles/{id}/layers/0",
    "POST /v1/bundles/{id}/commit",
]


class Counted(Faults):
    """No faults: every request forwarded, and its method and path kept."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str]] = []
        self._kept = threading.Lock()

    def draw(self, method: str, path: str = "") -> str:
        with self._kept:
            self.requests.append((method, path))
        return super().draw(method, path)


def model(tensors: int) -> nn.Module:
    """``tensors`` parameter tensors of 1 MiB each: one blob apiece at ``blob_bytes`` 1 MiB."""
    return nn.ParameterList(nn.Parameter(torch.randn(512, 512)) for _ in range(tensors))


def one_save(server: Server, run: str, *, tensors: int, scheduler: bool) -> list[str]:
    """The requests one save sends (its second: the first one's blobs are in the store),
    with the run and bundle named alike."""
    counted = Counted()
    proxy = FaultProxy(server.url, counted)
    torch.manual_seed(0)
    net = model(tensors)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    ckpt = Checkpointer(
        run=run,
        models=net,
        optimizers=optimizer,
        schedulers=torch.optim.lr_scheduler.StepLR(optimizer, 10) if scheduler else None,
        store=server.store,
        server=proxy.url,
        token=server.admin_token,
        blob_bytes=1 << 20,
        heartbeat_seconds=3600.0,  # no heartbeat among the counted requests
        handle_signals=False,
    )
    try:
        ckpt.resume()
        ckpt.save().wait()
        for parameter in list(net.parameters())[: tensors // 2]:  # half of them change
            parameter.data.add_(1.0)
        ckpt.counters.step = 1
        del counted.requests[:]
        result = ckpt.save().wait()
        sent = list(counted.requests)
        ckpt.end("finished", final_save_committed=True)
    finally:
        ckpt.close()
        proxy.close()
    assert 0 < result.new_bytes < result.payload_bytes  # the changed tensors alone uploaded
    with server.client() as client:  # each save's figures arrived all the same
        bundles = client.get(f"/v1/runs/{run}/lineage").json()["bundles"]
        saves = [client.get(f"/v1/bundles/{b['id']}").json()["saves"] for b in bundles]
    assert [len(figures) for figures in saves] == [1, 1]
    return [_named(method, path, run=run) for method, path in sent]


def _named(method: str, path: str, *, run: str) -> str:
    parts = [
        "{id}" if part.isdigit() and index == 3 else part
        for index, part in enumerate(path.replace(run, "{run}").split("/"))
    ]
    return f"{method} {'/'.join(parts)}"


@pytest.mark.parametrize(("tensors", "scheduler"), [(2, False), (20, False), (20, True)])
def test_a_save_costs_the_same_requests_whatever_its_layers_and_tensors(
    server: Server, run_name: str, tensors: int, scheduler: bool
) -> None:
    sent = one_save(server, run_name, tensors=tensors, scheduler=scheduler)
    assert sent == BUDGET


def test_after_a_resume_a_save_uploads_only_what_changed(server: Server, run_name: str) -> None:
    """A new process knows no hash of the save before; it asks about the blobs of the bundle
    it resumed from, once, and uploads none of those the store holds."""
    one_save(server, run_name, tensors=4, scheduler=False)
    counted = Counted()
    proxy = FaultProxy(server.url, counted)
    net = model(4)
    ckpt = Checkpointer(
        run=run_name,
        models=net,
        optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
        store=server.store,
        server=proxy.url,
        token=server.admin_token,
        blob_bytes=1 << 20,
        heartbeat_seconds=3600.0,
        handle_signals=False,
    )
    try:
        assert ckpt.resume().step == 1
        del counted.requests[:]
        ckpt.counters.step = 2
        result = ckpt.save().wait()
        sent = [_named(method, path, run=run_name) for method, path in counted.requests]
    finally:
        ckpt.close()
        proxy.close()
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    assert result.new_bytes < weights / 4  # not even one of the tensors again
    assert sent == BUDGET


def test_a_new_run_on_a_store_that_holds_its_blobs_uploads_none_of_them(
    server: Server, run_name: str
) -> None:
    """The question covers every blob of the save, not only those of a bundle before: a
    new run (no bundle before) whose tensors another run saved already uploads none."""
    one_save(server, run_name, tensors=4, scheduler=False)
    counted = Counted()
    proxy = FaultProxy(server.url, counted)
    torch.manual_seed(0)
    net = model(4)  # the other run's first save, tensor for tensor
    ckpt = Checkpointer(
        run=f"{run_name}-again",
        models=net,
        optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
        store=server.store,
        server=proxy.url,
        token=server.admin_token,
        blob_bytes=1 << 20,
        heartbeat_seconds=3600.0,
        handle_signals=False,
    )
    try:
        assert ckpt.resume().step is None
        del counted.requests[:]
        result = ckpt.save().wait()
        sent = [_named(method, path, run=f"{run_name}-again") for method, path in counted.requests]
    finally:
        ckpt.close()
        proxy.close()
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    assert result.new_bytes < weights / 4  # not even one of the tensors again
    assert sent == BUDGET
