"""How long one garbage-collection pass takes over a large catalog, on PostgreSQL.

    .venv/bin/python bench/gc.py [--postgres URL] [--runs 5000] [--bundles 50]

A throwaway database gets ``--runs`` runs of ``--bundles`` bundles each in bulk
(tests/ui/seed.py: 260,000 bundles by default; ``--runs 20000`` makes 1,000,000), then one
pass is timed in-process three ways: as a server without a retention policy runs it (only
runs with a policy of their own are retained: none here), with a server-wide
``keep_last=10`` as a dry run (every run's bundles weighed, nothing deleted), and that
dry run again; ``--delete`` ends with two real passes (the first deletes the backlog,
the second finds nothing to do). The seeded bundles have no layers, so the sweep finds no blob: what is
timed is expiry and retention.

Each pass also prints its retention transactions: how many, and the longest (the longest
time its runs' rows stayed locked: a commit of one of them waits that long at most).
``--batch`` sets ``CKPT_GC_BATCH_BUNDLES`` for the passes.

``--latency`` then starts a real ``ckpt server`` on that catalog and times
``GET /v1/runs/{run}/resumable`` back to back: idle, while a dry-run pass with
``keep_last=10`` runs inside the server's process (``POST /v1/gc``, as a server with
``CKPT_MAINTENANCE=inline`` runs it), and while the same pass runs in a process of its own
(``ckpt gc``, as ``ckpt worker`` runs it); p50 / p99 and their ratio to idle.

After the first dry run, and after the backlog's pass, the plan PostgreSQL makes for each
distinct statement the pass ran (EXPLAIN with the first parameters it was given;
tests/ui/plans.py) is printed, with any scan of ``bundle`` no index drives named.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.context import Context
from service.db import make_engine, upgrade
from service.gc import service as gc_service
from service.gc.service import collect
from service.settings import Settings
from tests.databases import throwaway_database
from tests.server_process import ckpt_server
from tests.ui.plans import Plan, recorded, shown
from tests.ui.plans import explain as plan_of
from tests.ui.seed import Shape, seed


@contextmanager
def timed_transactions() -> Iterator[list[float]]:
    """The durations of each retention transaction (``_retain``) while the block runs."""
    real, durations = gc_service._retain, []

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            durations.append(time.perf_counter() - started)

    gc_service._retain = timed
    try:
        yield durations
    finally:
        gc_service._retain = real


def timed_pass(
    url: str,
    store: Path,
    *,
    keep_last: int | None,
    dry_run: bool,
    plans: bool = False,
    batch: int | None = None,
) -> float:
    settings = Settings(
        database_url=url,
        store=str(store),
        admin_token="bench-admin-token-0123456789",
        gc_interval_seconds=0,
        keep_last=keep_last,
        **({"gc_batch_bundles": batch} if batch else {}),
    )
    context = Context.create(settings)
    try:
        with recorded(context.engine, kinds=STATEMENTS) as seen, timed_transactions() as spans:
            started = time.perf_counter()
            report = collect(context, dry_run=dry_run)
            elapsed = time.perf_counter() - started
        if plans:
            explain(context.engine, seen)
    finally:
        context.close()
    assert not report.skipped
    print(
        f"  keep_last={keep_last}, dry_run={dry_run}: {elapsed:.2f} s "
        f"({len(report.deleted_bundles)} bundles retention would delete, "
        f"{len(report.failed_bundles)} expired); {len(spans)} retention transactions, "
        f"the longest {max(spans, default=0) * 1e3:.0f} ms"
    )
    return elapsed


STATEMENTS = ("SELECT", "WITH", "UPDATE", "INSERT", "DELETE")
explained: set[str] = set()


def explain(engine: Engine, seen: list[tuple[str, Any]]) -> None:
    """Print the plan of each statement in ``seen`` not explained before (with the first
    parameters it ran with)."""
    first = {statement: params for statement, params in reversed(seen)}
    fresh = [statement for statement in first if statement not in explained]
    print(f"\n  EXPLAIN of the {len(fresh)} statements the pass ran that were not shown yet")
    for statement in fresh:
        explained.add(statement)
        plan = Plan(
            "gc", statement, plan_of(engine, statement, first[statement], prefer_indexes=False)
        )
        scans = plan.bad_scans()
        print(f"\n  {', '.join(scans) or 'every scan of bundle uses an index'}")
        print(shown(plan))
    print()


def sample_while(client: httpx.Client, path: str, busy: Callable[[], bool]) -> list[float]:
    """Request ``path`` back to back while ``busy()``; the latencies."""
    samples = []
    while busy():
        started = time.perf_counter()
        client.get(path).raise_for_status()
        samples.append(time.perf_counter() - started)
    return samples


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[max(0, int(len(ordered) * 0.99) - 1)]


def latency(url: str, root: Path) -> None:
    env = {
        "CKPT_KEEP_LAST": "10",
        "CKPT_MAINTENANCE": "worker",  # the server runs no pass of its own
        "CKPT_LOST_AFTER_SECONDS": "1000000",
        "CKPT_RATE_LIMIT_PER_SECOND": "0",
    }
    path = "/v1/runs/run-00001/resumable"
    with ckpt_server(root, database_url=url, env=env) as server, server.client() as client:
        client.timeout = httpx.Timeout(600)
        for _ in range(50):  # warm up
            client.get(path).raise_for_status()
        results: dict[str, list[float]] = {}

        def during(name: str, start: Callable[[], Callable[[], bool]]) -> None:
            busy = start()
            results[name] = sample_while(client, path, busy)

        def in_server() -> Callable[[], bool]:
            def run() -> None:
                with server.client() as admin:
                    admin.timeout = httpx.Timeout(600)
                    admin.post("/v1/gc", params={"dry_run": "true"}).raise_for_status()

            thread = threading.Thread(target=run)
            thread.start()
            return thread.is_alive

        def in_process() -> Callable[[], bool]:
            process = subprocess.Popen(
                [sys.executable, "-m", "ckpt", "gc", "--dry-run"],
                env={
                    **os.environ,
                    "CKPT_DATABASE_URL": url,
                    "CKPT_STORE": server.store,
                    "CKPT_KEEP_LAST": "10",
                },
                stdout=subprocess.DEVNULL,
            )
            return lambda: process.poll() is None

        def idle() -> Callable[[], bool]:
            until = time.monotonic() + 20
            return lambda: time.monotonic() < until

        # Idle before and after each pass: the machine's own drift falls on both sides.
        during("idle (20 s)", idle)
        during("GC pass in the server's process", in_server)
        during("idle again (20 s)", idle)
        during("GC pass in a process of its own", in_process)
        during("idle once more (20 s)", idle)
    idle_p99 = statistics.median(
        percentiles(results[name])[1] for name in results if name.startswith("idle")
    )
    print(f"\nGET {path}, back to back on one connection")
    print(f"  {'while':<34} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99/idle':>9}")
    print("  (idle: the median p99 of the three idle spells)")
    for name, samples in results.items():
        p50, p99 = percentiles(samples)
        print(
            f"  {name:<34} {len(samples):8d} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {p99 / idle_p99:9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--runs", type=int, default=5_000)
    parser.add_argument("--bundles", type=int, default=50)
    parser.add_argument("--latency", action="store_true", help="also time /resumable during GC")
    parser.add_argument(
        "--delete",
        action="store_true",
        help="last, two real passes with keep_last=10: the backlog's, then the next one",
    )
    parser.add_argument("--batch", type=int, help="CKPT_GC_BATCH_BUNDLES (default: its own)")
    args = parser.parse_args()
    shape = Shape(runs=args.runs, bundles_per_run=args.bundles, big_bundles=0)
    with throwaway_database(args.postgres) as url, tempfile.TemporaryDirectory() as tmp:
        upgrade(url)
        engine = make_engine(url)
        started = time.perf_counter()
        counts = seed(engine, shape)
        engine.dispose()
        print(f"seeded in {time.perf_counter() - started:.1f} s: {counts}")
        store = Path(tmp) / "store"
        timed_pass(url, store, keep_last=None, dry_run=False)
        timed_pass(url, store, keep_last=10, dry_run=True, plans=True)
        timed_pass(url, store, keep_last=10, dry_run=True)
        if args.latency:
            latency(url, Path(tmp))
        if args.delete:
            # The backlog: deletes.
            timed_pass(url, store, keep_last=10, dry_run=False, plans=True, batch=args.batch)
            timed_pass(url, store, keep_last=10, dry_run=False, batch=args.batch)  # the next


if __name__ == "__main__":
    main()
