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
round's requests a second and the server process's CPU time per request, and per route the
medians and ckpt ÷ floor (goal: >= 0.5). The load generator shares the cores with both
servers and PostgreSQL: compare ratios; on a busy machine the CPU time per request (of the
server process; PostgreSQL's is not counted) moves less than the rates.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet import floor_process, run_ids, setup_jobs
from ckpt.core.storage import DirectoryStore
from tests.databases import throwaway_database
from tests.server_process import ServerProcess, ckpt_server
from tests.service.helpers import register, save

Request = Callable[[httpx.Client, int], httpx.Response]
Side = tuple[str, int, Request]  # a server's URL, its process, and the request to send it


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) process ``pid`` has used (Linux: ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def closed_loop(
    side: Side, tokens: list[str], *, clients: int, seconds: float
) -> tuple[float, float]:
    """Requests a second answered 200, by ``clients`` threads sending the side's request back
    to back (any other answer stops the benchmark), and the server's CPU seconds per request."""
    url, pid, request = side
    served = [0] * clients
    start = threading.Barrier(clients + 1)
    until: list[float] = []

    def client(index: int) -> None:
        headers = {"Authorization": f"Bearer {tokens[index % len(tokens)]}"}
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
    began, cpu = time.monotonic(), cpu_seconds(pid)
    for thread in threads:
        thread.join()
    done = max(1, sum(served))
    return done / (time.monotonic() - began), (cpu_seconds(pid) - cpu) / done


def prepare(server: ServerProcess, jobs: int) -> tuple[dict[str, str], list[int]]:
    """``jobs`` runs, each with a token, an attempt and a committed bundle: the tokens by run,
    and the attempts."""
    with server.client() as admin:
        by_run = setup_jobs(admin, jobs, "steady")
    store = DirectoryStore(server.store)
    attempts = []
    for name, token in by_run.items():
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as job:
            attempt = register(job, name)
            save(job, store, name, attempt, step=1)
            attempts.append(attempt["attempt_id"])
    return by_run, attempts


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
    rates: dict[str, list[float]] = collections.defaultdict(list)
    costs: dict[str, list[float]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp, throwaway_database(args.postgres) as database:
        root = Path(tmp)
        with ckpt_server(root, database_url=database) as server:
            by_run, attempts = prepare(server, args.jobs)
            names, tokens = list(by_run), list(by_run.values())
            runs = run_ids(names, database)
            with floor_process(database, root, workers=1) as (floor, process):
                sides: dict[str, Side] = {
                    "heartbeat": (server.url, server.pid, lambda c, i: c.post(
                        f"/v1/attempts/{attempts[i]}/heartbeat", json={"step": 1, "rank": 0})),
                    "heartbeat floor": (floor, process.pid, lambda c, i: c.post(
                        f"/floor/attempts/{attempts[i]}/beat")),
                    "resumable": (server.url, server.pid, lambda c, i: c.get(
                        f"/v1/runs/{names[i]}/resumable")),
                    "resumable floor": (floor, process.pid, lambda c, i: c.get(
                        f"/floor/{runs[names[i]]}")),
                }  # fmt: skip
                for round_ in range(args.rounds):
                    for name, side in sides.items():
                        rate, cost = closed_loop(
                            side, tokens, clients=args.clients, seconds=args.seconds
                        )
                        rates[name].append(rate)
                        costs[name].append(cost)
                        print(f"round {round_ + 1}: {name:<16} {rate:8.1f} /s, "
                              f"{cost * 1e3:6.2f} CPU ms each", flush=True)  # fmt: skip
    report(args, rates, costs)


def report(
    args: argparse.Namespace, rates: dict[str, list[float]], costs: dict[str, list[float]]
) -> None:
    print(f"\n{args.clients} clients, {args.seconds:.0f} s x {args.rounds} rounds, 1 process each")
    for route in ("heartbeat", "resumable"):
        ours, floor = statistics.median(rates[route]), statistics.median(rates[f"{route} floor"])
        each = [f"{a / b:.2f}" for a, b in zip(rates[route], rates[f"{route} floor"], strict=True)]
        cpu, cpu_floor = statistics.median(costs[route]), statistics.median(costs[f"{route} floor"])
        print(f"  {route:<10} ckpt {ours:7.1f} /s, floor {floor:7.1f} /s: ckpt / floor "
              f"{ours / floor:.2f} (rounds: {', '.join(each)}); server CPU ms each: ckpt "
              f"{cpu * 1e3:.2f}, floor {cpu_floor * 1e3:.2f}: floor / ckpt {cpu_floor / cpu:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
