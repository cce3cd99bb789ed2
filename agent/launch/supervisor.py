"""``ckpt launch``: run a training command, and restart it after a preemption or a crash.

    ckpt launch [--max-restarts N] [--backoff S] [--pid-file PATH] -- COMMAND...

A supervisor for one machine (on Kubernetes the Job controller plays this part). Each
attempt runs COMMAND with the supervisor's environment (the ``CKPT_*`` settings pass
through) plus ``CKPT_LAUNCH_ATTEMPT`` (1, 2, ...), in a session of its own, so that a
terminal's Ctrl-C reaches only the supervisor, which forwards it.

How each attempt ends decides what comes next:

- exit code 0: the trainer succeeded; the supervisor exits 0.
- every rank ended its attempt as finished (``Checkpointer.end("finished")``, noted in the
  attempt's ``CKPT_LAUNCH_FINISHED`` folder; ``agent.launch.finished``): the trainer
  succeeded too, even when a signal stopped it on its way out; the supervisor exits 0.
- ``EXIT_PREEMPTED`` (143), or killed by a signal: *preempted*; any other code: *crashed*.
  Both are restarted after a backoff (``--backoff``, default 1 s, doubled at each restart,
  at most 60 s) while restarts remain (``--max-restarts``, default 3; 0 never restarts).
- SIGTERM or SIGINT to the supervisor: the machine is going away. The signal is forwarded
  to the trainer alone (its data-loader workers would die of it), the trainer is not
  restarted, and a second SIGTERM or SIGINT kills its process group (SIGKILL). During a
  backoff the supervisor stops at once. SIGHUP is ignored.

torchrun as the trainer (``torchrun ...`` or ``python -m torch.distributed.run ...``): it
passes a SIGTERM or SIGINT on to every rank (to each rank's process group, data-loader
workers included), waits for them (``--shutdown-timeout``, default 30 s, then SIGKILL), and
when one rank fails it stops the others the same way: the whole group ends, and restarts,
together. It exits 1 however its ranks ended, so the supervisor reads what torchrun printed
last on its stderr (which it copies through): ``SignalException ... got signal: S`` -
torchrun was stopped by signal S - stands for a trainer killed by S; the exit code of the
rank that failed first (torchrun's "Root Cause") stands for the trainer's. So a torchrun
whose first rank to fail was SIGKILLed or exited 143 is *preempted*, one whose rank raised
is *crashed*, and the supervisor's exit code is that rank's (128 + S for signal S).

Exit codes:

    0      the trainer succeeded
    N      the trainer's last exit code, when the restart budget is spent or the
           supervisor was told to stop (128 + S when signal S killed the trainer;
           torchrun: as read above)
    2      usage error: no command, a bad option
    126    the command cannot be executed (permission denied...)
    127    the command was not found

When a trainer exits, what is left of its process group (the data loader workers of a
killed trainer) is killed, so that the next attempt has the machine to itself. On Linux the
supervisor is also the subreaper of the trainer's descendants: processes in sessions of
their own whose parent died (the ranks of a killed torchrun) become its children, and are
killed with their process groups too.
``--pid-file PATH`` holds the pid of the latest trainer (rewritten at each attempt, removed
at the end), for tools that signal the trainer directly.
Each event is logged on stderr as one line starting ``ckpt launch:``.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import itertools
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from agent.attempt.signals import EXIT_PREEMPTED
from agent.launch.finished import ENV as FINISHED_ENV
from agent.launch.finished import all_finished, notes_folder
from agent.launch.reaping import children, kill_orphans, subreaper
from agent.launch.torchrun import Ending, Tail, ending, is_torchrun

MAX_BACKOFF_SECONDS = 60.0
EXIT_USAGE = 2
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_RECHECK_SECONDS = 1.0


class Outcome(enum.Enum):
    """How one attempt of the trainer ended."""

    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"
    CRASHED = "crashed"


def classify(returncode: int) -> Outcome:
    """The outcome of a trainer that exited with ``returncode`` (negative: killed by a signal)."""
    if returncode == 0:
        return Outcome.SUCCEEDED
    if returncode == EXIT_PREEMPTED or returncode < 0:
        return Outcome.PREEMPTED
    return Outcome.CRASHED


def exit_code(returncode: int) -> int:
    """The shell's exit code for ``returncode``: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def backoff_seconds(restart: int, *, base: float) -> float:
    """The wait before the ``restart``-th restart (1-based): doubled each time, capped."""
    return min(base * 2.0 ** (restart - 1), MAX_BACKOFF_SECONDS)


@dataclass(frozen=True)
class Policy:
    """What ``ckpt launch`` was asked to do."""

    command: list[str]
    max_restarts: int = 3
    backoff: float = 1.0
    pid_file: Path | None = None


class _Signals:
    """The signals the supervisor receives, read from a pipe rather than acted on in handlers.

    ``signal.set_wakeup_fd`` writes each signal's number to the pipe; the handlers do
    nothing. The main loop blocks on the pipe, so a signal (SIGCHLD included: a trainer
    exited) wakes it, and all the work - forwarding, logging - happens in ordinary code,
    where a second signal cannot interrupt it halfway.
    """

    _HANDLED = (*_STOP_SIGNALS, signal.SIGCHLD, signal.SIGHUP)

    def __enter__(self) -> _Signals:
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)
        self._previous = {signum: signal.signal(signum, _ignore) for signum in self._HANDLED}
        self._previous_wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            if handler is not None:  # None: installed outside Python, cannot be restored
                signal.signal(signum, handler)
        os.close(self._read)
        os.close(self._write)

    def wait(self, timeout: float | None) -> list[signal.Signals]:
        """Block until a signal arrives or ``timeout`` passes; the stop signals received."""
        readable, _, _ = select.select([self._read], [], [], timeout)
        return self._drain() if readable else []

    def _drain(self) -> list[signal.Signals]:
        received = b""
        while True:
            try:
                chunk = os.read(self._read, 256)
            except BlockingIOError:
                break
            received += chunk
            if not chunk:
                break
        return [signal.Signals(n) for n in received if n in _STOP_SIGNALS]


def _ignore(signum: int, frame: FrameType | None) -> None:
    """A handler that lets ``set_wakeup_fd`` see the signal, and nothing else."""


class _Trainer:
    """One attempt: the trainer process and the signals forwarded to it."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        *,
        tail: Tail | None,
        older: set[int],
        finished: Path,
    ) -> None:
        self.process = process
        self.finished = finished  # where its ranks note that they finished training
        self.stopped_by: signal.Signals | None = None
        self._tail = tail
        self._older = older  # the supervisor's children before this attempt started

    def wait(self, signals: _Signals) -> Ending:
        """Wait for the trainer to exit, forwarding stop signals; how it ended."""
        while not self._exited():
            # SIGCHLD wakes the wait at once; the timeout only bounds what a wakeup that
            # never came (a signal coalesced or lost) could cost: a second, not forever.
            for signum in signals.wait(_RECHECK_SECONDS):
                self._forward(signum)
        # What the trainer leaves in its group (the data loader workers of a killed
        # trainer) must not outlive it: the next attempt would share the machine with them.
        self._signal_group(signal.SIGKILL)
        orphans = children() - self._older - {self.process.pid}
        if orphans:
            _log(f"killing what the trainer left in sessions of their own (pids {sorted(orphans)})")
            kill_orphans(orphans)
        returncode = self.process.wait()
        if self._tail is None:
            return ending(returncode)
        return ending(returncode, torchrun_stderr=self._tail.text(timeout=10.0))

    def _exited(self) -> bool:
        if not hasattr(os, "waitid"):  # macOS before Python 3.13
            return self.process.poll() is not None
        # WNOWAIT leaves the exited trainer a zombie, so its pid - the group's id - cannot
        # be reused before the rest of its group is killed.
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, self.process.pid, flags) is not None

    def _forward(self, signum: signal.Signals) -> None:
        pid = self.process.pid
        if self.stopped_by is None:
            self.stopped_by = signum
            _log(f"received {signum.name}; forwarding it to the trainer (pid {pid})")
            # The trainer alone: its data-loader workers would die of it, and the trainer
            # would crash on their deaths instead of saving.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        else:
            _log(f"received {signum.name} again; killing the trainer (pid {pid})")
            self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone, or not ours
            os.killpg(self.process.pid, signum)  # a session leader: its pid is its group's


def supervise(policy: Policy) -> int:
    """Run ``policy.command`` until it succeeds, the restarts run out or a signal stops it.

    Returns:
        The supervisor's exit code (see the module's docstring).
    """
    with _Signals() as signals, subreaper():
        try:
            return _attempts(policy, signals)
        finally:
            if policy.pid_file is not None:
                policy.pid_file.unlink(missing_ok=True)


def _attempts(policy: Policy, signals: _Signals) -> int:
    """Start attempt after attempt; the exit code of the last."""
    code: int | None = None
    delay = 0.0
    for attempt in itertools.count(1):
        stop = _sleep(signals, delay)
        if stop is not None:
            code = code if code is not None else 128 + stop
            _log(f"received {stop.name} before attempt {attempt} started; exiting with {code}")
            return code
        trainer = _start(policy, attempt=attempt)
        if isinstance(trainer, int):
            return trainer
        ended = trainer.wait(signals)
        code = exit_code(ended.returncode)
        if all_finished(trainer.finished) and code != 0:
            _log(f"{ended.description}, after the trainer finished its training; exiting with 0")
            return 0
        backoff = _next_delay(ended, trainer=trainer, attempt=attempt, policy=policy)
        if backoff is None:
            return code
        delay = backoff
    raise AssertionError("unreachable: itertools.count never ends")


def _start(policy: Policy, *, attempt: int) -> _Trainer | int:
    """Start one attempt; the trainer, or the exit code when the command cannot run."""
    finished = notes_folder(attempt)
    environment = {**os.environ, "CKPT_LAUNCH_ATTEMPT": str(attempt), FINISHED_ENV: str(finished)}
    torchrun = is_torchrun(policy.command)
    older = children()
    try:
        process = subprocess.Popen(
            policy.command,
            env=environment,
            start_new_session=True,
            stderr=subprocess.PIPE if torchrun else None,  # read by ending(), copied through
        )
    except FileNotFoundError as err:
        shutil.rmtree(finished, ignore_errors=True)
        _log(f"command not found: {policy.command[0]} ({err.strerror}); check PATH")
        return EXIT_NOT_FOUND
    except OSError as err:
        shutil.rmtree(finished, ignore_errors=True)
        _log(f"cannot execute {policy.command[0]}: {err.strerror}")
        return EXIT_CANNOT_EXECUTE
    attempts = policy.max_restarts + 1
    command = shlex.join(policy.command)
    _log(f"attempt {attempt} of {attempts}: {command} (pid {process.pid})")
    if policy.pid_file is not None:
        _write_pid_file(policy.pid_file, process.pid)
    tail = Tail(process.stderr) if process.stderr is not None else None
    return _Trainer(process, tail=tail, older=older, finished=finished)


def _next_delay(ended: Ending, *, trainer: _Trainer, attempt: int, policy: Policy) -> float | None:
    """Log how an attempt ended; the backoff before the next one, or None to stop."""
    code = exit_code(ended.returncode)
    if trainer.stopped_by is not None:
        _log(f"{ended.description} after {trainer.stopped_by.name}; exiting with {code}")
        return None
    outcome = classify(ended.returncode)
    if outcome is Outcome.SUCCEEDED:
        _log("trainer succeeded")
        return None
    what = f"{ended.description} ({outcome.value})"
    left = policy.max_restarts - attempt + 1
    if left == 0:
        _log(f"{what}; restart budget spent; exiting with {code}")
        return None
    delay = backoff_seconds(attempt, base=policy.backoff)
    restarts = f"{left - 1} restart{'' if left == 2 else 's'} left"
    _log(f"{what}; restarting in {round(delay, 3)} s ({restarts})")
    return delay


def _sleep(signals: _Signals, seconds: float) -> signal.Signals | None:
    """Wait out a backoff (0: just look); the stop signal that cut it short, if any."""
    deadline = time.monotonic() + seconds
    while True:
        stop = signals.wait(max(0.0, deadline - time.monotonic()))
        if stop:
            return stop[0]
        if time.monotonic() >= deadline:
            return None


def _write_pid_file(path: Path, pid: int) -> None:
    # Written aside and renamed, so that a reader never sees a half-written pid.
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(f"{pid}\n")
    partial.replace(path)


def _log(message: str) -> None:
    print(f"ckpt launch: {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> Policy:
    """The policy that ``argv`` asks for; exits 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="ckpt launch",
        usage="%(prog)s [--max-restarts N] [--backoff S] [--pid-file PATH] -- COMMAND...",
        description="Run COMMAND; restart it after a preemption or a crash.",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="0: never (default: 3)"
    )
    parser.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        metavar="S",
        help=f"seconds before the first restart, doubled at each (default: 1, at most "
        f"{MAX_BACKOFF_SECONDS:g})",
    )
    parser.add_argument("--pid-file", type=Path, metavar="PATH", help="holds the trainer's pid")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    args = parser.parse_args(argv)
    # The "--" that ends the options may be left at the head of the remainder (argparse
    # does so in Python 3.11); it is not part of the command.
    command: list[str] = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run: ckpt launch [OPTIONS] -- python train.py ...")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be 0 or more (got {args.max_restarts})")
    if not args.backoff >= 0:
        parser.error(f"--backoff must be 0 or more seconds (got {args.backoff})")
    return Policy(
        command, max_restarts=args.max_restarts, backoff=args.backoff, pid_file=args.pid_file
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckpt launch``; returns the exit code."""
    try:
        policy = parse_args(argv)
    except SystemExit as done:  # argparse: --help (0) or a usage error (2)
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    return supervise(policy)


if __name__ == "__main__":
    sys.exit(main())
