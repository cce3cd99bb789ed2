"""The fleet's steady load, as throughput: heartbeats and ``/resumable`` a second that one
``ckpt server`` process serves on PostgreSQL, beside the floor (``bench/floor.py``: a bare
FastAPI + SQLAlchemy primary-key UPDATE of an attempt, and SELECT of a run) served by one
uvicorn process on the same database.

    .venv/bin/python bench/steady.py [--jobs 20] [--clients 8] [--seconds 10] [--rounds 3]
        [--postgres URL]

``--jobs`` runs, each with an attempt and one committed bundle (so ``/resumable`` answers
200), and a run token. ``--clients`` threads then send requests back to back (a closed
loop, each its own keep-alive connection) for ``--seconds``: heartbeats as the agent sends
them (``{"step", "rank"}``) to ckpt, then the UPDATE to the floor, then ``/resumable`` to
ckpt, then the SELECT to the floor; ``--rounds`` times, interleaved, so that a change in the
machine's load touches both sides alike. Both servers stay up throughout. It prints each
round's requests a second and, per route, the medians and ckpt ÷ floor (goal: >= 0.5). The
load generator shares the cores with both servers and PostgreSQL: compare ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet import floor_app, run_ids, setup_jobs
from ckpt.core.storage import DirectoryStore
from tests.databases import throwaway_database
from tests.server_process import ckpt_server
from tests.service.helpers import register, save

Request = Callable[[httpx.Client, int], httpx.Response]


def closed_loop(
    url: str, tokens: list[str], request: Request, *, clients: int, seconds: float
) -> float:
    """Requests a second answered 200, by ``clients`` threads sending ``request`` back to back;
    any other answer stops the benchmark."""
    served = [0] * clients
    start = threading.Barrier(clients + 1)
    until: list[float] = []

    def client(index: int) -> None:
        token = tokens[index % len(tokens)]
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            request(http, index % len(tokens)).raise_for_status()  # the connection, warm
            start.wait()
            while time.monotonic() < until[0]:
                request(http, index % len(tokens)).raise_for_status()
                served[index] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    until.append(time.monotonic() + seconds)
    start.wait()
    began = time.monotonic()
    for thread in threads:
        thread.join()
    return sum(served) / (time.monotonic() - began)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, throwaway_database(args.postgres) as database:
        root = Path(tmp)
        with ckpt_server(root, database_url=database) as server:
            with server.client() as admin:
                by_run = setup_jobs(admin, args.jobs, "steady")
            names, tokens = list(by_run), list(by_run.values())
            store = DirectoryStore(server.store)
            attempts = []
            for name, token in by_run.items():
                headers = {"Authorization": f"Bearer {token}"}
                with httpx.Client(base_url=server.url, headers=headers, timeout=60) as job:
                    attempt = register(job, name)
                    save(job, store, name, attempt, step=1)
                    attempts.append(attempt["attempt_id"])
            runs = run_ids(names, database)
            with floor_app(database, root, workers=1) as floor:
                sides: dict[str, tuple[str, Request]] = {
                    "heartbeat": (server.url, lambda c, i: c.post(
                        f"/v1/attempts/{attempts[i]}/heartbeat", json={"step": 1, "rank": 0})),
                    "heartbeat floor": (floor, lambda c, i: c.post(
                        f"/floor/attempts/{attempts[i]}/beat")),
                    "resumable": (server.url, lambda c, i: c.get(f"/v1/runs/{names[i]}/resumable")),
                    "resumable floor": (floor, lambda c, i: c.get(f"/floor/{runs[names[i]]}")),
                }  # fmt: skip
                rates: dict[str, list[float]] = {side: [] for side in sides}
                for round_ in range(args.rounds):
                    for side, (url, request) in sides.items():
                        rate = closed_loop(
                            url, tokens, request, clients=args.clients, seconds=args.seconds
                        )
                        rates[side].append(rate)
                        print(f"round {round_ + 1}: {side:<16} {rate:8.1f} /s", flush=True)
    print(f"\n{args.clients} clients, {args.seconds:.0f} s x {args.rounds} rounds, 1 process each")
    for route in ("heartbeat", "resumable"):
        ours, floor_rate = (
            statistics.median(rates[route]),
            statistics.median(rates[f"{route} floor"]),
        )
        each = [f"{a / b:.2f}" for a, b in zip(rates[route], rates[f"{route} floor"], strict=True)]
        print(f"  {route:<10} ckpt {ours:8.1f} /s  floor {floor_rate:8.1f} /s  "
              f"ckpt / floor {ours / floor_rate:.2f} (rounds: {', '.join(each)})")  # fmt: skip


if __name__ == "__main__":
    main()
