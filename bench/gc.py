"""How long one garbage-collection pass takes over a large catalog, on PostgreSQL.

    .venv/bin/python bench/gc.py [--postgres URL] [--runs 5000] [--bundles 50]

A throwaway database gets ``--runs`` runs of ``--bundles`` bundles each in bulk
(tests/ui/seed.py: 260,000 bundles by default; ``--runs 20000`` makes 1,000,000), then one
pass is timed in-process three ways: as a server without a retention policy runs it (only
runs with a policy of their own are retained: none here), with a server-wide
``keep_last=10`` as a dry run (every run's bundles weighed, nothing deleted), and that
dry run again. The seeded bundles have no layers, so the sweep finds no blob: what is
timed is expiry and retention.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt.service.context import Context
from ckpt.service.db import make_engine, upgrade
from ckpt.service.gc.service import collect
from ckpt.service.settings import Settings
from tests.databases import throwaway_database
from tests.ui.seed import Shape, seed


def timed_pass(url: str, store: Path, *, keep_last: int | None, dry_run: bool) -> float:
    settings = Settings(
        database_url=url,
        store=str(store),
        admin_token="bench-admin-token-0123456789",
        gc_interval_seconds=0,
        keep_last=keep_last,
    )
    context = Context.create(settings)
    try:
        started = time.perf_counter()
        report = collect(context, dry_run=dry_run)
        elapsed = time.perf_counter() - started
    finally:
        context.close()
    assert not report.skipped
    print(
        f"  keep_last={keep_last}, dry_run={dry_run}: {elapsed:.2f} s "
        f"({len(report.deleted_bundles)} bundles retention would delete, "
        f"{len(report.failed_bundles)} expired)"
    )
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--runs", type=int, default=5_000)
    parser.add_argument("--bundles", type=int, default=50)
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
        timed_pass(url, store, keep_last=10, dry_run=True)
        timed_pass(url, store, keep_last=10, dry_run=True)


if __name__ == "__main__":
    main()
