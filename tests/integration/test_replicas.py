"""Two control-plane replicas as deployed: one PostgreSQL catalog, one store, trainers spread
over both, and one replica SIGKILLed and restarted again and again while the other serves
(issue 11's acceptance, "two replicas, as deployed").

The campaign: two runs of the demo job train in segments, each segment a new trainer
process (with a run token) that resumes its run through the replica the previous segment
did not use; every third segment SIGKILLs itself in the middle of a step. Meanwhile the
chaos loop SIGKILLs replica a, then b, then a...: each kill waits until the trainers have
committed a bundle since the kill before, then, in turn, for nothing more, for the victim
to be in a GC or scrub pass, in a trainer's save, or in its commit; then it restarts the
victim (``ckpt migrate`` ran once; the servers do not migrate) and waits on its
``/readyz``. Both replicas collect garbage (retention keeps 3 bundles a run; unreferenced
blobs go after 5 s) and scrub every half second. Once the kills are done every run trains
one last segment, to one common step.

Then: every complete bundle's blobs are in the store with their size and SHA-256 and
nothing was ever quarantined; no two passes of one task overlapped in time (a pass cut
short by its replica's death ends at the kill) and both replicas ran passes of both tasks;
every run's final state is bit-exact against one uninterrupted run of the job; no trainer
was answered a 5xx, and no replica logged an error."""

from __future__ import annotations

import enum
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.orm import Session

from agent.demo.compare import differences
from ckpt.core import contract
from ckpt.core.storage import open_store
from ckpt.core.verify import verify
from service.models import Bundle, BundleStatus, Layer, MaintenancePass, Run
from tests.conftest import run_trainer
from tests.server_process import TOKEN, free_port, serving
from tests.service.conftest import create_pg_database, drop_pg_database

pytestmark = pytest.mark.slow

KILLS = 50  # replica SIGKILLs in the campaign
CAMPAIGN_SECONDS = 600  # the bound on the chaos loop: 4-6 minutes on a busy 2-core machine
RUNS = ("run-a", "run-b")
SEGMENT_STEPS = 8  # optimizer steps a trainer process trains before it exits
TOTAL_STEPS = ("--total-steps", "100000")  # the LR schedule: the same for every process
TRAINER_ARGS = ("--every", "1", "--workers", "0")
SERVER_ENV = {
    "CKPT_ADMIN_TOKEN": TOKEN,
    "CKPT_AUTO_MIGRATE": "0",  # `ckpt migrate` ran once, as the migrations Job does
    "CKPT_GC_INTERVAL_SECONDS": "0.5",
    "CKPT_SCRUB_INTERVAL_SECONDS": "0.5",
    "CKPT_SCRUB_BYTES_PER_SECOND": "0",
    "CKPT_KEEP_LAST": "3",
    "CKPT_BLOB_GRACE_SECONDS": "5",
}
AGENT_ENV = {"CKPT_HEARTBEAT_SECONDS": "1"}


@dataclass
class Incarnation:
    """One process of a replica."""

    pid: int
    log: Path
    killed_at: datetime | None = None  # just before its SIGKILL

    @property
    def holder(self) -> str:
        """How ``maintenance_pass.holder`` names it."""
        return f"{socket.gethostname()}:{self.pid}"


@dataclass
class Replica:
    """``ckpt server`` on a fixed port, over the shared catalog and store."""

    name: str
    root: Path
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    incarnations: list[Incarnation] = field(default_factory=list)
    _stack: ExitStack | None = None
    _process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start a new process and wait until its ``/readyz`` answers 200."""
        stack = ExitStack()
        log = self.root / f"replica-{self.name}.{len(self.incarnations)}.log"
        command = [sys.executable, "-m", "ckpt", "server", "--port", str(self.port)]
        self._process = stack.enter_context(
            serving(command, env=self.env, cwd=self.root, log=log, url=self.url)
        )
        self._stack = stack
        self.incarnations.append(Incarnation(pid=self._process.pid, log=log))

    def kill(self) -> None:
        assert self._process is not None and self._stack is not None
        self.incarnations[-1].killed_at = datetime.now(UTC)
        os.kill(self._process.pid, signal.SIGKILL)
        self._process.wait()
        self._stack.close()

    def stop(self) -> None:
        """SIGTERM: the server lets a maintenance pass in flight finish."""
        if self._stack is not None:
            self._stack.close()


@dataclass
class Segment:
    """One trainer process of a run."""

    replica: str
    steps: int
    kill_at: str | None
    log: Path
    out: Path
    returncode: int | None = None

    @property
    def output(self) -> str:
        return self.log.read_text()


@dataclass
class Lane:
    """A run, trained in segments, each through the replica the previous one did not use."""

    run: str
    token: str
    first_replica: int
    segments: list[Segment] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return self.segments[-1].steps if self.segments else 0


class Campaign:
    """The replicas, the lanes, the catalog and the store of one campaign."""

    def __init__(self, root: Path, database_url: str) -> None:
        self.root = root
        self.store = str(root / "store")
        self.database_url = database_url
        env = {**os.environ, **SERVER_ENV, "CKPT_DATABASE_URL": database_url}
        env["CKPT_STORE"] = self.store
        self.replicas = [Replica(name, root, env) for name in ("a", "b")]
        self.engine: Engine = create_engine(database_url)
        self.failed = threading.Event()  # a lane failed: stop the campaign
        self.failures: list[str] = []
        self.calm = threading.Event()  # the kills are done
        self.lanes: list[Lane] = []

    def segment(self, lane: Lane, *, steps: int, kill_at: str | None) -> Segment:
        """Train ``lane``'s run to ``steps`` in a new process (it resumes first)."""
        index = len(lane.segments)
        replica = self.replicas[(lane.first_replica + index) % 2]
        segment = Segment(
            replica=replica.name,
            steps=steps,
            kill_at=kill_at,
            log=self.root / f"{lane.run}.{index}.log",
            out=self.root / f"{lane.run}.{index}.pt",
        )
        lane.segments.append(segment)
        kill = ("--kill-at", kill_at) if kill_at else ()
        command = [
            *(sys.executable, "-m", "agent.demo.train", "--store", self.store),
            *("--run", lane.run, "--out", str(segment.out), "--steps", str(steps)),
            *TOTAL_STEPS,
            *TRAINER_ARGS,
            *kill,
        ]
        env = {**os.environ, **AGENT_ENV, "CKPT_SERVER": replica.url, "CKPT_TOKEN": lane.token}
        with segment.log.open("w") as log:
            try:
                done = subprocess.run(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=600,
                    check=False,
                )
                segment.returncode = done.returncode
            except subprocess.TimeoutExpired:
                pass  # killed by run(); returncode stays None
        expected = -signal.SIGKILL if kill_at else 0
        if segment.returncode != expected:
            ended = "hung" if segment.returncode is None else f"exited {segment.returncode}"
            self.failures.append(
                f"{lane.run} segment {index} (to step {steps} through replica {replica.name}"
                f"{', killed at ' + kill_at if kill_at else ''}) {ended}:\n"
                + segment.output[-4000:]
            )
            self.failed.set()
        return segment

    def train_until_calm(self, lane: Lane) -> None:
        """Segments of ``SEGMENT_STEPS`` until the kills are done; every third one SIGKILLs
        itself mid-step, half a segment in."""
        while not (self.calm.is_set() or self.failed.is_set()):
            steps = lane.steps + SEGMENT_STEPS
            killed = len(lane.segments) % 3 == 2
            self.segment(
                lane, steps=steps, kill_at=f"{steps - SEGMENT_STEPS // 2}.2" if killed else None
            )

    # The catalog, read directly.

    def committed(self) -> int:
        with Session(self.engine) as session:
            found = session.scalar(
                text("SELECT count(*) FROM bundle WHERE committed_at IS NOT NULL")
            )
            return int(found or 0)

    def committed_more_than(self, count: int) -> bool:
        return self.committed() > count

    def in_pass(self, replica: Replica) -> bool:
        """Whether the replica's process is in a GC or scrub pass."""
        holder = replica.incarnations[-1].holder
        with Session(self.engine) as session:
            found = session.scalar(
                select(MaintenancePass.id).where(
                    MaintenancePass.holder == holder, MaintenancePass.ended_at.is_(None)
                )
            )
            return found is not None

    def saving_through(self, replica: Replica, *, since: datetime, recorded: int) -> bool:
        """Whether a trainer using the replica has a bundle pending, opened since ``since``,
        with at least ``recorded`` layers recorded."""
        runs = [
            lane.run
            for lane in self.lanes
            if lane.segments and lane.segments[-1].replica == replica.name
        ]
        layers = select(func.count(Layer.id)).where(Layer.bundle_id == Bundle.id)
        with Session(self.engine) as session:
            found = session.scalar(
                select(Bundle.id)
                .join(Run, Run.id == Bundle.run_id)
                .where(
                    Bundle.status == BundleStatus.PENDING,
                    Bundle.created_at > since,
                    Run.name.in_(runs),
                    layers.scalar_subquery() >= recorded,
                )
                .limit(1)
            )
            return found is not None

    def wait_for(self, condition: Callable[[], bool], *, seconds: float) -> bool:
        """Poll ``condition`` until it holds (True) or ``seconds`` pass (False); stop the
        campaign when a trainer failed."""
        until = time.monotonic() + seconds
        while not condition():
            if self.failed.is_set():
                raise AssertionError("a trainer failed:\n" + "\n".join(self.failures))
            if time.monotonic() > until:
                return False
            time.sleep(0.02)
        return True

    def chaos(self, deadline: float) -> Chaos:
        """SIGKILL replica a, b, a, ... ``KILLS`` times and restart it (waiting on its
        ``/readyz``). Each kill waits until the trainers committed a bundle since the kill
        before, then, in turn, for nothing more, or (5 s at most) for the victim to be in
        a maintenance pass, in a save, or in a commit."""
        chaos = Chaos()
        committed_before = self.committed()
        killed_at = datetime.now(UTC)
        for kill in range(KILLS):
            victim = self.replicas[kill % 2]
            with chaos.timing("waiting for progress"):
                progressed = self.wait_for(
                    functools.partial(self.committed_more_than, committed_before),
                    seconds=deadline - time.monotonic(),
                )
            assert progressed, f"the trainers committed nothing for {CAMPAIGN_SECONDS} s"
            moment = list(Moment)[kill % len(Moment)]
            with chaos.timing(f"waiting for a kill {moment}"):
                hit = self.wait_for(self._at(moment, victim, since=killed_at), seconds=5)
            chaos.hits[moment] = chaos.hits.get(moment, 0) + hit
            committed_before = self.committed()
            killed_at = datetime.now(UTC)
            with chaos.timing("restarting"):
                victim.kill()
                victim.start()
            assert time.monotonic() < deadline, f"{kill + 1} kills took over {CAMPAIGN_SECONDS} s"
        return chaos

    def _at(self, moment: Moment, victim: Replica, *, since: datetime) -> Callable[[], bool]:
        if moment is Moment.IN_A_PASS:
            return functools.partial(self.in_pass, victim)
        if moment is Moment.IN_A_SAVE:
            return functools.partial(self.saving_through, victim, since=since, recorded=0)
        if moment is Moment.IN_A_COMMIT:
            every_layer = len(contract.Layer)
            return functools.partial(self.saving_through, victim, since=since, recorded=every_layer)
        return lambda: True


class Moment(enum.StrEnum):
    """When the chaos loop kills a replica, in turn."""

    AFTER_A_COMMIT = "after a commit"
    IN_A_PASS = "in a maintenance pass"  # the victim holds the GC or the scrub lock
    IN_A_SAVE = "in a save"  # a trainer using it has opened a bundle
    IN_A_COMMIT = "in a commit"  # ... and recorded every layer of it


@dataclass
class Chaos:
    """What the chaos loop did: how many kills hit their moment (the others came after
    waiting 5 s for it), and where its time went (seconds)."""

    hits: dict[Moment, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timing(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[what] = self.seconds.get(what, 0.0) + time.monotonic() - started


@pytest.fixture
def campaign(tmp_path: Path) -> Iterator[Campaign]:
    url = create_pg_database()
    env = {**os.environ, "CKPT_DATABASE_URL": url}
    subprocess.run([sys.executable, "-m", "ckpt", "migrate"], env=env, check=True, timeout=120)
    campaign = Campaign(tmp_path, url)
    try:
        yield campaign
    finally:
        for replica in campaign.replicas:
            replica.stop()
        campaign.engine.dispose()
        drop_pg_database(url)


def run_token(replica: Replica, run: str) -> str:
    """A token scoped to ``run``, as ``ckpt token create --role run`` gives a job."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    body = {"role": "run", "run": run, "name": f"trainer of {run}"}
    answer = httpx.post(f"{replica.url}/v1/tokens", json=body, headers=headers, timeout=60)
    answer.raise_for_status()
    token: str = answer.json()["token"]
    return token


def test_two_replicas_survive_repeated_sigkills(campaign: Campaign, tmp_path: Path) -> None:
    started = time.monotonic()
    for replica in campaign.replicas:
        replica.start()
    lanes = [
        Lane(run, run_token(campaign.replicas[0], run), first_replica=index)
        for index, run in enumerate(RUNS)
    ]
    campaign.lanes = lanes
    with ThreadPoolExecutor(len(lanes)) as pool:
        training = [pool.submit(campaign.train_until_calm, lane) for lane in lanes]
        try:
            chaos = campaign.chaos(started + CAMPAIGN_SECONDS)
        finally:
            campaign.calm.set()
        for done in training:
            done.result()
    assert not campaign.failures, "\n".join(campaign.failures)
    campaign_seconds = time.monotonic() - started
    # One last segment each, to one common step: the reference is one uninterrupted run.
    final_steps = max(lane.steps for lane in lanes) + SEGMENT_STEPS
    with ThreadPoolExecutor(len(lanes)) as pool:
        finals = list(
            pool.map(lambda lane: campaign.segment(lane, steps=final_steps, kill_at=None), lanes)
        )
    assert not campaign.failures, "\n".join(campaign.failures)
    for replica in campaign.replicas:
        replica.stop()
    reference = run_trainer(
        tmp_path / "reference-store",
        tmp_path / "reference.pt",
        "--steps",
        str(final_steps),
        *TOTAL_STEPS,
        "--workers",
        "0",
    )

    figures = summarise(campaign, lanes, chaos=chaos)
    figures["campaign_seconds"] = round(campaign_seconds)
    figures["total_seconds"] = round(time.monotonic() - started)
    print(f"\nreplica campaign: {figures}")

    check_complete_bundles_are_whole(campaign)
    check_passes_never_overlap(campaign)
    for lane, final in zip(lanes, finals, strict=True):
        resumed = torch.load(final.out, weights_only=True)
        assert differences(reference, resumed) == [], lane.run
    check_no_server_errors(campaign, lanes)


def summarise(campaign: Campaign, lanes: list[Lane], *, chaos: Chaos) -> dict[str, Any]:
    segments = [segment for lane in lanes for segment in lane.segments]
    with Session(campaign.engine) as session:
        committed = session.scalar(
            text("SELECT count(*) FROM bundle WHERE committed_at IS NOT NULL")
        )
        passes = session.execute(select(MaintenancePass.task, MaintenancePass.holder)).all()
    replica_of = {i.holder: r.name for r in campaign.replicas for i in r.incarnations}
    by_replica: dict[str, dict[str, int]] = {}
    for task, holder in passes:
        counts = by_replica.setdefault(task, {})
        counts[replica_of[holder]] = counts.get(replica_of[holder], 0) + 1
    return {
        "kills": sum(i.killed_at is not None for r in campaign.replicas for i in r.incarnations),
        "restarts": sum(len(r.incarnations) - 1 for r in campaign.replicas),
        "kills_at_their_moment": {str(moment): hits for moment, hits in chaos.hits.items()},
        "chaos_seconds": {what: round(seconds) for what, seconds in chaos.seconds.items()},
        "trainer_processes": len(segments),
        "trainer_sigkills": sum(s.kill_at is not None for s in segments),
        "resumes": sum("resumed from" in s.output for s in segments),
        "bundles_committed": committed,
        "passes": by_replica,
        "final_step": lanes[0].steps,
    }


def check_complete_bundles_are_whole(campaign: Campaign) -> None:
    """Every complete bundle: each blob in the store, its size and SHA-256 right; and no
    bundle was ever quarantined (the scrubber would have found a bad blob on the way)."""
    store = open_store(campaign.store)
    with Session(campaign.engine) as session:
        complete = session.scalars(
            select(Bundle).where(Bundle.status == BundleStatus.COMPLETE)
        ).all()
        statuses = {
            status: count
            for status, count in session.execute(
                text("SELECT status, count(*) FROM bundle GROUP BY status")
            )
        }
        quarantines = session.scalar(
            text("SELECT count(*) FROM bundle_event WHERE action = 'quarantined'")
        )
    assert complete
    bad = {}
    for bundle in complete:
        assert bundle.manifest is not None
        report = verify(store, contract.Manifest.model_validate(bundle.manifest))
        if not report.intact:
            bad[bundle.id] = report
    assert not bad, bad
    assert quarantines == 0 and BundleStatus.QUARANTINED not in statuses, statuses


def check_passes_never_overlap(campaign: Campaign) -> None:
    """No two passes of a task ran at once; both replicas ran passes of both tasks."""
    killed = {
        i.holder: i.killed_at for r in campaign.replicas for i in r.incarnations if i.killed_at
    }
    replica_of = {i.holder: r.name for r in campaign.replicas for i in r.incarnations}
    with Session(campaign.engine) as session:
        passes = session.scalars(
            select(MaintenancePass).order_by(MaintenancePass.started_at, MaintenancePass.id)
        ).all()
    by_task: dict[str, list[tuple[datetime, datetime, str]]] = {}
    for row in passes:
        end = row.ended_at or killed.get(row.holder)
        assert end is not None, f"pass {row.id} of {row.holder} never ended, and was not killed"
        by_task.setdefault(row.task, []).append((row.started_at, end, row.holder))
    for task in ("gc", "scrub"):
        assert {replica_of[holder] for _, _, holder in by_task[task]} == {"a", "b"}, task
        latest: tuple[datetime, datetime, str] | None = None
        for current in by_task[task]:
            if latest is not None:
                assert current[0] >= latest[1], f"{task}: {current} overlaps {latest}"
            if latest is None or current[1] > latest[1]:
                latest = current


def check_no_server_errors(campaign: Campaign, lanes: list[Lane]) -> None:
    """No trainer was answered a 5xx (a dead replica is a connection error), and no replica
    logged an error or a traceback."""
    answered = [
        f"{lane.run}: {line}"
        for lane in lanes
        for segment in lane.segments
        for line in segment.output.splitlines()
        if re.search(r"HTTP 5\d\d", line)
    ]
    assert not answered, "\n".join(answered)
    logged = [
        f"replica {replica.name} ({incarnation.pid}): {line}"
        for replica in campaign.replicas
        for incarnation in replica.incarnations
        for line in incarnation.log.read_text().splitlines()
        if re.search(r" (ERROR|CRITICAL) |Traceback", line)
    ]
    assert not logged, "\n".join(logged[:50])
