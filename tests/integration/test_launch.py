"""``ckpt launch``: restarts after preemptions and crashes, the budget, signals, exit codes.

Most tests supervise a fake trainer (a small script in tmp_path) that follows a plan, one
step per attempt: an exit code, ``kill`` (SIGKILL itself), ``wait`` (record the signal it
gets and exit 143) or ``deaf`` (ignore SIGTERM). The slow tests supervise the demo trainer,
kill it, and check the restarted run ends bit-identical to an uninterrupted one; and
torchrun, with small fake ranks and with the many-rank demo job (``agent.demo.ranks``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.demo.compare import differences
from agent.launch.supervisor import (
    MAX_BACKOFF_SECONDS,
    Outcome,
    backoff_seconds,
    classify,
)
from agent.launch.torchrun import ending, is_torchrun
from ckpt.cli import main as ckpt
from tests.conftest import run_trainer
from tests.ranks_job import load_ranks
from tests.server_process import TRAINER_HANG_GUARD

# The console scripts pip installed beside this interpreter.
CKPT = str(Path(sys.executable).parent / "ckpt")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

FAKE_TRAINER = """
import json, os, signal, sys, time
from pathlib import Path

state, plan = Path(sys.argv[1]), sys.argv[2].split(",")
attempt = len(list(state.glob("attempt-*"))) + 1
environment = {k: v for k, v in os.environ.items() if k.startswith("CKPT_")}
(state / f"attempt-{attempt}").write_text(json.dumps({"pid": os.getpid(), "env": environment}))
step = plan[min(attempt, len(plan)) - 1]
if step == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if step in ("wait", "deaf"):
    def record(signum, frame):
        (state / "signal").write_text(signal.Signals(signum).name)
        sys.exit(143)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if step == "deaf" else record)
    signal.signal(signal.SIGINT, record)
    (state / f"ready-{attempt}").touch()
    time.sleep(60)  # a signal ends it sooner; an orphan of a failed test, no later
    sys.exit(99)
sys.exit(int(step))
"""


class FakeTrainer:
    """The fake trainer's script and the directory where it keeps its attempts."""

    def __init__(self, root: Path) -> None:
        self.script = root / "fake_trainer.py"
        self.script.write_text(FAKE_TRAINER)
        self.state = root / "state"
        self.state.mkdir()

    def command(self, plan: str) -> list[str]:
        return [sys.executable, str(self.script), str(self.state), plan]

    def attempts(self) -> list[dict[str, Any]]:
        count = len(list(self.state.glob("attempt-*")))
        return [json.loads((self.state / f"attempt-{n}").read_text()) for n in range(1, count + 1)]

    def received(self) -> str | None:
        path = self.state / "signal"
        return path.read_text() if path.exists() else None


@pytest.fixture
def fake(tmp_path: Path) -> FakeTrainer:
    return FakeTrainer(tmp_path)


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CKPT, "launch", *args],
        capture_output=True,
        text=True,
        timeout=TRAINER_HANG_GUARD,
        check=False,
        env={**os.environ, **(env or {})},
    )


class Supervisor:
    """``ckpt launch`` running in the background, its stderr in a file."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        with log.open("w") as stderr:
            self.process = subprocess.Popen([CKPT, "launch", *args], stderr=stderr)

    def send(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float = TRAINER_HANG_GUARD) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # What every process of the tree was doing: a hang must say where it hung.
            pytest.fail(f"ckpt launch still runs after {timeout} s\n{self.snapshot()}")

    def snapshot(self) -> str:
        """The supervisor's log, and the state and signal masks of it and its children."""
        lines = [f"log:\n{self.logged()}"]
        pids = [self.process.pid, *_children_of(self.process.pid)]
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text().splitlines()
                wchan = Path(f"/proc/{pid}/wchan").read_text()
            except OSError as err:
                lines.append(f"pid {pid}: {err}")
                continue
            keep = ("Name", "State", "PPid", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
            fields = [line for line in status if line.split(":")[0] in keep]
            lines.append(f"pid {pid} (wchan {wchan}): {'; '.join(fields)}")
        return "\n".join(lines)

    def logged(self) -> str:
        return self.log.read_text()


def _children_of(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


StartSupervisor = Callable[..., Supervisor]


@pytest.fixture
def supervisors(tmp_path: Path) -> Iterator[StartSupervisor]:
    started: list[Supervisor] = []

    def start(*args: str) -> Supervisor:
        supervisor = Supervisor(tmp_path / f"launch{len(started)}.log", *args)
        started.append(supervisor)
        return supervisor

    yield start
    for supervisor in started:  # a failed test must not leave a supervisor behind
        if supervisor.process.poll() is None:
            supervisor.send(signal.SIGKILL)
            supervisor.wait()


def wait_for(
    condition: Callable[[], bool], *, what: str, timeout: float = TRAINER_HANG_GUARD
) -> None:
    """Until ``condition``; ``timeout`` only stops a hang (a busy machine is slow, not stuck)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_the_outcome_of_an_exit_code() -> None:
    assert classify(0) is Outcome.SUCCEEDED
    assert classify(143) is Outcome.PREEMPTED
    assert classify(-signal.SIGKILL) is Outcome.PREEMPTED
    assert classify(-signal.SIGTERM) is Outcome.PREEMPTED
    assert classify(1) is Outcome.CRASHED
    assert classify(137) is Outcome.CRASHED  # a code, not a signal: the trainer chose it


def test_the_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_seconds(n, base=1.0) for n in range(1, 5)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff_seconds(7, base=1.0) == MAX_BACKOFF_SECONDS
    assert backoff_seconds(3, base=0.0) == 0.0


def test_a_trainer_that_succeeds_runs_once(fake: FakeTrainer) -> None:
    done = launch("--", *fake.command("0"))
    assert done.returncode == 0, done.stderr
    assert len(fake.attempts()) == 1
    assert "ckpt launch: attempt 1 of 4: " in done.stderr
    assert "ckpt launch: trainer succeeded" in done.stderr


def test_a_preempted_then_crashed_trainer_is_restarted_until_it_succeeds(
    fake: FakeTrainer,
) -> None:
    done = launch("--backoff", "0", "--", *fake.command("143,1,0"))
    assert done.returncode == 0, done.stderr
    assert len(fake.attempts()) == 3
    lines = [line for line in done.stderr.splitlines() if line.startswith("ckpt launch: ")]
    pids = [attempt["pid"] for attempt in fake.attempts()]
    command = shlex.join(fake.command("143,1,0"))
    assert lines == [
        f"ckpt launch: attempt 1 of 4: {command} (pid {pids[0]})",
        "ckpt launch: trainer exited with 143 (preempted); restarting in 0.0 s (2 restarts left)",
        f"ckpt launch: attempt 2 of 4: {command} (pid {pids[1]})",
        "ckpt launch: trainer exited with 1 (crashed); restarting in 0.0 s (1 restart left)",
        f"ckpt launch: attempt 3 of 4: {command} (pid {pids[2]})",
        "ckpt launch: trainer succeeded",
    ]


def test_a_trainer_killed_by_sigkill_counts_as_preempted(fake: FakeTrainer) -> None:
    done = launch("--backoff", "0", "--", *fake.command("kill,0"))
    assert done.returncode == 0, done.stderr
    assert len(fake.attempts()) == 2
    assert "trainer killed by SIGKILL (preempted); restarting" in done.stderr


def test_the_restart_budget_ends_with_the_trainers_exit_code(fake: FakeTrainer) -> None:
    done = launch("--max-restarts", "1", "--backoff", "0", "--", *fake.command("3"))
    assert done.returncode == 3, done.stderr
    assert len(fake.attempts()) == 2
    assert "attempt 2 of 2" in done.stderr
    assert "trainer exited with 3 (crashed); restart budget spent; exiting with 3" in done.stderr


@pytest.mark.parametrize(("plan", "expected"), [("143", 143), ("kill", 137), ("1", 1)])
def test_max_restarts_0_never_restarts(fake: FakeTrainer, plan: str, expected: int) -> None:
    done = launch("--max-restarts", "0", "--", *fake.command(plan))
    assert done.returncode == expected, done.stderr
    assert len(fake.attempts()) == 1
    assert f"restart budget spent; exiting with {expected}" in done.stderr


def test_the_backoff_doubles_at_each_restart(fake: FakeTrainer) -> None:
    done = launch("--max-restarts", "3", "--backoff", "0.01", "--", *fake.command("1"))
    assert done.returncode == 1, done.stderr
    assert len(fake.attempts()) == 4
    assert re.findall(r"restarting in ([0-9.]+) s", done.stderr) == ["0.01", "0.02", "0.04"]


def test_the_trainer_gets_the_environment_and_its_attempt_number(fake: FakeTrainer) -> None:
    done = launch("--backoff", "0", "--", *fake.command("1,0"), env={"CKPT_RUN": "launched"})
    assert done.returncode == 0, done.stderr
    environments = [attempt["env"] for attempt in fake.attempts()]
    assert [env["CKPT_LAUNCH_ATTEMPT"] for env in environments] == ["1", "2"]
    assert [env["CKPT_RUN"] for env in environments] == ["launched", "launched"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_supervisor_is_forwarded_and_nothing_restarts(
    fake: FakeTrainer, supervisors: StartSupervisor, signum: signal.Signals
) -> None:
    supervisor = supervisors("--backoff", "0", "--", *fake.command("wait,0"))
    wait_for((fake.state / "ready-1").exists, what="the trainer")
    supervisor.send(signum)
    assert supervisor.wait() == 143, supervisor.logged()
    assert fake.received() == signum.name
    assert len(fake.attempts()) == 1
    assert f"trainer exited with 143 after {signum.name}; exiting with 143" in supervisor.logged()


def test_a_second_sigterm_kills_a_trainer_that_ignores_the_first(
    fake: FakeTrainer, supervisors: StartSupervisor
) -> None:
    supervisor = supervisors("--", *fake.command("deaf"))
    wait_for((fake.state / "ready-1").exists, what="the trainer")
    supervisor.send(signal.SIGTERM)
    wait_for(lambda: "forwarding it" in supervisor.logged(), what="the forwarded SIGTERM")
    supervisor.send(signal.SIGTERM)
    assert supervisor.wait() == 128 + signal.SIGKILL, supervisor.logged()
    assert "received SIGTERM again; killing the trainer" in supervisor.logged()
    assert fake.received() is None
    assert len(fake.attempts()) == 1


def test_a_signal_during_the_backoff_stops_the_supervisor_at_once(
    fake: FakeTrainer, supervisors: StartSupervisor
) -> None:
    supervisor = supervisors("--backoff", "30", "--", *fake.command("1"))
    wait_for(lambda: "restarting in 30.0 s" in supervisor.logged(), what="the backoff")
    started = time.monotonic()
    supervisor.send(signal.SIGTERM)
    assert supervisor.wait() == 1, supervisor.logged()
    assert time.monotonic() - started < 10
    assert "received SIGTERM before attempt 2 started; exiting with 1" in supervisor.logged()
    assert len(fake.attempts()) == 1


def test_the_pid_file_holds_the_live_trainer_and_is_removed_at_the_end(
    fake: FakeTrainer, supervisors: StartSupervisor, tmp_path: Path
) -> None:
    pid_file = tmp_path / "trainer.pid"
    supervisor = supervisors(
        "--backoff", "0", "--pid-file", str(pid_file), "--", *fake.command("wait")
    )
    wait_for((fake.state / "ready-1").exists, what="the first trainer")
    first = fake.attempts()[0]["pid"]
    wait_for(lambda: read_pid(pid_file) == first, what="the first trainer's pid")
    os.kill(first, signal.SIGKILL)  # what the demo's chaos loop does
    wait_for((fake.state / "ready-2").exists, what="the restarted trainer")
    second = fake.attempts()[1]["pid"]
    wait_for(lambda: read_pid(pid_file) == second, what="the restarted trainer's pid")
    assert second != first
    supervisor.send(signal.SIGTERM)
    assert supervisor.wait() == 143, supervisor.logged()
    assert "trainer killed by SIGKILL (preempted); restarting" in supervisor.logged()
    assert not pid_file.exists()


def read_pid(path: Path) -> int | None:
    return int(path.read_text()) if path.exists() else None


@pytest.mark.parametrize(
    "args", [[], ["--max-restarts", "1"], ["--"]], ids=["nothing", "options-only", "dash-dash-only"]
)
def test_no_command_is_a_usage_error(args: list[str]) -> None:
    done = launch(*args)
    assert done.returncode == 2
    assert "no command to run" in done.stderr


def test_a_missing_command_exits_127(tmp_path: Path) -> None:
    done = launch("--", str(tmp_path / "no-such-trainer"), "--steps", "3")
    assert done.returncode == 127
    assert "command not found" in done.stderr


def test_ckpt_main_passes_everything_after_the_dash_dash_to_the_trainer(
    fake: FakeTrainer, capsys: pytest.CaptureFixture[str]
) -> None:
    previous = signal.getsignal(signal.SIGINT)
    code = ckpt(["launch", "--max-restarts", "1", "--backoff", "0", "--", *fake.command("143,0")])
    assert code == 0
    assert len(fake.attempts()) == 2
    assert "attempt 2 of 2" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is previous  # the supervisor's handlers are gone
    # The trainer's own "--" and options that ckpt launch also has reach it untouched.
    check = "import sys; sys.exit(0 if sys.argv[1:] == ['--', '--max-restarts', '9'] else 5)"
    assert ckpt(["launch", "--", sys.executable, "-c", check, "--", "--max-restarts", "9"]) == 0


@pytest.mark.slow
def test_the_demo_trainer_killed_under_launch_resumes_bit_exactly(tmp_path: Path) -> None:
    train = ("--steps", "30", "--total-steps", "30", "--every", "5")
    reference = run_trainer(tmp_path / "reference", tmp_path / "reference.pt", *train)
    store, out, pid_file = tmp_path / "store", tmp_path / "launched.pt", tmp_path / "trainer.pid"
    supervisor = Supervisor(
        tmp_path / "launch.log",
        *("--max-restarts", "2", "--backoff", "0", "--pid-file", str(pid_file), "--"),
        *(
            sys.executable,
            "-m",
            "agent.demo.train",
            "--store",
            str(store),
            "--run",
            "launched",
        ),
        *("--out", str(out), *train),
    )
    try:
        bundles = store / "runs" / "launched" / "bundles"
        wait_for(lambda: any(bundles.glob("*/manifest.json")), what="a bundle")
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        assert supervisor.wait() == 0, supervisor.logged()
    finally:
        if supervisor.process.poll() is None:
            supervisor.process.kill()
            supervisor.process.wait()
    assert "trainer killed by SIGKILL (preempted)" in supervisor.logged()
    assert "attempt 2 of 3" in supervisor.logged()
    resumed = torch.load(out, weights_only=True)
    assert resumed["positions"][0] >= (5, 1)  # it resumed from a bundle
    assert differences(reference, resumed) == []


@pytest.mark.slow
def test_sigterm_to_the_supervisor_lets_the_trainer_save_and_exit_143(tmp_path: Path) -> None:
    """The signal goes to the trainer alone: its data-loader workers live on, so the trainer
    saves at its next step boundary instead of crashing on their deaths."""
    store, pid_file = tmp_path / "store", tmp_path / "trainer.pid"
    supervisor = Supervisor(
        tmp_path / "launch.log",
        *("--max-restarts", "2", "--pid-file", str(pid_file), "--"),
        *(sys.executable, "-m", "agent.demo.train", "--store", str(store), "--run", "stopped"),
        *("--out", str(tmp_path / "out.pt"), "--steps", "400", "--every", "5", "--workers", "2"),
    )
    try:
        bundles = store / "runs" / "stopped" / "bundles"
        wait_for(lambda: any(bundles.glob("*/manifest.json")), what="a bundle")
        supervisor.send(signal.SIGTERM)
        assert supervisor.wait() == 143, supervisor.logged()
    finally:
        if supervisor.process.poll() is None:
            supervisor.process.kill()
            supervisor.process.wait()
    logged = supervisor.logged()
    assert "preempted by SIGTERM" in logged  # the agent's own exit, not a crash
    assert "exited unexpectedly" not in logged
    assert "attempt 2" not in logged


# --- torchrun ------------------------------------------------------------------------------

# The ends of torchrun's stderr (torch 2.13, measured): stopped by SIGTERM; a rank SIGKILLed
# (the other one, stopped by torchrun, is listed too); a rank that exited 3.
TORCHRUN_STOPPED = """\
W1130 14:09:04.983000 12468 torch/distributed/elastic/agent/server/api.py:753] Received 15 \
death signal, shutting down workers
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
torch.distributed.elastic.multiprocessing.api.SignalException: Process 12468 got signal: 15
"""


def torchrun_failed(root_rank: int, root_code: str, other_code: str) -> str:
    """torchrun's ChildFailedError: every failed rank, then the first to fail."""

    def failure(rank: int, code: str) -> str:
        return f"""\
  time      : 2026-11-30_14:09:50
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 1349{rank})
  error_file: <N/A>
"""

    return f"""\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
agent.demo.ranks FAILED
-------------------------------------------------------
Failures:
[1]:
{failure(1 - root_rank, other_code)}-------------------------------------------------------
Root Cause (first observed failure):
[0]:
{failure(root_rank, root_code)}=======================================================
"""


@pytest.mark.parametrize(
    ("stderr", "returncode", "outcome", "description"),
    [
        (TORCHRUN_STOPPED, -15, Outcome.PREEMPTED, "torchrun (stopped by SIGTERM) exited with 1"),
        (
            torchrun_failed(1, "-9 (pid: 13491)  (SIGKILL)", "-15"),
            -9,
            Outcome.PREEMPTED,
            "torchrun exited with 1: rank 1 killed by SIGKILL first",
        ),
        (
            torchrun_failed(0, "143", "-15"),
            143,
            Outcome.PREEMPTED,
            "torchrun exited with 1: rank 0 exited with 143 first",
        ),
        (
            torchrun_failed(1, "3", "-15 (pid: 4433)  (SIGTERM)"),
            3,
            Outcome.CRASHED,
            "torchrun exited with 1: rank 1 exited with 3 first",
        ),
        (
            "Traceback ...\nValueError: bad --nnodes\n",
            1,
            Outcome.CRASHED,
            "torchrun exited with 1",
        ),
    ],
    ids=["stopped", "rank-killed", "rank-preempted", "rank-crashed", "torchrun-failed"],
)
def test_torchrun_exits_1_and_its_last_words_say_how_its_ranks_ended(
    stderr: str, returncode: int, outcome: Outcome, description: str
) -> None:
    ended = ending(1, torchrun_stderr=f"rank 0: some output\n{stderr}")
    assert (ended.returncode, ended.description) == (returncode, description)
    assert classify(ended.returncode) is outcome


def test_a_torchrun_that_succeeded_or_was_killed_is_read_by_its_code() -> None:
    assert ending(0, torchrun_stderr=TORCHRUN_STOPPED).returncode == 0
    assert ending(-9, torchrun_stderr=TORCHRUN_STOPPED) == ending(-9, torchrun_stderr="")
    assert ending(-9, torchrun_stderr="").description == "torchrun killed by SIGKILL"
    assert ending(143).description == "trainer exited with 143"


def test_which_commands_are_torchrun() -> None:
    assert is_torchrun(["torchrun", "--nproc-per-node", "2", "train.py"])
    assert is_torchrun(["/venv/bin/torchrun", "-m", "train"])
    assert is_torchrun(["python", "-m", "torch.distributed.run", "train.py"])
    assert not is_torchrun(["python", "train.py", "--torchrun-like"])
    assert not is_torchrun(["python", "-m", "torch.distributed.launch_helper"])


FAKE_RANK = """
import os, signal, sys, time
from pathlib import Path

state, plan = Path(sys.argv[1]), sys.argv[2]
rank = os.environ["RANK"]
if plan == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# Deaf before it says it runs, and the pid file appears whole (a rename): the test reads
# it as soon as it exists.
(state / f".rank-{rank}").write_text(str(os.getpid()))
(state / f".rank-{rank}").rename(state / f"rank-{rank}")
if plan == "crash" and rank == "1":
    sys.exit(3)
time.sleep(60)  # a signal ends it sooner; an orphan of a failed test, no later
"""


def fake_ranks(root: Path, plan: str) -> tuple[Path, list[str]]:
    """Two fake ranks under torchrun; the directory where each writes its pid."""
    script, state = root / "fake_rank.py", root / "ranks"
    script.write_text(FAKE_RANK)
    state.mkdir()
    return state, [TORCHRUN, "--nproc-per-node", "2", str(script), str(state), plan]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")  # a zombie is dead too
    return not (stat.exists() and stat.read_text().rpartition(")")[2].split()[0] == "Z")


@pytest.mark.slow
def test_a_crashed_torchrun_rank_counts_as_crashed_and_its_code_is_the_exit_code(
    tmp_path: Path,
) -> None:
    _, command = fake_ranks(tmp_path, "crash")
    done = launch("--max-restarts", "0", "--", *command)
    assert done.returncode == 3, done.stderr
    assert (
        "ckpt launch: torchrun exited with 1: rank 1 exited with 3 first (crashed); "
        "restart budget spent; exiting with 3"
    ) in done.stderr
    assert "ChildFailedError" in done.stderr  # torchrun's own stderr is copied through


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the subreaper is Linux's")
def test_killing_torchrun_kills_its_ranks_too(tmp_path: Path, supervisors: StartSupervisor) -> None:
    """torchrun's ranks live in sessions of their own: a SIGKILL of torchrun's group misses
    them, so the supervisor adopts them (a subreaper) and kills them with the attempt."""
    state, command = fake_ranks(tmp_path, "deaf")
    supervisor = supervisors("--", *command)
    ranks = [state / "rank-0", state / "rank-1"]
    wait_for(lambda: all(rank.exists() for rank in ranks), what="both ranks")
    pids = [int(rank.read_text()) for rank in ranks]
    supervisor.send(signal.SIGTERM)  # torchrun passes it on; the ranks ignore it
    wait_for(lambda: "forwarding it" in supervisor.logged(), what="the forwarded SIGTERM")
    supervisor.send(signal.SIGTERM)
    assert supervisor.wait() == 128 + signal.SIGKILL, supervisor.logged()
    assert "killing what the trainer left in sessions of their own" in supervisor.logged()
    assert [pid for pid in pids if alive(pid)] == []


RANKS_JOB = ("-m", "agent.demo.ranks", "--parallel", "ddp", "--steps", "12", "--every", "2")


def torchrun_ranks(store: Path, out: Path, *extra: str) -> list[str]:
    return [
        TORCHRUN,
        "--nproc-per-node",
        "2",
        *RANKS_JOB,
        "--store",
        str(store),
        "--out",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def ranks_reference(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The many-rank demo job run by torchrun without interruption: each rank's final state."""
    root = tmp_path_factory.mktemp("ranks-reference")
    done = subprocess.run(
        torchrun_ranks(root / "store", root / "out"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return load_ranks(root / "out", 2)


def assert_ranks_bit_exact(reference: list[Any], out: Path) -> None:
    for rank, (ref, got) in enumerate(zip(reference, load_ranks(out, 2), strict=True)):
        assert differences(ref, got) == [], f"rank {rank}: {differences(ref, got)}"


@pytest.mark.slow
def test_sigterm_to_launch_stops_every_torchrun_rank_at_a_bundle_and_nothing_restarts(
    tmp_path: Path, ranks_reference: list[Any]
) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    supervisor = Supervisor(tmp_path / "launch.log", "--", *torchrun_ranks(store, out))
    try:
        bundles = store / "runs" / "ranks" / "bundles"
        wait_for(lambda: any(bundles.glob("*/manifest.json")), what="a bundle")
        supervisor.send(signal.SIGTERM)
        assert supervisor.wait() == 143, supervisor.logged()
    finally:
        if supervisor.process.poll() is None:
            supervisor.process.kill()
            supervisor.process.wait()
    logged = supervisor.logged()
    assert "received SIGTERM; forwarding it to the trainer" in logged
    assert "torchrun (stopped by SIGTERM) exited with 1 after SIGTERM; exiting with 143" in logged
    # torchrun does not print its ranks' exit codes when it is stopped; the ranks say theirs.
    kept = [at or saved for saved, at in STOPPED_AT.findall(logged)]
    assert len(kept) == 2 and len(set(kept)) == 1, logged  # each rank, at one bundle
    assert "attempt 2" not in logged
    assert not list(tmp_path.glob("out.rank*"))  # neither rank ran to the end
    # That bundle is complete: a fresh torchrun resumes it on both ranks, bit-exactly.
    resumed = subprocess.run(
        torchrun_ranks(store, out),
        capture_output=True,
        text=True,
        timeout=TRAINER_HANG_GUARD,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert resumed.stdout.count(f"resumed from runs/ranks/bundles/{int(kept[0]):012d}") == 2
    assert_ranks_bit_exact(ranks_reference, out)


# What a rank says as it exits after a signal: the step it stopped at, and the bundle kept
# (its own position, or an earlier one).
STOPPED_AT = re.compile(
    r"preempted by SIGTERM at step (\d+)[^;]*; "
    r"(?:this position is saved|the last bundle is at step (\d+)[^;]*); exiting with 143"
)


@pytest.mark.slow
def test_a_rank_sigkilled_under_torchrun_restarts_the_group_which_resumes_bit_exactly(
    tmp_path: Path, ranks_reference: list[Any]
) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    # Rank 0 dies at 5.1, once: torchrun stops rank 1 and exits; launch starts it again.
    drill = ("--kill-at", "5.1", "--kill-rank", "0", "--drill-marker", str(tmp_path / "killed"))
    supervisor = Supervisor(
        tmp_path / "launch.log",
        *("--max-restarts", "1", "--backoff", "0.2", "--"),
        *torchrun_ranks(store, out, *drill),
    )
    try:
        assert supervisor.wait() == 0, supervisor.logged()
    finally:
        if supervisor.process.poll() is None:
            supervisor.process.kill()
            supervisor.process.wait()
    logged = supervisor.logged()
    assert (
        "torchrun exited with 1: rank 0 killed by SIGKILL first (preempted); "
        "restarting in 0.2 s (0 restarts left)"
    ) in logged
    assert "attempt 2 of 2" in logged
    assert logged.count("ckpt: run ranks: resumed from runs/ranks/bundles/") == 2  # both ranks
    assert_ranks_bit_exact(ranks_reference, out)
