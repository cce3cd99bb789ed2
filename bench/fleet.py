"""A fleet of training jobs against a real ``ckpt server`` on PostgreSQL, beside the floor.

    .venv/bin/python bench/fleet.py [--jobs 10 20] [--ranks 4] [--workers 1 2]
        [--seconds 60] [--heartbeat 5] [--save-every 10] [--wave 0.2] [--postgres URL]

``--jobs`` jobs of ``--ranks`` ranks each, one thread and one run token per job, run for
``--seconds``: each registers an attempt and asks ``/resumable`` (a start), heartbeats every
``--heartbeat`` seconds, and saves every ``--save-every`` seconds the way the agent does
(the coordinating rank opens the bundle; per rank: ``/v1/blobs/missing`` and one record of
its six layers, of new blobs put in the store; then the commit). Halfway, a preemption wave:
``--wave`` of the jobs (20%) restart at random times within ``--wave-spread`` seconds (a
minute), each registering a new attempt and asking ``/resumable``. Each job starts at a
random offset, so cadences do not line up.

The same fleet then runs against the floor (``bench/floor.py``): a minimal FastAPI +
SQLAlchemy app, as many processes, on the same database, where every request of the fleet
is one primary-key SELECT of the job's run. Per route, p50 / p99 of both and their ratio
(ckpt / floor), requests served a second and errors (transport errors and 5xx; the 404 of a
first ``/resumable`` is an answer). The floor is up throughout: while the fleet runs
against ckpt, each heartbeat and ``/resumable`` is followed at once by the floor's SELECT
of the job's run, and the two are compared too (the same moments, the same load on the
machine: what ckpt adds to what that load costs any server). For each ``--workers``
(``CKPT_WORKERS``, ``ckpt server --workers``; the floor gets as many uvicorn workers).
The generator shares the machine's cores with the server and PostgreSQL: on a busy machine
compare ratios, not milliseconds.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt.core.contract import RESTORE_ORDER
from ckpt.core.storage import DirectoryStore
from service.settings import KEEP_ALIVE_SECONDS
from tests.databases import throwaway_database
from tests.server_process import ckpt_server, free_port, serving
from tests.service.helpers import VERSIONS, make_layer

ROUTES = ("register", "resumable", "heartbeat", "blobs/missing", "open", "record", "commit")
# Each of ckpt's requests of these routes is followed at once by the floor's SELECT, counted
# as "floor beside ROUTE".
PAIRED = ("resumable", "heartbeat")
BESIDE = "floor beside"


@dataclass
class Figures:
    """Latencies (seconds) and errors by route, of one phase."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    why: collections.Counter[str] = field(default_factory=collections.Counter)
    said: dict[str, str] = field(default_factory=dict)  # the first message of each kind
    lock: threading.Lock = field(default_factory=threading.Lock)
    seconds: float = 0.0

    def add(self, route: str, took: float, *, failed: str | None, said: str = "") -> None:
        """One request's time; ``failed``: its status or error, when it failed (``said``:
        what the answer said)."""
        with self.lock:
            self.latencies[route].append(took)
            if failed:
                self.errors[route] += 1
                self.why[f"{route} {failed}"] += 1
                self.said.setdefault(f"{route} {failed}", said[:160])

    def served(self) -> int:
        """The fleet's requests answered (the floor's beside them not counted)."""
        ours = [route for route in self.latencies if not route.startswith(BESIDE)]
        return sum(len(self.latencies[route]) - self.errors[route] for route in ours)

    def failed(self) -> int:
        """The fleet's requests not answered (the floor's beside them not counted)."""
        return sum(n for route, n in self.errors.items() if not route.startswith(BESIDE))


@dataclass(frozen=True)
class Plan:
    """The fleet's shape and cadences."""

    jobs: int
    ranks: int
    seconds: float
    heartbeat: float
    save_every: float
    wave: float
    wave_spread: float


class Caller:
    """One job's requests: to ckpt, or (``floor``) each as the floor's primary-key SELECT."""

    def __init__(
        self, client: httpx.Client, figures: Figures, *, floor_id: int | None = None
    ) -> None:
        self.client, self.figures, self.floor_id = client, figures, floor_id

    def __call__(self, route: str, method: str, path: str, body: Any = None) -> httpx.Response:
        started = time.perf_counter()
        try:
            if self.floor_id is not None:
                response = self.client.get(f"/floor/{self.floor_id}")
            else:
                response = self.client.request(method, path, json=body)
        except httpx.HTTPError as err:
            self.figures.add(route, time.perf_counter() - started, failed=type(err).__name__)
            raise
        status = response.status_code
        failed = status >= 500 or (status >= 400 and route != "resumable")
        took = time.perf_counter() - started
        said = response.text if failed else ""
        self.figures.add(route, took, failed=str(status) if failed else None, said=said)
        return response


class Job:
    """One training job of ``ranks`` ranks, as its agents talk to the control plane."""

    def __init__(
        self, name: str, call: Caller, store: DirectoryStore, plan: Plan, beside: Caller | None
    ) -> None:
        self.name, self.call, self.store, self.plan = name, call, store, plan
        self.beside = beside  # the floor, asked right after each request of PAIRED
        self.step = 0
        self.attempt: dict[str, Any] = {"attempt_id": 0, "epoch": 0}

    def start(self) -> None:
        """A (re)start: register an attempt, ask where to resume."""
        response = self.call("register", "POST", f"/v1/runs/{self.name}/attempts", {})
        if self.call.floor_id is None:
            self.attempt = response.json()
        self.call("resumable", "GET", f"/v1/runs/{self.name}/resumable")
        self._then_the_floor("resumable")

    def heartbeat(self) -> None:
        path = f"/v1/attempts/{self.attempt['attempt_id']}/heartbeat"
        self.call("heartbeat", "POST", path, {"step": self.step})
        self._then_the_floor("heartbeat")

    def _then_the_floor(self, route: str) -> None:
        if self.beside is not None:
            self.beside(f"{BESIDE} {route}", "GET", "")

    def save(self) -> None:
        """As the agent saves: the bundle opened, then each rank's blobs asked about and
        written (after the open: a run token's commit counts only blobs written since),
        then each rank's layers recorded, then the commit."""
        self.step += 10
        real = self.call.floor_id is None
        opened = self.call("open", "POST", f"/v1/runs/{self.name}/bundles", self._open_body())
        bundle = opened.json()["id"] if real else 0
        records = [
            [make_layer(self.store, upload=real)[0] for _ in RESTORE_ORDER]
            for _ in range(self.plan.ranks)
        ]
        for layers in records:
            blobs = [blob.model_dump(mode="json") for rec in layers for blob in rec.blobs]
            self.call("blobs/missing", "POST", "/v1/blobs/missing", {"blobs": blobs})
        epoch = self.attempt["epoch"]
        for rank, layers in enumerate(records):  # every layer of a rank in one request
            body = {
                "epoch": epoch,
                "layers": {
                    layer.value: rec.model_dump(mode="json")
                    for layer, rec in zip(RESTORE_ORDER, layers, strict=True)
                },
            }
            self.call("record", "POST", f"/v1/bundles/{bundle}/layers/{rank}", body)
        self.call("commit", "POST", f"/v1/bundles/{bundle}/commit", {"epoch": epoch})

    def _open_body(self) -> dict[str, Any]:
        return {
            "attempt_id": self.attempt["attempt_id"],
            "epoch": self.attempt["epoch"],
            "step": self.step,
            "world_size": self.plan.ranks,
            "versions": VERSIONS,
        }

    def run(self, *, until: float, preempt_at: float | None, rng: random.Random) -> None:
        """Until ``until`` (monotonic): beats and saves on their cadences, a restart at
        ``preempt_at``."""
        self.start()
        beat = time.monotonic() + rng.uniform(0, self.plan.heartbeat)
        save = time.monotonic() + rng.uniform(0, self.plan.save_every)
        while (now := time.monotonic()) < until:
            due = min(beat, save, preempt_at or until, until)
            if due > now:
                time.sleep(due - now)
                continue
            try:
                if preempt_at is not None and now >= preempt_at:
                    preempt_at = None
                    self.start()
                elif beat <= now:
                    beat += self.plan.heartbeat
                    self.heartbeat()
                else:
                    save += self.plan.save_every
                    self.save()
            except (httpx.HTTPError, KeyError, ValueError):
                continue  # counted as an error; the job goes on


def drive(url: str, tokens: dict[str, str], store: DirectoryStore, plan: Plan, *,
          floor_ids: dict[str, int], beside: str | None = None) -> Figures:  # fmt: skip
    """The fleet against ``url`` for ``plan.seconds``: ckpt, with the floor at ``beside``
    asked right after each heartbeat (the same moment's load), or the floor itself."""
    figures, rng = Figures(), random.Random(0)
    names = sorted(tokens)
    waved = set(rng.sample(names, round(plan.wave * len(names))))
    started = time.monotonic()
    until = started + plan.seconds
    wave_at = started + max(0.0, plan.seconds / 2 - plan.wave_spread / 2)
    threads, clients = [], []
    for name in names:
        headers = {"Authorization": f"Bearer {tokens[name]}"}
        client = httpx.Client(base_url=url, headers=headers, timeout=60)
        call = Caller(client, figures, floor_id=None if beside else floor_ids[name])
        near = None
        if beside:
            floor_client = httpx.Client(base_url=beside, timeout=60)
            near = Caller(floor_client, figures, floor_id=floor_ids[name])
            clients.append(floor_client)
        preempt = wave_at + rng.uniform(0, plan.wave_spread) if name in waved else None
        job = Job(name, call, store, plan, near)
        seed = random.Random(rng.random())
        thread = threading.Thread(
            target=job.run, kwargs={"until": until, "preempt_at": preempt, "rng": seed}
        )
        threads.append(thread)
        clients.append(client)
        thread.start()
    for thread in threads:
        thread.join()
    for client in clients:
        client.close()
    figures.seconds = time.monotonic() - started
    return figures


@contextmanager
def floor_app(database_url: str, root: Path, *, workers: int) -> Iterator[str]:
    """``bench/floor.py`` served by uvicorn with ``workers`` processes; yields its URL."""
    with floor_process(database_url, root, workers=workers) as (url, _):
        yield url


@contextmanager
def floor_process(
    database_url: str, root: Path, *, workers: int
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``floor_app``, yielding its process too."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "floor:app",
        "--app-dir",
        str(Path(__file__).parent),
    ]
    command += ["--port", str(port), "--workers", str(workers), "--log-level", "warning"]
    # as ckpt server keeps them: a client idle 5 s (a heartbeat's cadence) would race
    # uvicorn's default of 5 s (service.settings)
    command += ["--timeout-keep-alive", str(KEEP_ALIVE_SECONDS)]
    env = {**os.environ, "FLOOR_DATABASE_URL": database_url}
    with serving(command, env=env, cwd=root, log=root / "floor.log", url=url) as process:
        yield url, process


def setup_jobs(admin: httpx.Client, jobs: int, tag: str) -> dict[str, str]:
    """A run and a run token per job: the tokens, by run."""
    tokens = {}
    for i in range(jobs):
        name = f"fleet-{tag}-{i:04}"
        admin.post("/v1/runs", json={"name": name}).raise_for_status()
        body = {"role": "run", "run": name, "name": name}
        created = admin.post("/v1/tokens", json=body)
        created.raise_for_status()
        tokens[name] = created.json()["token"]
    return tokens


def run_ids(names: list[str], database_url: str) -> dict[str, int]:
    """The runs' primary keys, read from the database the floor selects from."""
    import psycopg

    plain = database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain) as connection:
        rows = connection.execute("SELECT name, id FROM run WHERE name = ANY(%s)", (names,))
        return {name: run_id for name, run_id in rows}


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    if not ordered:
        return float("nan"), float("nan")
    return statistics.median(ordered), ordered[math.ceil(len(ordered) * 0.99) - 1]


def report(workers: int, plan: Plan, ckpt: Figures, floor: Figures) -> None:
    print(
        f"\n{workers} worker(s), {plan.jobs} jobs x {plan.ranks} ranks, {plan.seconds:.0f} s: "
        f"ckpt served {ckpt.served() / ckpt.seconds:.1f} requests/s "
        f"({ckpt.failed()} errors), the floor {floor.served() / floor.seconds:.1f}"
    )
    print(f"  {'route':<14} {'requests':>8} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8}"
          f" {'floor p50':>9} {'floor p99':>9} {'x p50':>6} {'x p99':>6}")  # fmt: skip
    for route in ROUTES:
        samples = ckpt.latencies.get(route, [])
        (c50, c99), (f50, f99) = percentiles(samples), percentiles(floor.latencies.get(route, []))
        print(
            f"  {route:<14} {len(samples):>8} {ckpt.errors[route]:>6} {c50 * 1e3:8.1f} "
            f"{c99 * 1e3:8.1f} {f50 * 1e3:9.1f} {f99 * 1e3:9.1f} {c50 / f50:6.1f} {c99 / f99:6.1f}"
        )
    for route in PAIRED:
        (c50, c99), (b50, b99) = (
            percentiles(ckpt.latencies[route]),
            percentiles(ckpt.latencies[f"{BESIDE} {route}"]),
        )
        print(f"  {route} beside the floor's SELECT sent right after it (the same load): "
              f"{c50 * 1e3:.1f} / {c99 * 1e3:.1f} ms against {b50 * 1e3:.1f} / {b99 * 1e3:.1f} "
              f"(p50 / p99): x {c50 / b50:.1f} / {c99 / b99:.1f}")  # fmt: skip
    if ckpt.why:
        for what, n in sorted(ckpt.why.items()):
            print(f"  errors: {what} x {n}, the first: {ckpt.said[what]}")
    worst = max(percentiles(ckpt.latencies.get(r, []))[1] for r in ("resumable", "heartbeat"))
    print(f"  /resumable and heartbeat p99 {'<=' if worst <= 0.100 else '>'} 100 ms")


def measure(database_url: str, root: Path, plan: Plan, *, workers: int) -> None:
    env = {"CKPT_WORKERS": str(workers)}
    here = root / f"w{workers}-{plan.jobs}"
    here.mkdir()
    with floor_app(database_url, here, workers=workers) as url:
        with ckpt_server(here, database_url=database_url, env=env) as server:
            store = DirectoryStore(server.store)
            with server.client() as admin:
                tokens = setup_jobs(admin, plan.jobs, f"w{workers}j{plan.jobs}")
            ids = run_ids(list(tokens), database_url)
            ckpt = drive(server.url, tokens, store, plan, floor_ids=ids, beside=url)
        floor = drive(url, tokens, store, plan, floor_ids=ids)
    report(workers, plan, ckpt, floor)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--jobs", type=int, nargs="+", default=[10, 20])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--heartbeat", type=float, default=5.0)
    parser.add_argument("--save-every", type=float, default=10.0)
    parser.add_argument("--wave", type=float, default=0.2, help="share of jobs preempted")
    parser.add_argument("--wave-spread", type=float, default=60.0)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            for jobs in args.jobs:
                plan = Plan(
                    jobs=jobs,
                    ranks=args.ranks,
                    seconds=args.seconds,
                    heartbeat=args.heartbeat,
                    save_every=args.save_every,
                    wave=args.wave,
                    wave_spread=min(args.wave_spread, args.seconds / 2),
                )
                with throwaway_database(args.postgres) as url:
                    measure(url, Path(tmp), plan, workers=workers)


if __name__ == "__main__":
    main()
