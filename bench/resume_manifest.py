"""What a restarting job of many ranks waits on, whose manifest lists every tensor of every
rank: ``GET /resumable`` and registering an attempt that resumes, against a real ``ckpt
server``.

    .venv/bin/python bench/resume_manifest.py [--ranks 64] [--tensors 300 900]
        [--repeat 20] [--postgres URL]

A run gets one complete bundle of ``--ranks`` ranks, each rank's weights of ``--tensors``
[0] tensors and its optimizer state of ``--tensors`` [1] (a model's parameters; their two
Adam moments and steps), its other layers of one: at the defaults an 8 MB manifest of
77,000 tensors, what a 64-rank job restarting gets back. Then each call is timed
``--repeat`` times over one keep-alive connection, in turn with ``GET /healthz`` (the
floor, in the same run): p50 / p99, their ratio to the floor's, the answer's size, and the
server process's CPU time per call, which is what holds its GIL: every other request
waits meanwhile. SQLite (the embedded default) unless ``--postgres`` names a PostgreSQL
server URL (a database is created and dropped).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.steady import cpu_seconds
from ckpt.core.contract import RESTORE_ORDER, BlobRef, LayerRecord, TensorEntry
from ckpt.core.storage import DirectoryStore, keys
from tests.databases import throwaway_database
from tests.server_process import ServerProcess, ckpt_server
from tests.service.helpers import commit, open_bundle, record, register

RUN = "many-ranks"
TENSOR_BYTES = 4


def layer(store: DirectoryStore, tensors: int) -> LayerRecord:
    """A record of ``tensors`` tensors of 4 bytes, named as a model's are; its two blobs
    put in the store (the same for every rank: the store keeps them once)."""
    names = [f"model.layers.{i // 8}.block.{i % 8}.weight" for i in range(tensors)]
    header = b"h" * 64
    data = bytes(TENSOR_BYTES * tensors)
    blobs = []
    for piece in (header, data):
        sha = hashlib.sha256(piece).hexdigest()
        if store.stat(keys.blob_key(sha)) is None:
            store.put(keys.blob_key(sha), [piece])
        blobs.append(BlobRef(sha256=sha, size=len(piece)))
    return LayerRecord(
        payload_bytes=len(header) + len(data),
        header_bytes=len(header),
        blobs=tuple(blobs),
        tensors={
            name: TensorEntry(
                dtype="F32", shape=(1,), data_offsets=(i * TENSOR_BYTES, (i + 1) * TENSOR_BYTES)
            )
            for i, name in enumerate(names)
        },
    )


def populate(server: ServerProcess, args: argparse.Namespace) -> None:
    """One complete bundle of ``--ranks`` ranks."""
    store = DirectoryStore(server.store)
    sizes = {"weights": args.tensors[0], "optimizer": args.tensors[1]}
    records = {name: layer(store, sizes.get(name, 1)) for name in RESTORE_ORDER}
    with server.client() as client:
        client.timeout = httpx.Timeout(600)
        attempt = register(client, RUN)
        opened = open_bundle(client, RUN, attempt, step=100, world_size=args.ranks)
        opened.raise_for_status()
        bundle = opened.json()["id"]
        for rank in range(args.ranks):
            for name in RESTORE_ORDER:
                record(
                    client, bundle, rank, name, attempt["epoch"], records[name]
                ).raise_for_status()
        commit(client, bundle, attempt["epoch"]).raise_for_status()


def measure(label: str, root: Path, database_url: str | None, args: argparse.Namespace) -> None:
    root.mkdir(parents=True)
    with ckpt_server(root, database_url=database_url) as server:
        populate(server, args)
        calls: dict[str, Callable[[httpx.Client], httpx.Response]] = {
            "GET /healthz (floor)": lambda c: c.get("/healthz"),
            "GET /resumable": lambda c: c.get(f"/v1/runs/{RUN}/resumable"),
            "POST /attempts (resume)": lambda c: c.post(f"/v1/runs/{RUN}/attempts", json={}),
        }
        samples: dict[str, list[float]] = {name: [] for name in calls}
        cpu: dict[str, float] = dict.fromkeys(calls, 0.0)
        sizes: dict[str, int] = {}
        with server.client() as client:
            client.timeout = httpx.Timeout(600)
            for _ in range(args.repeat):  # in turn: each call sees the same machine
                for name, call in calls.items():
                    before, started = cpu_seconds(server.pid), time.perf_counter()
                    answer = call(client)
                    samples[name].append(time.perf_counter() - started)
                    cpu[name] += cpu_seconds(server.pid) - before  # in clock ticks: summed
                    answer.raise_for_status()
                    sizes[name] = len(answer.content)
    floor = statistics.median(samples["GET /healthz (floor)"])
    print(f"\n{label}: one bundle of {args.ranks} ranks, {args.repeat} calls each")
    header = f"{'p50 ms':>9} {'p99 ms':>9} {'x floor':>8} {'CPU ms':>8} {'answer':>11}"
    print(f"  {'call':<26} {header}")
    for name, taken in samples.items():
        ordered = sorted(taken)
        p50, p99 = statistics.median(ordered), ordered[max(0, int(len(ordered) * 0.99) - 1)]
        print(
            f"  {name:<26} {p50 * 1e3:9.1f} {p99 * 1e3:9.1f} {p50 / floor:8.1f} "
            f"{cpu[name] / len(taken) * 1e3:8.1f} {sizes[name] / 1e6:8.2f} MB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--tensors", type=int, nargs=2, default=[300, 900])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--postgres", help="a PostgreSQL server URL instead of SQLite")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        url = None
        if args.postgres:
            url = stack.enter_context(throwaway_database(args.postgres))
        measure("PostgreSQL" if url else "SQLite", Path(tmp) / "server", url, args)


if __name__ == "__main__":
    main()
