"""``/healthz`` or ``/resumable`` under a flood of expensive requests by one token, against
a real ``ckpt server``.

    .venv/bin/python bench/flood.py [--clients 16] [--entries 10000] [--probes 400]
                                    [--ignore-retry-after] [--postgres URL]
                                    [--probe healthz|resumable] [--mix] [--split]
                                    [--env CKPT_NAME=value ...]

One run token floods ``POST /v1/blobs/missing`` (``--entries`` blobs the store lacks, each
request) from ``--clients`` threads in a process of their own, each sending its next request
as soon as the last one is answered; a client answered 429 waits what ``Retry-After`` says,
or 10 ms with ``--ignore-retry-after`` (a hostile client). With ``--mix`` (an admin token)
each client goes round three kinds of bulk request: the blob query, the lineage of a run of
``--bundles`` bundles, and a page of 500 runs (``--runs`` are created first). Meanwhile
``GET /healthz`` (or, with ``--probe resumable``, that run's ``/resumable`` with a read token
of its own) is probed ``--probes`` times, one at a time, on its own connection. The same
probes run first with no load: the baseline, in the same run. Prints p50 / p99 of both,
their ratio, and how the flood was answered (200s and 429s).

On PostgreSQL the server serves bulk requests in a process of their own (its default,
``CKPT_BULK_PROCESS``); ``--env CKPT_BULK_PROCESS=0`` measures them served beside the probes.
With ``--split`` the flood goes to a second ``ckpt server`` on the same database and store
(the same cores too): what the probes would see if the bulk work ran in a process of its
own, with a GIL of its own.

SQLite (the embedded default) unless ``--postgres`` names a PostgreSQL server URL such as
``postgresql://postgres@127.0.0.1:5432/postgres`` (a database is created and dropped).
``--env`` passes settings to the server, e.g. ``--env CKPT_MAX_EXPENSIVE_PER_TOKEN=2``.
Timings depend on the machine: on one whose cores other work keeps busy, the tails grow.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import itertools
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt.core.storage import DirectoryStore
from tests.databases import throwaway_database
from tests.server_process import ServerProcess, ckpt_server
from tests.service.helpers import register, save

HOSTILE_PAUSE = 0.01  # seconds a client that ignores Retry-After waits after a 429
RUN = "probed"


@dataclass(frozen=True)
class Flood:
    """``clients`` threads of one token sending ``body`` to ``/v1/blobs/missing``."""

    url: str
    token: str
    clients: int
    body: bytes
    obey_retry_after: bool
    mix: tuple[str, ...] = ()  # GETs to go round with the blob query (``--mix``)

    def run(self, stop: Event, out: Queue[dict[str, int]]) -> None:
        """Flood until ``stop``; the counts of the answers by status go to ``out``."""
        answers: collections.Counter[str] = collections.Counter()
        lock = threading.Lock()

        def work() -> None:
            for status in self._requests(stop):
                with lock:
                    answers[status] += 1

        threads = [threading.Thread(target=work) for _ in range(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        out.put(dict(answers))

    def _requests(self, stop: Event) -> Iterator[str]:
        """One client's answers (a status, or the name of a transport error)."""
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=120) as client:
            for turn in itertools.count():
                if stop.is_set():
                    return
                kind = turn % (1 + len(self.mix))
                try:
                    if kind:
                        response = client.get(self.mix[kind - 1])
                    else:
                        response = client.post("/v1/blobs/missing", content=self.body)
                except httpx.HTTPError as err:
                    yield type(err).__name__
                    continue
                yield str(response.status_code)
                if response.status_code == 429:
                    told = float(response.headers.get("Retry-After", "1"))
                    stop.wait(told if self.obey_retry_after else HOSTILE_PAUSE)


@contextmanager
def flooding(flood: Flood) -> Iterator[dict[str, int]]:
    """The flood in a child process (its threads must not slow the probe's) while the block
    runs; yields the counts of its answers by status, filled in when the block ends."""
    context = multiprocessing.get_context("fork")
    stop, out = context.Event(), context.Queue()
    process = context.Process(target=flood.run, args=(stop, out))
    process.start()
    answers: dict[str, int] = {}
    try:
        yield answers
    finally:
        stop.set()
        answers.update(out.get(timeout=300))
        process.join(60)


@dataclass(frozen=True)
class Probe:
    """What is timed: a GET of ``path``, with ``token`` if any."""

    path: str = "/healthz"
    token: str | None = None


def probe(url: str, count: int, what: Probe) -> list[float]:
    """``count`` sequential latencies of ``what``, in seconds, on one connection."""
    samples = []
    headers = {"Authorization": f"Bearer {what.token}"} if what.token else {}
    with httpx.Client(base_url=url, timeout=60, headers=headers) as client:
        client.get(what.path).raise_for_status()  # connect first: time requests, not dials
        for _ in range(count):
            started = time.perf_counter()
            client.get(what.path).raise_for_status()
            samples.append(time.perf_counter() - started)
            time.sleep(0.005)  # a probe every few ms, not a busy loop of our own
    return samples


def flood_body(entries: int) -> bytes:
    """A ``blobs/missing`` query for ``entries`` blobs no store holds, encoded once."""
    blobs = [
        {"sha256": hashlib.sha256(f"flood-{i}".encode()).hexdigest(), "size": 1 + i}
        for i in range(entries)
    ]
    return json.dumps({"blobs": blobs}).encode()


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[max(0, int(len(ordered) * 0.99) - 1)]


def new_token(server: ServerProcess, **body: str) -> str:
    with server.client() as client:
        response = client.post("/v1/tokens", json=body)
        response.raise_for_status()
        token: str = response.json()["token"]
        return token


def populate(client: httpx.Client, store: DirectoryStore, run: str, bundles: int) -> None:
    """``bundles`` complete bundles of ``run``, a preemption every 50."""
    attempt = register(client, run)
    for step in range(1, bundles + 1):
        if step % 50 == 0:
            attempt = register(client, run)
        save(client, store, run, attempt, step=step)


def prepare(server: ServerProcess, args: argparse.Namespace) -> tuple[Probe, tuple[str, ...]]:
    """The run to probe and flood (``--bundles`` bundles) and ``--runs`` runs to page
    through, with ``--mix``; the probe, and the GETs the flood goes round."""
    if args.probe == "healthz" and not args.mix:
        return Probe(), ()
    store = DirectoryStore(server.store)
    with server.client() as admin:
        populate(admin, store, RUN, args.bundles)
        for i in range(args.runs if args.mix else 0):
            admin.post("/v1/runs", json={"name": f"page-{i:04}"}).raise_for_status()
    what = Probe()
    if args.probe == "resumable":
        reader = new_token(server, role="read", name="scheduler")
        what = Probe(path=f"/v1/runs/{RUN}/resumable", token=reader)
    mix = (f"/v1/runs/{RUN}/lineage", "/v1/runs?limit=500") if args.mix else ()
    return what, mix


def measure(label: str, root: Path, database_url: str | None, args: argparse.Namespace) -> None:
    root.mkdir(parents=True)
    env = dict(item.split("=", 1) for item in args.env)
    with contextlib.ExitStack() as servers:
        server = servers.enter_context(ckpt_server(root, database_url=database_url, env=env))
        flooded = server
        if args.split:
            (root / "split").mkdir()
            flooded = servers.enter_context(
                ckpt_server(root / "split", database_url=database_url, env=env, store=server.store)
            )
        what, mix = prepare(server, args)
        token = (
            new_token(server, role="admin", name="flood")
            if mix
            else new_token(server, role="run", run="flood", name="flood")
        )
        flood = Flood(
            url=flooded.url,
            token=token,
            clients=args.clients,
            body=flood_body(args.entries),
            obey_retry_after=not args.ignore_retry_after,
            mix=mix,
        )
        quiet = probe(server.url, args.probes, what)
        started = time.perf_counter()
        with flooding(flood) as answers:
            time.sleep(1.0)  # let the flood build up
            loaded = probe(server.url, args.probes, what)
        elapsed = time.perf_counter() - started
    report(label, args, quiet=quiet, loaded=loaded, answers=answers, elapsed=elapsed)


def report(
    label: str,
    args: argparse.Namespace,
    *,
    quiet: list[float],
    loaded: list[float],
    answers: dict[str, int],
    elapsed: float,
) -> None:
    (q50, q99), (l50, l99) = percentiles(quiet), percentiles(loaded)
    manners = "ignoring Retry-After" if args.ignore_retry_after else "obeying Retry-After"
    kinds = ", lineages, 500-run pages" if args.mix else ""
    kinds += ", sent to a second server (--split)" if args.split else ""
    print(
        f"\n{label}: {args.clients} clients of one token, blobs/missing of {args.entries} "
        f"entries{kinds}, {manners}"
    )
    print(f"  {'GET /' + args.probe:<22} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"  {'unloaded':<22} {q50 * 1e3:8.2f} {q99 * 1e3:8.2f}")
    print(f"  {'under the flood':<22} {l50 * 1e3:8.2f} {l99 * 1e3:8.2f}")
    print(f"  {'ratio':<22} {l50 / q50:8.1f} {l99 / q99:8.1f}")
    shown = ", ".join(f"{status}: {count}" for status, count in sorted(answers.items()))
    print(f"  the flood in {elapsed:.1f} s: {sum(answers.values())} answers ({shown})")
    print(f"  p99 under the flood {'<=' if l99 <= 0.050 else '>'} 50 ms")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--probes", type=int, default=400)
    parser.add_argument("--ignore-retry-after", action="store_true", help="a hostile flood")
    parser.add_argument("--postgres", help="a PostgreSQL server URL to flood instead of SQLite")
    parser.add_argument("--env", action="append", default=[], help="NAME=value for the server")
    parser.add_argument("--probe", choices=("healthz", "resumable"), default="healthz")
    parser.add_argument("--mix", action="store_true", help="lineages and 500-run pages too")
    parser.add_argument("--bundles", type=int, default=100, help="of the probed run")
    parser.add_argument("--runs", type=int, default=500, help="to page through, with --mix")
    parser.add_argument("--split", action="store_true", help="flood a second server instead")
    args = parser.parse_args()
    if not args.postgres:
        with tempfile.TemporaryDirectory() as tmp:
            measure("SQLite (embedded)", Path(tmp) / "sqlite", None, args)
        return
    with throwaway_database(args.postgres) as url, tempfile.TemporaryDirectory() as tmp:
        measure("PostgreSQL", Path(tmp) / "pg", url, args)


if __name__ == "__main__":
    main()
