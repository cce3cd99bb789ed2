"""The API's hot reads on a catalog of 1,000 bundles and on one of 1,000,000, on PostgreSQL.

    .venv/bin/python bench/scale.py [--postgres URL] [--repeat 200]

Two throwaway databases are seeded in bulk (tests/ui/seed.py): 10 runs of 100 bundles (5
attempts each), and 9,900 such runs plus the run ``big`` of 1,000 attempts and 10,000
bundles: 1,000,000 bundles. A real ``ckpt server`` serves each in turn; a client times each
request ``--repeat`` times, round-robin with ``GET /healthz`` on the same keep-alive
connection (the floor), and prints p50 / p99, then the 1M / 1k ratio of each p99 (goal
<= 1.5) and the ratio of ``big``'s lineage to a 100-bundle run's (goal <= 10). Last, the
plan PostgreSQL makes on the 1M catalog for every SELECT behind those requests (EXPLAIN, the
statements' own parameters; tests/ui/plans.py), with any scan of ``bundle`` no index drives
named.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.db import make_engine, upgrade
from tests.databases import throwaway_database
from tests.server_process import ckpt_server
from tests.ui.plans import page_plans, shown
from tests.ui.seed import Shape, seed

SMALL = Shape(runs=10, bundles_per_run=100, attempts_per_run=5, big_attempts=0, big_bundles=0)
LARGE = Shape(runs=9_900, bundles_per_run=100, attempts_per_run=5)
RUN = "run-00001"
REQUESTS = {
    "GET /healthz (floor)": "/healthz",
    "resumable": f"/v1/runs/{RUN}/resumable",
    "runs list, page of 50": "/v1/runs?limit=50",
    "runs list, a later page": "/v1/runs?limit=50&after=run-00005",
    "run": f"/v1/runs/{RUN}",
    "lineage, 100 bundles": f"/v1/runs/{RUN}/lineage",
}
BIG = "lineage, 10,000 bundles"
BIG_PAGES = {
    "its newest page of 100": "?limit=100",
    "a page of 100, 9,000 deep": "?limit=100&before=991000",
}


def timed(actions: dict[str, Callable[[], object]], repeat: int) -> dict[str, tuple[float, float]]:
    samples: dict[str, list[float]] = {name: [] for name in actions}
    for round_ in range(repeat + 5):
        for name, action in actions.items():
            started = time.perf_counter()
            action()
            if round_ >= 5:
                samples[name].append(time.perf_counter() - started)
    found = {}
    for name, values in samples.items():
        values.sort()
        found[name] = (statistics.median(values), values[int(len(values) * 0.99) - 1])
    return found


def measure(
    postgres: str, shape: Shape, requests: dict[str, str], repeat: int, *, plans: bool = False
) -> dict[str, tuple[float, float]]:
    with throwaway_database(postgres) as url, tempfile.TemporaryDirectory() as tmp:
        upgrade(url)
        engine = make_engine(url)
        started = time.perf_counter()
        counts = seed(engine, shape)
        engine.dispose()
        print(f"seeded {counts['bundle']:,} bundles in {time.perf_counter() - started:.0f} s")
        env = {
            "CKPT_LOST_AFTER_SECONDS": "1000000",
            "CKPT_SCRUB_INTERVAL_SECONDS": "0",
            "CKPT_RATE_LIMIT_PER_SECOND": "0",
        }
        with ckpt_server(Path(tmp), database_url=url, env=env) as server, server.client() as client:

            def get(path: str) -> Callable[[], object]:
                return lambda: client.get(path).raise_for_status()

            found = timed({name: get(path) for name, path in requests.items()}, repeat)
        if plans:
            explain(url, [path for path in requests.values() if path.startswith("/v1/")], Path(tmp))
        return found


def explain(url: str, paths: list[str], root: Path) -> None:
    found = page_plans(url, paths, store=root / "plans-store", api=True)
    print(f"\nEXPLAIN of the {len(found)} SELECTs behind those requests, on this catalog")
    for plan in found:
        scans = plan.bad_scans()
        print(f"\n{plan.path}: {', '.join(scans) or 'every scan of bundle uses an index'}")
        print(shown(plan))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    small = measure(args.postgres, SMALL, REQUESTS, args.repeat)
    big = f"/v1/runs/{LARGE.big_run}/lineage"
    pages = {name: big + query for name, query in BIG_PAGES.items()}
    large = measure(args.postgres, LARGE, REQUESTS | {BIG: big} | pages, args.repeat, plans=True)
    print(f"\n{args.repeat} requests each, round-robin on one keep-alive connection")
    print(
        f"  {'request':<28} {'1k p50':>8} {'1k p99':>8} {'1M p50':>8} {'1M p99':>8} {'p99 1M/1k':>10}"
    )
    for name in REQUESTS:
        (s50, s99), (l50, l99) = small[name], large[name]
        print(
            f"  {name:<28} {s50 * 1e3:8.2f} {s99 * 1e3:8.2f} {l50 * 1e3:8.2f} {l99 * 1e3:8.2f} {l99 / s99:10.2f}"
        )
    for name in (BIG, *BIG_PAGES):
        b50, b99 = large[name]
        print(f"  {name:<28} {'':>8} {'':>8} {b50 * 1e3:8.2f} {b99 * 1e3:8.2f}")
    hundred = large["lineage, 100 bundles"][1]
    print("  p99 / the whole lineage of 100 bundles (goal <= 10), of the 10,000-bundle run's:")
    for name in (BIG, *BIG_PAGES):
        print(f"    {name}: {large[name][1] / hundred:.1f}")


if __name__ == "__main__":
    main()
