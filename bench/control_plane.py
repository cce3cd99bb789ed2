"""Latency of the control plane's hot paths, against a real ``ckpt server`` process.

    .venv/bin/python bench/control_plane.py [--bundles 200] [--repeat 200] [--commit-repeat 10]
        [--postgres URL]

A run gets ``--bundles`` complete bundles (6 small layers each; several attempts and a
rollback so the lineage has branches). Then each call is timed ``--repeat`` times over one
keep-alive connection and printed as p50 / p99 next to ``GET /healthz`` on the same server
(the HTTP floor, measured in the same run) and as a ratio to it:

- ``GET /v1/runs/{run}/resumable``: the latest resumable bundle with its manifest
- ``POST /v1/runs/{run}/attempts``: register an attempt + the resume decision
- ``POST /v1/attempts/{id}/heartbeat`` bare and with 20 fingerprints (a ring already full
  at its 2,048, so each beat also prunes 20), timed in turn
- one whole save of one rank: open + 6 x record + commit (blob verification included)
- the commit alone of ``--commit-repeat`` bundles of ``--commit-blobs`` new blobs (1,000 by
  default) of 4 KiB, then of 256 KiB, then of as many sizes (4 KiB + n bytes, as a model's
  tensors differ): a commit reads the blobs' metadata, never their bytes, so its time does
  not grow with their size (``ckpt_blob_read_bytes_total`` is printed: 0)

SQLite (the embedded default) always; PostgreSQL with ``--postgres`` (a server URL such as
``postgresql://postgres@127.0.0.1:5432/postgres``: a database is created and dropped).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt.core.contract import RESTORE_ORDER, LayerRecord
from ckpt.core.storage import DirectoryStore
from tests.databases import throwaway_database
from tests.server_process import ckpt_server
from tests.service.helpers import commit, layer_of_blobs, open_bundle, record, register, save


def timed(action: Callable[[], object], repeat: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def timed_in_turn(actions: dict[str, Callable[[], object]], repeat: int) -> dict[str, Any]:
    """``timed`` for several actions, one sample of each in turn: the machine's load
    weighs on them alike."""
    samples: dict[str, list[float]] = {name: [] for name in actions}
    for _ in range(repeat):
        for name, action in actions.items():
            started = time.perf_counter()
            action()
            samples[name].append(time.perf_counter() - started)
    return {
        name: (statistics.median(found), sorted(found)[int(len(found) * 0.99) - 1])
        for name, found in samples.items()
    }


def heartbeats(client: httpx.Client, run: str, repeat: int) -> dict[str, Any]:
    """A bare heartbeat and one with 20 fingerprints, the attempt's ring full (2,048)."""
    attempt = register(client, run)["attempt_id"]
    steps = iter(range(1, 10**9))

    def beat(count: int) -> None:
        prints = [
            {
                "step": next(steps),
                "loss": 2.5,
                "parts": {"params": "ab" * 32, "grad_norm": "0x1.8p+1"},
            }
            for _ in range(count)
        ]
        beating = client.post(f"/v1/attempts/{attempt}/heartbeat", json={"fingerprints": prints})
        beating.raise_for_status()

    for _ in range(4):
        beat(512)
    return timed_in_turn(
        {"POST heartbeat": lambda: beat(0), "POST heartbeat + 20 fingerprints": lambda: beat(20)},
        repeat,
    )


def populate(client: httpx.Client, store: DirectoryStore, run: str, bundles: int) -> None:
    attempt = register(client, run)
    for step in range(1, bundles + 1):
        if step % 50 == 0:
            attempt = register(client, run)  # a preemption
        save(client, store, run, attempt, step=step)
    head = client.get(f"/v1/runs/{run}/resumable").json()
    client.post(f"/v1/runs/{run}/rollback", json={"bundle_id": head["bundle_id"] - 10})


def timed_commits(
    client: httpx.Client,
    store: DirectoryStore,
    run: str,
    attempt: dict[str, Any],
    steps: Iterator[int],
    *,
    blobs: int,
    size: int,
    repeat: int,
    distinct: bool = False,
) -> tuple[float, float]:
    """p50 and p99 of the commit of ``repeat`` bundles, each of ``blobs`` new blobs of
    ``size`` bytes (``distinct``: each of its own size, as a model's tensors are) spread
    over its six layers (uploaded and recorded untimed)."""
    samples = []
    for _ in range(repeat):
        opened = open_bundle(client, run, attempt, step=next(steps))
        opened.raise_for_status()
        bundle_id = opened.json()["id"]
        for index, layer in enumerate(RESTORE_ORDER):
            count = blobs // len(RESTORE_ORDER) + (index < blobs % len(RESTORE_ORDER))
            answer = record(
                client,
                bundle_id,
                0,
                layer,
                attempt["epoch"],
                _layer(store, count, size, distinct=distinct),
            )
            answer.raise_for_status()
        started = time.perf_counter()
        commit(client, bundle_id, attempt["epoch"]).raise_for_status()
        samples.append(time.perf_counter() - started)
    samples.sort()
    return statistics.median(samples), samples[math.ceil(len(samples) * 0.99) - 1]


def _layer(store: DirectoryStore, count: int, size: int, *, distinct: bool) -> LayerRecord:
    """A layer of one tensor whose payload is a header blob and ``count - 1`` data blobs
    of ``size`` random bytes (``distinct``: ``size + n`` for the n-th), uploaded."""
    return layer_of_blobs(store, [os.urandom(size + n * distinct) for n in range(count - 1)])


def measure(label: str, root: Path, database_url: str | None, args: argparse.Namespace) -> None:
    root.mkdir(parents=True)
    with ckpt_server(root, database_url=database_url) as server, server.client() as client:
        run = "bench"
        store = DirectoryStore(server.store)
        started = time.perf_counter()
        populate(client, store, run, args.bundles)
        fill = time.perf_counter() - started
        floor = timed(lambda: client.get("/healthz"), args.repeat)
        rows = {
            "GET /resumable": timed(
                lambda: client.get(f"/v1/runs/{run}/resumable").raise_for_status(), args.repeat
            ),
            "POST /attempts": timed(
                lambda: client.post(f"/v1/runs/{run}/attempts", json={}).raise_for_status(),
                args.repeat,
            ),
        }
        rows.update(heartbeats(client, run, args.repeat))
        steps = iter(range(args.bundles + 1, 10**9))
        attempt = register(client, run)
        rows["save: open+6 record+commit"] = timed(
            lambda: save(client, store, run, attempt, step=next(steps)),
            max(20, args.repeat // 10),
        )
        kinds = {  # blob size, and whether each blob has a size of its own (+ n bytes)
            "of 4 KiB": (4 << 10, False),
            "of 256 KiB": (256 << 10, False),
            "as many sizes": (4 << 10, True),
        }
        for kind, (size, distinct) in kinds.items():
            rows[f"commit: {args.commit_blobs} blobs {kind}"] = timed_commits(
                client,
                store,
                run,
                attempt,
                steps,
                blobs=args.commit_blobs,
                size=size,
                repeat=args.commit_repeat,
                distinct=distinct,
            )
        read = sum(
            float(line.split()[-1])
            for line in client.get("/metrics").text.splitlines()
            if line.startswith("ckpt_blob_read_bytes_total")
        )
    print(f"\n{label}: {args.bundles} bundles written in {fill:.1f} s")
    print(f"  blob bytes the control plane read back: {read:.0f}")
    print(f"  {'call':<34} {'p50 ms':>8} {'p99 ms':>8} {'p50 / healthz':>14}")
    print(f"  {'GET /healthz (floor)':<34} {floor[0] * 1e3:8.2f} {floor[1] * 1e3:8.2f} {1.0:14.1f}")
    for name, (p50, p99) in rows.items():
        print(f"  {name:<34} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {p50 / floor[0]:14.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--bundles", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--commit-blobs", type=int, default=1000)
    parser.add_argument(
        "--commit-repeat",
        type=int,
        default=10,
        help="commits timed of each kind (p99: the nearest rank)",
    )
    parser.add_argument("--postgres", help="a PostgreSQL server URL to benchmark too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        measure("SQLite (embedded)", Path(tmp) / "sqlite", None, args)
    if args.postgres:
        with throwaway_database(args.postgres) as url, tempfile.TemporaryDirectory() as tmp:
            measure("PostgreSQL", Path(tmp) / "pg", url, args)


if __name__ == "__main__":
    main()
