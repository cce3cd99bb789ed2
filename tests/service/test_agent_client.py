"""The agent's Checkpointer against a running control plane, in process."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt import Checkpointer, FencedError
from ckpt.core.errors import ControlPlaneError, SaveLostError
from ckpt.core.storage import DirectoryStore, keys
from tests.fault_proxy import FaultProxy, Faults
from tests.service.conftest import Server


def checkpointer(server: Server, run: str, *, store: DirectoryStore | None = None) -> Checkpointer:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return Checkpointer(
        run=run,
        models=model,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        store=store or server.store,
        server=server.url,
        token=server.admin_token,
    )


def test_a_save_is_committed_through_the_control_plane(server: Server, run_name: str) -> None:
    ckpt = checkpointer(server, run_name)
    assert not ckpt.resume().resumed
    ckpt.counters.step = 3
    ckpt.save().wait()
    with server.client() as client:
        found = client.get(f"/v1/runs/{run_name}/resumable").json()
    assert found["step"] == 3
    assert found["manifest"]["catalog"]["epoch"] == 1
    assert server.store.size(keys.manifest_key(run_name, 3)) is not None
    ckpt.end("finished", final_save_committed=True)
    ckpt.close()
    again = checkpointer(server, run_name)
    result = again.resume()
    assert result.step == 3
    assert again.counters.step == 3
    again.close()


def test_each_save_reports_its_figures_to_the_control_plane(server: Server, run_name: str) -> None:
    ckpt = checkpointer(server, run_name)
    ckpt.resume()
    first = ckpt.save().wait()
    ckpt.counters.step = 1
    second = ckpt.save().wait()
    ckpt.close()
    assert first.new_bytes == first.payload_bytes > 0  # an empty store: everything is new
    assert second.new_bytes < second.payload_bytes  # the unchanged model is not sent again
    with server.client() as client:
        resumable = client.get(f"/v1/runs/{run_name}/resumable").json()
        bundle = client.get(f"/v1/bundles/{resumable['bundle_id']}").json()
        metrics = client.get("/metrics").text
    [figures] = bundle["saves"]
    assert figures["rank"] == 0
    assert figures["payload_bytes"] == second.payload_bytes
    assert figures["new_bytes"] == second.new_bytes
    assert figures["stall_seconds"] == pytest.approx(second.stall_seconds)
    assert figures["persist_seconds"] == pytest.approx(second.persist_seconds)
    assert (figures["tax_seconds"], second.tax_seconds) == (None, None)  # no steps: unknown
    new_total = first.new_bytes + second.new_bytes
    assert f"ckpt_save_new_bytes_total {float(new_total)}" in metrics
    assert "ckpt_save_stall_seconds_count 2.0" in metrics


@pytest.fixture(params=["store-only", "control plane"])
def same_step_checkpointer(
    request: pytest.FixtureRequest, server: Server, run_name: str, tmp_path: Path
) -> Iterable[Checkpointer]:
    """A checkpointer that saved step 0 at micro step 0, store-only or through the server."""
    if request.param == "store-only":
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        ckpt = Checkpointer(run=run_name, models=model, store=str(tmp_path / "store"))
    else:
        ckpt = checkpointer(server, run_name)
    ckpt.resume()
    ckpt.save().wait()
    yield ckpt
    ckpt.close()


def test_a_save_at_the_durable_position_saves_nothing(same_step_checkpointer: Checkpointer) -> None:
    again = same_step_checkpointer.save()
    assert again.done() and again.durable
    result = again.wait()
    assert (result.step, result.payload_bytes, result.new_bytes) == (0, 0, 0)


def test_a_later_micro_step_of_a_saved_step_is_a_new_bundle(
    same_step_checkpointer: Checkpointer,
) -> None:
    ckpt = same_step_checkpointer
    ckpt.counters.micro_step = 2
    later = ckpt.save().wait()
    assert later.bundle.endswith("/000000000000_000002")
    ckpt.counters.step, ckpt.counters.micro_step = 1, 0
    assert ckpt.save().wait().step == 1  # the next step saves as usual


def test_a_fenced_attempt_cannot_save(server: Server, run_name: str) -> None:
    zombie = checkpointer(server, run_name)
    zombie.resume()
    zombie.save().wait()
    successor = checkpointer(server, run_name)
    assert successor.resume().step == 0
    zombie.counters.step = 1
    with pytest.raises(FencedError, match="fenced"):
        zombie.save().wait()
    with server.client() as client:
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["step"] == 0
    zombie.close()
    successor.close()


class LosesOneBlob(DirectoryStore):
    """A store that silently drops the first write of a non-empty blob, as if garbage
    collection had swept it between the upload and the commit."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.dropped: str | None = None

    def put(self, key: str, pieces: Iterable[memoryview | bytes]) -> None:
        if self.dropped is None and key.startswith("blobs/"):
            self.dropped = key
            return
        super().put(key, pieces)


def test_a_commit_that_finds_a_blob_gone_uploads_it_again(server: Server, run_name: str) -> None:
    store = LosesOneBlob(server.store.root)
    ckpt = checkpointer(server, run_name, store=store)
    ckpt.resume()
    ckpt.save().wait()
    assert store.dropped is not None
    assert store.size(store.dropped) is not None
    with server.client() as client:
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["step"] == 0
    ckpt.close()


def test_a_run_that_has_a_head_refuses_a_save_without_resume(server: Server, run_name: str) -> None:
    first = checkpointer(server, run_name)
    first.resume()
    first.save().wait()
    fresh = checkpointer(server, run_name)
    with pytest.raises(ControlPlaneError, match="did not resume from"):
        fresh.save().wait()
    first.close()
    fresh.close()


def test_naming_the_own_run_in_from_run_is_an_ordinary_resume(
    server: Server, run_name: str
) -> None:
    first = checkpointer(server, run_name)
    first.resume()
    first.counters.step = 2
    first.save().wait()
    first.close()
    again = checkpointer(server, run_name)
    assert again.resume(from_run=run_name).step == 2
    again.counters.step = 3
    again.save().wait()
    with server.client() as client:
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["step"] == 3
    again.close()


@pytest.mark.parametrize("deferred", [False, True], ids=["committed", "deferred"])
def test_an_agent_on_another_store_is_told_so_not_that_blobs_vanished(
    server: Server,
    run_name: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    deferred: bool,
) -> None:
    # The newcomer's mistake: agent and server resolve the default .ckpt/store from two
    # working directories.
    elsewhere = DirectoryStore(tmp_path / "elsewhere")
    ckpt = checkpointer(server, run_name, store=elsewhere)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        ckpt.resume()
    assert f"writes bundles to {elsewhere.url}" in caplog.text
    assert f"reads {server.store.url}" in caplog.text
    if deferred:  # the control plane looked down as the save began: its commit waits
        ckpt._catalog.control._failing_since = time.monotonic()  # type: ignore[attr-defined]
    with pytest.raises(ControlPlaneError, match="must use the same store") as raised:
        ckpt.save().wait()
    assert elsewhere.url in str(raised.value) and server.store.url in str(raised.value)
    ckpt.close()


def test_the_registration_names_the_control_planes_store(server: Server, run_name: str) -> None:
    with server.client() as client:
        answer = client.post(f"/v1/runs/{run_name}/attempts", json={"resume": True}).json()
    assert answer["store"] == server.store.url


def test_a_resume_from_another_store_quarantines_nothing(
    server: Server, run_name: str, tmp_path: Path
) -> None:
    ckpt = checkpointer(server, run_name)
    ckpt.resume()
    ckpt.counters.step = 2
    ckpt.save().wait()
    ckpt.close()
    elsewhere = checkpointer(server, run_name, store=DirectoryStore(tmp_path / "elsewhere"))
    with pytest.raises(ControlPlaneError, match="must use the same store"):
        elsewhere.resume()
    elsewhere.close()
    with server.client() as client:
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["step"] == 2


def test_resume_takes_layers_from_any_iterable(server: Server, run_name: str) -> None:
    ckpt = checkpointer(server, run_name)
    ckpt.resume()
    ckpt.counters.step = 2
    ckpt.save().wait()
    ckpt.close()
    other = checkpointer(server, f"{run_name}-b")
    result = other.resume(from_run=run_name, layers=(x for x in ["weights", "counters"]))
    assert [str(layer) for layer in result.layers] == ["weights", "counters"]
    other.close()


def test_only_a_whole_resume_makes_the_position_durable(server: Server, run_name: str) -> None:
    ckpt = checkpointer(server, run_name)
    ckpt.resume()
    ckpt.counters.step = 2
    ckpt.save().wait()
    ckpt.close()
    partial = checkpointer(server, run_name)
    partial.resume(layers=["weights"])  # the counters stay at 0: no bundle is at step 0
    assert partial._persister.durable_at is None
    partial.close()
    whole = checkpointer(server, run_name)
    whole.resume()
    assert str(whole._persister.durable_at) == "step 2"
    whole.close()


def test_a_finished_run_started_again_adds_no_bundle(server: Server, run_name: str) -> None:
    ckpt = checkpointer(server, run_name)
    ckpt.resume()
    ckpt.counters.step = 2
    ckpt.save().wait()
    ckpt.end()
    ckpt.close()
    manifest = server.store.root / keys.manifest_key(run_name, 2)
    written = manifest.stat().st_mtime_ns
    again = checkpointer(server, run_name)
    assert again.resume().step == 2
    assert again.save().wait().payload_bytes == 0  # the job's final save: nothing new
    again.end()
    again.close()
    with server.client() as client:
        run = client.get(f"/v1/runs/{run_name}").json()
    assert run["num_bundles"] == {"complete": 1}
    assert manifest.stat().st_mtime_ns == written


def test_a_save_behind_a_deferred_commit_commits_after_it(
    server: Server, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Bundles commit in the order they were saved: a save made while an earlier one's
    commit is deferred defers behind it, even with the control plane answering again (a
    newer bundle committed first would leave the older one behind the run's head)."""
    faults = Faults(rates={"reset": 1.0}, paths=r"^/v1/bundles/\d+/commit$")
    proxy = FaultProxy(server.url, faults)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ckpt = Checkpointer(
        run=run_name,
        models=model,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        store=server.store,
        server=proxy.url,
        token=server.admin_token,
    )
    try:
        ckpt.resume()
        ckpt.counters.step = 1
        first = ckpt.save()  # opened and recorded; its commit is cut off: deferred
        deadline = time.monotonic() + 120
        while not faults.seen["reset"]:  # its commit tried, and cut off
            assert time.monotonic() < deadline, "the first save never tried its commit"
            time.sleep(0.05)
        with server.client() as client:
            (pending,) = client.get(f"/v1/runs/{run_name}/lineage").json()["bundles"]
        faults.paths = rf"^/v1/bundles/{pending['id']}/commit$"  # the first's commit only
        # Its retries back off (0.2, 0.4, ... s): after the fifth, the next is 3.2 s away,
        # time for the control plane to answer another call and for the second save to begin.
        while faults.seen["reset"] < 5:
            assert time.monotonic() < deadline, "the first save's commit stopped retrying"
            time.sleep(0.01)
        control = ckpt._catalog.control  # type: ignore[attr-defined]
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            control.resumable(run_name)  # an answer: the control plane is up again
            ckpt.counters.step = 2
            second = ckpt.save()
            assert not second.done()
            faults.rates = {}  # the first's commit goes through at its next retry
            assert (first.wait().step, second.wait().step) == (1, 2)
        assert "step 1 and after still wait for their commits" in caplog.text
        with server.client() as client:
            bundles = client.get(f"/v1/runs/{run_name}/lineage").json()["bundles"]
        committed = sorted(bundles, key=lambda b: (b["committed_at"], b["id"]))
        assert [(b["step"], b["status"]) for b in committed] == [(1, "complete"), (2, "complete")]
    finally:
        ckpt.close()
        proxy.close()


def test_a_deferred_save_whose_blobs_vanished_is_lost_and_training_goes_on(
    server: Server, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its staging reused, a deferred save cannot write again the blobs collected during the
    outage: it is lost (its own ``wait`` says so), and nothing else raises; the next save
    writes them anew."""
    faults = Faults(rates={"reset": 1.0}, paths=r"^/v1/bundles/\d+/commit$")
    proxy = FaultProxy(server.url, faults)
    torch.manual_seed(27)
    model = nn.Linear(5, 3)  # blobs of its own: no other test shares them
    ckpt = Checkpointer(
        run=run_name,
        models=model,
        store=server.store,
        server=proxy.url,
        token=server.admin_token,
    )
    started = time.time() - 1
    try:
        ckpt.resume()
        ckpt.counters.step = 1
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            first = ckpt.save()
            deadline = time.monotonic() + 120
            while "its commit waits" not in caplog.text:  # written, recorded, deferred
                assert time.monotonic() < deadline, "the save's commit was never deferred"
                time.sleep(0.05)
            blobs = [p for p in (server.store.root / "blobs").rglob("*") if p.is_file()]
            (victim,) = [p for p in blobs if p.stat().st_mtime >= started][:1]
            victim.unlink()  # collected meanwhile (a grace period shorter than the outage)
            faults.rates = {}
            with pytest.raises(SaveLostError, match="not accepted at its commit"):
                first.wait()
            ckpt.counters.step = 2
            assert ckpt.save().wait().step == 2  # nothing raised the lost one again
            ckpt.wait()
            ckpt.end()
        assert "run " + run_name + " step 1: bundle" in caplog.text
        with server.client() as client:
            assert client.get(f"/v1/runs/{run_name}/resumable").json()["step"] == 2
    finally:
        ckpt.close()
        proxy.close()
