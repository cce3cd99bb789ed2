"""Many agents and pollers at once against a real ``ckpt server`` on PostgreSQL.

    .venv/bin/python bench/load.py [--agents 100] [--pollers 100] [--seconds 60]

Each simulated agent has a ``run`` token of its own and its own run; it registers an
attempt, then every ``--period`` seconds (or as soon as the last one ends, when the server
is slower) saves a bundle the way the agent does: ``POST /v1/blobs/missing``, open, one
record per layer (each layer's two small blobs, new bytes every save, written to the
store once the bundle is open, as the agent uploads them) and commit. Each poller
has a ``read`` token and asks ``GET /v1/runs/{run}/resumable`` of a random agent's run
every ``--period`` seconds. Everything runs on one event loop with httpx (one connection
per client). Printed: requests and errors by kind (any answer other than the expected
status, or a transport error, is an error), the saves and polls made per second, and p50 /
p99 of a commit, of a whole save and of ``/resumable``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt.core.contract import RESTORE_ORDER, LayerRecord
from ckpt.core.storage import DirectoryStore, keys
from tests.databases import throwaway_database
from tests.server_process import ckpt_server
from tests.service.helpers import VERSIONS, make_layer


@dataclass
class Figures:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)

    async def call(
        self, kind: str, request: Any, *, expect: tuple[int, ...] = (200,)
    ) -> httpx.Response | None:
        self.requests[kind] += 1
        started = time.perf_counter()
        try:
            answer: httpx.Response = await request
        except httpx.HTTPError as err:
            self.errors[f"{kind}: {type(err).__name__}"] += 1
            return None
        self.latencies.setdefault(kind, []).append(time.perf_counter() - started)
        if answer.status_code not in expect:
            # Grouped by what they say, numbers aside.
            said = re.sub(r"\d+", "N", answer.text[:400])
            self.errors[f"{kind}: {answer.status_code} {said}"] += 1
            return None
        return answer


async def agent(
    url: str, token: str, run: str, *, store: DirectoryStore, figures: Figures, args: Any
) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        answer = await figures.call(
            "register", client.post(f"/v1/runs/{run}/attempts", json={}), expect=(201,)
        )
        if answer is None:
            return
        attempt = answer.json()
        epoch = attempt["epoch"]
        step = 0
        stop = time.monotonic() + args.seconds
        while time.monotonic() < stop:
            started = time.perf_counter()
            step += 1
            # New bytes every save, as training writes them: uploaded once the bundle is open.
            made = [make_layer(store, upload=False) for _ in RESTORE_ORDER]
            layers = [record.model_dump(mode="json") for record, _ in made]
            blobs = [blob for layer in layers for blob in layer["blobs"]]
            await figures.call(
                "blobs/missing", client.post("/v1/blobs/missing", json={"blobs": blobs})
            )
            opened = await figures.call(
                "open",
                client.post(
                    f"/v1/runs/{run}/bundles",
                    json={
                        "attempt_id": attempt["attempt_id"],
                        "epoch": epoch,
                        "step": step,
                        "world_size": 1,
                        "versions": VERSIONS,
                    },
                ),
                expect=(201,),
            )
            if opened is None:
                continue
            bundle = opened.json()["id"]
            await asyncio.to_thread(upload, store, made)
            for layer, record in zip(RESTORE_ORDER, layers, strict=True):
                await figures.call(
                    "record",
                    client.put(
                        f"/v1/bundles/{bundle}/layers/0/{layer}",
                        json={"epoch": epoch, "record": record},
                    ),
                )
            await figures.call(
                "commit", client.post(f"/v1/bundles/{bundle}/commit", json={"epoch": epoch})
            )
            figures.latencies.setdefault("whole save", []).append(time.perf_counter() - started)
            await asyncio.sleep(max(0.0, args.period - (time.perf_counter() - started)))


async def poller(url: str, token: str, runs: list[str], figures: Figures, args: Any) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        stop = time.monotonic() + args.seconds
        while time.monotonic() < stop:
            started = time.perf_counter()
            run = random.choice(runs)
            # A run with no resumable bundle yet answers 404: a valid answer early on.
            await figures.call(
                "resumable", client.get(f"/v1/runs/{run}/resumable"), expect=(200, 404)
            )
            await asyncio.sleep(max(0.0, args.period - (time.perf_counter() - started)))


def upload(store: DirectoryStore, made: list[tuple[LayerRecord, list[bytes]]]) -> None:
    for record, pieces in made:
        for blob, piece in zip(record.blobs, pieces, strict=True):
            store.put(keys.blob_key(blob.sha256), [piece])


def tokens(admin: httpx.Client, role: str, names: list[str | None]) -> list[str]:
    made = []
    for index, run in enumerate(names):
        body = {"role": role, "name": f"load-{role}-{index}"} | ({"run": run} if run else {})
        answer = admin.post("/v1/tokens", json=body)
        answer.raise_for_status()
        made.append(answer.json()["token"])
    return made


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[max(0, int(len(ordered) * 0.99) - 1)]


async def load(
    url: str,
    trainer_tokens: list[str],
    reader_tokens: list[str],
    *,
    runs: list[str],
    store: DirectoryStore,
    args: Any,
) -> Figures:
    figures = Figures()
    await asyncio.gather(
        *(
            agent(url, t, r, store=store, figures=figures, args=args)
            for t, r in zip(trainer_tokens, runs, strict=True)
        ),
        *(poller(url, t, runs, figures, args) for t in reader_tokens),
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--pollers", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=1, help="the server's CKPT_WORKERS")
    args = parser.parse_args()
    runs = [f"load-{index:03d}" for index in range(args.agents)]
    with throwaway_database(args.postgres) as database, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        env = {
            "CKPT_LOST_AFTER_SECONDS": "1000000",
            "CKPT_SCRUB_INTERVAL_SECONDS": "0",
            "CKPT_WORKERS": str(args.workers),
        }
        with ckpt_server(root, database_url=database, env=env) as server:
            store = DirectoryStore(server.store)
            with server.client() as admin:
                trainer_tokens = tokens(admin, "run", list(runs))
                reader_tokens = tokens(admin, "read", [None] * args.pollers)
            started = time.perf_counter()
            figures = asyncio.run(
                load(server.url, trainer_tokens, reader_tokens, runs=runs, store=store, args=args)
            )
            elapsed = time.perf_counter() - started
    saves = len(figures.latencies.get("whole save", []))
    polls = len(figures.latencies.get("resumable", []))
    print(
        f"{args.agents} agents, {args.pollers} pollers, {args.workers} server process(es), "
        f"{elapsed:.0f} s: {saves} saves "
        f"({saves / elapsed:.1f}/s), {polls} polls ({polls / elapsed:.1f}/s), "
        f"{sum(figures.requests.values())} requests, {sum(figures.errors.values())} errors"
    )
    for error, count in figures.errors.most_common():
        print(f"  error x{count}: {error}")
    print(f"  {'request':<14} {'count':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for kind in (
        "register",
        "blobs/missing",
        "open",
        "record",
        "commit",
        "whole save",
        "resumable",
    ):
        samples = figures.latencies.get(kind)
        if samples:
            p50, p99 = percentiles(samples)
            print(f"  {kind:<14} {len(samples):7d} {p50 * 1e3:8.1f} {p99 * 1e3:8.1f}")


if __name__ == "__main__":
    main()
