"""Many ranks on the CPU (gloo, real processes): DDP and FSDP2 with dropout, sharded
shuffled data and AdamW, killed or preempted on every rank and resumed bit-exactly; a rank
dying mid-save; FSDP2 resharded between world sizes."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.demo.compare import differences
from ckpt.core.contract import Manifest
from ckpt.core.storage import DirectoryStore, keys
from tests.ranks_job import load_ranks, run_ranks
from tests.server_process import ckpt_server

pytestmark = pytest.mark.slow

STEPS = ("--steps", "8", "--every", "2")


Reference = Callable[..., list[Any]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run of (parallelism, world size, sampler, job options), computed
    when first asked for."""
    root = tmp_path_factory.mktemp("references")

    @functools.cache
    def cached(parallel: str, world: int, sampler: str, extra: tuple[str, ...]) -> list[Any]:
        name = "-".join((parallel, str(world), sampler, *extra)).replace("--", "")
        out, store = root / name, root / f"store-{name}"
        job = (*STEPS, "--parallel", parallel, "--sampler", sampler, *extra)
        done = run_ranks(world, store, out, *job)
        assert done.codes == [0] * world, done.text()
        return load_ranks(out, world)

    def run(parallel: str, world: int, sampler: str = "ckpt", *extra: str) -> list[Any]:
        return cached(parallel, world, sampler, extra)  # one key, one run, whatever the form

    return run


def assert_bit_exact(reference: list[Any], resumed: list[Any]) -> None:
    for rank, (ref, got) in enumerate(zip(reference, resumed, strict=True)):
        assert differences(ref, got) == [], f"rank {rank}: {differences(ref, got)}"


def resume(world: int, store: Path, out: Path, parallel: str, *extra: str) -> list[Any]:
    done = run_ranks(world, store, out, *STEPS, "--parallel", parallel, *extra)
    assert done.codes == [0] * world, done.text()
    assert "resumed from" in done.outputs[0], done.text()
    return load_ranks(out, world)


@pytest.mark.parametrize(
    ("parallel", "sampler", "world", "extra"),
    [
        ("ddp", "ckpt", 2, ()),
        ("fsdp", "ckpt", 2, ()),
        ("ddp", "torch", 2, ()),
        # More than 2 ranks: gloo's ring sums a gradient element in an order set by its
        # offset in DDP's bucket, and a fresh DDP's buckets are laid out otherwise than the
        # ones it rebuilds after its first iteration. One bucket (the default), then several.
        ("ddp", "ckpt", 4, ()),
        ("ddp", "ckpt", 4, ("--bucket-cap-mb", "0.01")),
    ],
    ids=["ddp", "fsdp", "ddp-torch-sampler", "ddp-4-ranks", "ddp-4-ranks-2-buckets"],
)
def test_every_rank_killed_then_resumed_is_bit_exact(
    tmp_path: Path,
    reference: Reference,
    *,
    parallel: str,
    sampler: str,
    world: int,
    extra: tuple[str, ...],
) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    job = (*STEPS, "--parallel", parallel, "--sampler", sampler, *extra)
    marker = ("--drill-marker", str(tmp_path / "killed"))
    killed = run_ranks(world, store, out, *job, "--kill-at", "5.1", *marker)
    assert killed.codes == [-9] * world, killed.text()
    resumed = resume(world, store, out, parallel, "--sampler", sampler, *extra)
    assert_bit_exact(reference(parallel, world, sampler, *extra), resumed)
    # Every rank compared its own steps (4.1, 5.0, 5.1) with the killed attempt's: verified.
    for rank, state in enumerate(resumed):
        verification = json.loads(state["verification"])
        assert (verification["verdict"], verification["steps_compared"]) == ("verified", 3), rank


def test_a_signal_to_one_rank_stops_every_rank_at_one_boundary(
    tmp_path: Path, reference: Reference
) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    stopped = run_ranks(
        2, store, out, *STEPS, "--parallel", "ddp", "--signal-at", "5.1", "--signal-rank", "0"
    )
    assert stopped.codes == [143, 143], stopped.text()
    assert "preempted by SIGTERM at step 6" in stopped.outputs[1]  # the rank without a signal
    # Saved at the next boundary (the drill signals after 5.1's maybe_save), by both ranks.
    final = Manifest.model_validate_json(DirectoryStore(store).get(keys.manifest_key("ranks", 6)))
    assert final.world_size == 2 and [r.rank for r in final.ranks] == [0, 1]
    assert_bit_exact(reference("ddp", 2), resume(2, store, out, "ddp"))


def test_four_ranks_of_fsdp_stopped_together_resume_bit_exactly(
    tmp_path: Path, reference: Reference
) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    stopped = run_ranks(4, store, out, *STEPS, "--parallel", "fsdp", "--signal-at", "3.1")
    assert stopped.codes == [143] * 4, stopped.text()
    assert_bit_exact(reference("fsdp", 4), resume(4, store, out, "fsdp"))


def test_a_rank_dying_mid_save_fails_the_others_and_never_commits(
    tmp_path: Path, reference: Reference
) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    started = time.monotonic()
    drill = (
        "--kill-during-upload",
        "4",
        "--drill-rank",
        "1",
        "--drill-marker",
        str(tmp_path / "m"),
    )
    broken = run_ranks(2, store, out, *STEPS, "--parallel", "ddp", *drill)
    assert broken.codes[1] == -9, broken.text()
    assert broken.codes[0] not in (0, -9), broken.text()  # failed on its own, with an error
    assert "Error" in broken.outputs[0], broken.text()
    assert time.monotonic() - started < 120  # not the 300 s meeting deadline: a closed peer
    assert DirectoryStore(store).size(keys.manifest_key("ranks", 4)) is None  # never complete
    assert_bit_exact(reference("ddp", 2), resume(2, store, out, "ddp"))


@pytest.mark.parametrize(("saved", "resumed"), [(4, 2), (2, 4)])
def test_fsdp_reshards_to_another_world_size(tmp_path: Path, saved: int, resumed: int) -> None:
    store = tmp_path / "store"
    first = run_ranks(
        saved,
        store,
        tmp_path / "a",
        "--parallel",
        "fsdp",
        "--steps",
        "4",
        "--every",
        "4",
        "--dump-final",
        str(tmp_path / "saved.pt"),
    )
    assert first.codes == [0] * saved, first.text()
    second = run_ranks(
        resumed,
        store,
        tmp_path / "b",
        "--parallel",
        "fsdp",
        "--steps",
        "6",
        "--every",
        "2",
        "--dump-resumed",
        str(tmp_path / "resumed.pt"),
    )
    assert second.codes == [0] * resumed, second.text()
    assert "resharding" in second.outputs[0]
    before = torch.load(tmp_path / "saved.pt", weights_only=True)
    after = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert sorted(before) == sorted(after)
    assert [name for name in before if not torch.equal(before[name], after[name])] == []
    assert DirectoryStore(store).size(keys.manifest_key("ranks", 6)) is not None  # it trained on


def test_ddp_through_the_control_plane_resumes_bit_exactly(
    tmp_path: Path, reference: Reference
) -> None:
    out = tmp_path / "out"
    with ckpt_server(tmp_path) as server:
        env = {**server.env(), "CKPT_RUN": "ranks"}
        marker = ("--drill-marker", str(tmp_path / "killed"))
        killed = run_ranks(
            2, server.store, out, *STEPS, "--parallel", "ddp", "--kill-at", "5.1", *marker, env=env
        )
        assert killed.codes == [-9, -9], killed.text()
        done = run_ranks(2, server.store, out, *STEPS, "--parallel", "ddp", env=env)
        assert done.codes == [0, 0], done.text()
        with server.client() as client:
            lineage = client.get("/v1/runs/ranks/lineage").json()
    assert_bit_exact(reference("ddp", 2), load_ranks(out, 2))
    assert [attempt["epoch"] for attempt in lineage["attempts"]] == [1, 2]
    complete = [b for b in lineage["bundles"] if b["status"] == "complete"]
    assert complete and complete[-1]["step"] == 8
