"""Server time of the dashboard's pages on a large catalog, against a real ``ckpt server``.

    .venv/bin/python bench/dashboard.py [--postgres URL] [--repeat 200] [--runs 5000] ...

A throwaway PostgreSQL database gets, in bulk (tests/ui/seed.py), ``--runs`` runs of
``--attempts`` attempts and ``--bundles`` bundles each, and the run ``big`` of
``--big-attempts`` attempts and ``--big-bundles`` bundles (a rollback every 100 attempts);
by default 5,000 runs x 50 bundles and 1,000 attempts x 10,000 bundles, as issue 13 asks.
A real ``ckpt server`` serves it; a client signs in to the dashboard, then times each page
``--repeat`` times over one keep-alive connection, in turn with ``GET /healthz`` on the same
server (the HTTP floor, measured in the same rounds: load from elsewhere falls on both), and
prints p50 / p99 and their ratios to the floor's. The goal: each page's p99 at most 10 x the floor's and under 200 ms.

Then every SELECT behind those pages is run through ``EXPLAIN`` (PostgreSQL's own choices,
at this size) and any scan of ``bundle`` that no index drives is named (tests/ui/plans.py);
``--plans`` prints every plan.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.db import make_engine, upgrade
from tests.databases import throwaway_database
from tests.server_process import ckpt_server
from tests.ui.plans import page_plans, shown
from tests.ui.seed import Shape, seed
from tests.ui.signin import signed_in_client

FLOOR = "GET /healthz (floor)"
GOAL_RATIO = 10
GOAL_MS = 200


def timed(actions: dict[str, Callable[[], object]], repeat: int) -> dict[str, tuple[float, float]]:
    """p50 and p99 seconds of each action, called in turn ``repeat`` times (round-robin, so
    that load from elsewhere falls on all of them alike) after a warm-up."""
    samples: dict[str, list[float]] = {name: [] for name in actions}
    for round_ in range(repeat + 5):
        for name, action in actions.items():
            started = time.perf_counter()
            action()
            if round_ >= 5:  # the first rounds warm connections and caches up
                samples[name].append(time.perf_counter() - started)
    return {name: _percentiles(found) for name, found in samples.items()}


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def pages(shape: Shape) -> dict[str, str]:
    return {
        "runs page": "/ui/",
        "runs page, state=lost": "/ui/?state=lost",
        "runs page, page 50": "/ui/?page=50",
        f"run page, {shape.big_attempts} attempts": f"/ui/runs/{shape.big_run}",
        "live version of that run": f"/ui/runs/{shape.big_run}/live",
        f"run page, {shape.attempts_per_run} attempts": "/ui/runs/run-00001",
    }


def get(client: httpx.Client, path: str) -> Callable[[], int]:
    def fetch() -> int:
        answer = client.get(path)
        assert answer.status_code == 200, (path, answer.status_code)
        return len(answer.content)

    return fetch


def measure(url: str, shape: Shape, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    engine = make_engine(url)
    counts = seed(engine, shape)
    engine.dispose()
    print(f"seeded in {time.perf_counter() - started:.1f} s: {counts}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        env = {"CKPT_LOST_AFTER_SECONDS": "1000000", "CKPT_SCRUB_INTERVAL_SECONDS": "0"}
        with (
            ckpt_server(root, database_url=url, env=env) as server,
            signed_in_client(server.url, server.token) as client,
        ):
            actions: dict[str, Callable[[], object]] = {
                FLOOR: lambda: client.get("/healthz").raise_for_status()
            }
            actions |= {name: get(client, path) for name, path in pages(shape).items()}
            sizes = {name: get(client, path)() for name, path in pages(shape).items()}
            times = timed(actions, args.repeat)
        floor = times.pop(FLOOR)
        report(floor, {name: (*times[name], sizes[name]) for name in sizes}, repeat=args.repeat)
        plans(url, shape, root, verbose=args.plans)


def report(
    floor: tuple[float, float], rows: dict[str, tuple[float, float, int]], *, repeat: int
) -> None:
    print(f"\nserver time over {repeat} requests each, in turn (one keep-alive connection)")
    header = (
        f"  {'page':<30} {'p50 ms':>8} {'p99 ms':>8} {'p50/floor':>10} {'p99/floor':>10} {'KB':>7}"
    )
    print(header)
    print(
        f"  {FLOOR:<30} {floor[0] * 1e3:8.2f} {floor[1] * 1e3:8.2f} {1.0:10.1f} {1.0:10.1f} {'':>7}"
    )
    for name, (p50, p99, size) in rows.items():
        ratio = p99 / floor[1]
        verdict = "ok" if ratio <= GOAL_RATIO and p99 * 1e3 < GOAL_MS else "OVER"
        print(
            f"  {name:<30} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {p50 / floor[0]:10.1f} "
            f"{ratio:10.1f} {size / 1024:7.0f}  {verdict}"
        )
    print(f"  goal: p99 <= {GOAL_RATIO} x the floor's p99 and < {GOAL_MS} ms")


def plans(url: str, shape: Shape, root: Path, *, verbose: bool) -> None:
    found = page_plans(url, pages(shape).values(), store=root / "store")
    print(f"\nEXPLAIN of the {len(found)} SELECTs behind those pages")
    bad = 0
    for plan in found:
        scans = plan.bad_scans()
        bad += len(scans)
        if scans or verbose:
            print(f"\n{plan.path}: {', '.join(scans) or 'every scan of bundle uses an index'}")
            print(shown(plan))
    print(
        "no scan of bundle without an index"
        if not bad
        else f"{bad} scans of bundle without an index"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5_000)
    parser.add_argument("--attempts", type=int, default=5)
    parser.add_argument("--bundles", type=int, default=50)
    parser.add_argument("--big-attempts", type=int, default=1_000)
    parser.add_argument("--big-bundles", type=int, default=10_000)
    parser.add_argument("--plans", action="store_true", help="print every plan")
    args = parser.parse_args()
    shape = Shape(
        runs=args.runs,
        bundles_per_run=args.bundles,
        attempts_per_run=args.attempts,
        big_attempts=args.big_attempts,
        big_bundles=args.big_bundles,
    )
    with throwaway_database(args.postgres) as url:
        upgrade(url)
        measure(url, shape, args)


if __name__ == "__main__":
    main()
