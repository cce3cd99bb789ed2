"""``ckpt demo``: preemption end to end on one machine.

It starts the control plane (the embedded default: SQLite + the directory store under
``./.ckpt``) in the background, trains the demo job under ``ckpt launch`` while a chaos
loop preempts it (SIGTERM at random moments, then one SIGKILL in the middle of an upload),
lets every attempt resume through the control plane, then trains an uninterrupted reference
run with the same seed and checks that both end bit-identical (``report``).

The SIGKILL is the trainer's own (``train.py --kill-during-upload``): it records in
``.ckpt/demo/<run>/sigkill-drill.json`` whether it fired, so that the report states what
happened, also on a store that already holds the bundle it aims at. The chaos loop holds
it (writes that file first) until the last SIGTERM has stopped its attempt: one attempt
preempted by each, another killed.

With ``--nproc N`` (N > 1) the job is the many-rank one (``ranks.py``, DDP or FSDP2 on
gloo) under ``torchrun --nproc-per-node N``: the chaos loop's SIGTERMs go to torchrun, which
passes them on to every rank, the SIGKILL takes rank 0 in its upload (torchrun then stops
the other ranks), ``ckpt launch`` restarts the whole group, and every rank's final state is
compared with the reference's.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from agent.demo.drills import record_drill
from agent.demo.report import DRILL_RECORD, ckpt_here, print_next_steps, report
from agent.demo.server import control_plane, dashboard_url, serve_until_interrupted
from ckpt.core.tokens import bearer

GRACE_SECONDS = 10

DESCRIPTION = """\
Preemption end to end on one machine, in about a minute.

Starts the control plane in the background (unless --server names one; the
embedded default: a SQLite catalog and a directory store under ./.ckpt), then
trains a small job under 'ckpt launch' while a chaos loop preempts it: SIGTERMs
at random steps, and a SIGKILL in the middle of the upload of one bundle. Every
attempt resumes through the control plane. Then it trains the same job without
interruption and checks that both runs end bit-identical: every parameter,
optimizer tensor, learning rate and loss.

With --nproc N (N > 1) the job runs on N ranks under torchrun on this machine
(DDP, or FSDP2 with --parallel fsdp; gloo on the CPU): every SIGTERM reaches
all ranks, the SIGKILL takes rank 0, the whole group restarts together, and
every rank's final state is compared.

Writes everything under ./.ckpt (catalog, bundles, admin token; logs in
./.ckpt/demo/RUN). Prints each attempt and how it ended, the bundles and bytes
saved, the comparison, the run's page on the dashboard and the commands that
ask the control plane about the run; --serve keeps the control plane up
afterwards, until Ctrl-C. Exits 0 when the runs are bit-identical, 1 otherwise."""


@dataclass(frozen=True)
class Plan:
    run: str
    steps: int
    every: int
    preemptions: int
    kill_upload_at: int  # the step whose upload is killed with SIGKILL
    nproc: int = 1  # ranks; more than one: ranks.py under torchrun
    parallel: str = "ddp"  # how ranks.py shares the model: ddp or fsdp


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ckpt demo",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--store", default=".ckpt/store", help="where bundles go (default: ./.ckpt/store)"
    )
    parser.add_argument(
        "--server", default=None, help="use this control plane instead of starting one"
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="keep the control plane (and its dashboard) up after the report, until Ctrl-C",
    )
    parser.add_argument(
        "--steps", type=int, default=60, help="optimizer steps to train (default 60)"
    )
    parser.add_argument("--every", type=int, default=5, help="save every N steps (default 5)")
    parser.add_argument("--preemptions", type=int, default=3, help="SIGTERMs to send (default 3)")
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the chaos (default: a new one each run)"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks: more than 1 trains DDP or FSDP2 under torchrun on this machine (default 1)",
    )
    parser.add_argument(
        "--parallel",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="with --nproc > 1: replicate the model (ddp) or shard it (fsdp) (default ddp)",
    )
    args = parser.parse_args(argv)
    if args.every < 1 or args.steps < 3 * args.every:
        parser.error(f"--steps must be at least 3 x --every (got {args.steps}, {args.every})")
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1 (got {args.nproc})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    chooser = random.Random(args.seed)
    plan = Plan(
        run=f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{chooser.randrange(1 << 16):04x}",
        steps=args.steps,
        every=args.every,
        preemptions=args.preemptions,
        kill_upload_at=args.every * chooser.randrange(1, args.steps // args.every),
        nproc=args.nproc,
        parallel=args.parallel,
    )
    work = Path(".ckpt") / "demo" / plan.run
    work.mkdir(parents=True, exist_ok=True)
    print(f"ckpt demo: run {plan.run}; bundles in {args.store}")
    with control_plane(args, work) as (url, token):
        print(f"1. control plane at {url}; the run's page: {dashboard_url(url, plan.run)}")
        print(
            f"2. training {plan.steps} steps{_on_ranks(plan)} under `ckpt launch`, saving "
            f"every {plan.every}; "
            f"{plan.preemptions} SIGTERMs at random steps, then a SIGKILL in the middle of "
            f"an upload: of the first bundle at or after step {plan.kill_upload_at} that the "
            "attempt after the last SIGTERM saves"
        )
        started = time.monotonic()
        rc, signals = _train_with_chaos(
            args, plan, work=work, url=url, token=token, chooser=chooser
        )
        print(f"   done in {time.monotonic() - started:.0f} s (ckpt launch exited {rc})")
        if rc != 0:
            print(f"the run did not finish: see {work / 'launch.log'}", file=sys.stderr)
            return 1
        facts = _facts(url, token, plan.run)
        print("3. a reference run trains the same job without interruption")
        _reference(plan, work)
        code = report(
            work, facts, sigterms=signals, kill_upload_at=plan.kill_upload_at, nproc=plan.nproc
        )
        kept = args.server or args.serve
        print_next_steps(url if kept else None, plan.run, ckpt=ckpt_here())
        if args.serve and not args.server:
            serve_until_interrupted(url, plan.run)
    return code


def _on_ranks(plan: Plan) -> str:
    if plan.nproc == 1:
        return ""
    return f" on {plan.nproc} ranks ({plan.parallel.upper()}, torchrun)"


def _trainer(plan: Plan, store: str, out: Path, *extra: str) -> list[str]:
    """The training command: ``train.py``, or ``ranks.py`` under torchrun for many ranks.

    ``ranks.py`` takes the run's name from ``CKPT_RUN`` (``_job_env``): torchrun would read
    a ``--run`` as its own ``--run-path``.
    """
    if plan.nproc > 1:
        return [
            *_torchrun(),
            "--nproc-per-node",
            str(plan.nproc),
            "-m",
            "agent.demo.ranks",
            "--parallel",
            plan.parallel,
            "--store",
            store,
            "--out",
            str(out),
            "--steps",
            str(plan.steps),
            "--total-steps",
            str(plan.steps + 20),
            *extra,
        ]
    return [
        sys.executable,
        "-m",
        "agent.demo.train",
        "--store",
        store,
        "--run",
        plan.run,
        "--out",
        str(out),
        "--steps",
        str(plan.steps),
        "--total-steps",
        str(plan.steps + 20),
        *extra,
    ]


def _torchrun() -> list[str]:
    """torchrun of this installation: the console script beside this Python, if any."""
    beside = Path(sys.executable).parent / "torchrun"
    return [str(beside)] if beside.is_file() else [sys.executable, "-m", "torch.distributed.run"]


def _job_env(plan: Plan, run: str) -> dict[str, str]:
    """What the training command needs in its environment besides the caller's."""
    return {"CKPT_RUN": run} if plan.nproc > 1 else {}


def _train_with_chaos(
    args: argparse.Namespace,
    plan: Plan,
    *,
    work: Path,
    url: str,
    token: str | None,
    chooser: random.Random,
) -> tuple[int, int]:
    """Run the job under ``ckpt launch`` and preempt it; returns (exit code, SIGTERMs sent)."""
    pid_file, hold = work / "trainer.pid", work / "hold-at-step"
    drills = (
        "--every",
        str(plan.every),
        "--kill-during-upload",
        str(plan.kill_upload_at),
        "--drill-marker",
        str(work / DRILL_RECORD),
        "--hold-file",
        str(hold),
    )
    command = [
        sys.executable,
        "-m",
        "ckpt",
        "launch",
        "--max-restarts",
        str(plan.preemptions + 3),
        "--backoff",
        "0.5",
        "--pid-file",
        str(pid_file),
        "--",
        *_trainer(plan, args.store, work / "final.pt", *drills),
    ]
    env = {
        **os.environ,
        **_job_env(plan, plan.run),
        "CKPT_SERVER": url,
        "CKPT_GRACE_SECONDS": str(GRACE_SECONDS),
        "CKPT_HEARTBEAT_SECONDS": "0.2",  # the chaos loop aims by the steps they report
        **({"CKPT_TOKEN": token} if token else {}),
    }
    # SIGTERM when the live attempt's heartbeats report these steps: spread over the run. The
    # trainer holds at the next one (``drills.hold_for_signal``) until the SIGTERM comes: aimed
    # by heartbeats alone, it could land steps late on a busy machine, or after the last step.
    targets = sorted(chooser.sample(range(2, plan.steps - 2), plan.preemptions))
    _hold_at(hold, targets[0] if targets else None)
    # The SIGKILL drill is held (its record file exists) until the last SIGTERM has stopped
    # its attempt: a SIGTERM that came while the drill's upload ran (in the background, while
    # the trainer held) met an attempt the drill killed, and preempted none.
    drill = work / DRILL_RECORD
    if targets:
        record_drill(str(drill), outcome="held", step=plan.kill_upload_at)
    headers = bearer(token)
    with (
        (work / "launch.log").open("w") as log,
        httpx.Client(base_url=url, headers=headers, timeout=10) as client,
    ):
        launch = subprocess.Popen(command, env=env, stdout=log, stderr=log)
        sent = 0
        trainers: dict[int, str] = {}  # epoch -> the pid file's trainer that ran it
        while launch.poll() is None:
            time.sleep(0.1)
            if sent == len(targets):
                continue
            if not _preempt_at(
                targets[sent], client, plan.run, pid_file=pid_file, trainers=trainers
            ):
                continue
            print(f"   SIGTERM {sent + 1} of {len(targets)} sent (step {targets[sent]} or later)")
            sent += 1
            # Moved on once the signalled attempt has ended: it holds until it noted the signal.
            _await_restart(pid_file, launch)
            _hold_at(hold, targets[sent] if sent < len(targets) else None)  # the next attempt's
            if sent == len(targets):
                drill.unlink()  # armed: the attempt now starting meets it
        if sent < len(targets):  # the run finished first: the drill never was armed
            drill.unlink()
            hold.unlink()
        return launch.wait(), sent


def _hold_at(hold: Path, step: int | None) -> None:
    """Name the step the trainer holds at for its SIGTERM (None: no more), in one write."""
    if step is None:
        hold.unlink(missing_ok=True)
        return
    partial = hold.with_suffix(".partial")
    partial.write_text(str(step))
    partial.replace(hold)


def _await_restart(pid_file: Path, launch: subprocess.Popen[bytes]) -> None:
    """Until ``ckpt launch`` has started the next attempt (or ended)."""
    try:
        before = pid_file.read_text()
    except OSError:
        return
    while launch.poll() is None:
        with suppress(OSError):
            if pid_file.read_text() != before:
                return
        time.sleep(0.1)


def _preempt_at(
    step: int, client: httpx.Client, run: str, *, pid_file: Path, trainers: dict[int, str]
) -> bool:
    """SIGTERM the trainer once its live attempt reports ``step``; whether it was sent.

    ``trainers`` maps each attempt's epoch to the trainer that ran it (the pid file when the
    epoch was first seen): an attempt that was killed never ends in the lineage, and the
    trainer started after it must not be signalled for the steps it reported.
    """
    with suppress(httpx.HTTPError, OSError, ValueError, KeyError, IndexError, TypeError):
        attempt = client.get(f"/v1/runs/{run}/lineage").json()["attempts"][-1]
        trainer = pid_file.read_text()
        live = trainers.setdefault(attempt["epoch"], trainer) == trainer
        if live and attempt["ended_at"] is None and (attempt["last_step"] or 0) >= step:
            os.kill(int(trainer), signal.SIGTERM)
            return True
    return False


def _facts(url: str, token: str | None, run: str) -> dict[str, Any]:
    headers = bearer(token)
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        # The SIGKILLed attempt never says goodbye: give the server's sweep the time to mark
        # it lost (5 s without heartbeats, checked every 2.5 s; longer on a busy machine).
        deadline = time.monotonic() + 30
        while True:
            lineage = client.get(f"/v1/runs/{run}/lineage").raise_for_status().json()
            silent = [a for a in lineage["attempts"][:-1] if a["ended_at"] is None]
            if not silent or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        complete = [b for b in lineage["bundles"] if b["status"] == "complete"]
        saves = [
            save
            for bundle in complete
            for save in client.get(f"/v1/bundles/{bundle['id']}").raise_for_status().json()["saves"]
        ]
        # The run's goodput as the control plane computes it: the figure the dashboard and
        # GET /v1/runs/{run}/goodput show, not a sum made here.
        goodput = client.get(f"/v1/runs/{run}/goodput").raise_for_status().json()
    return {"lineage": lineage, "bundles": complete, "saves": saves, "goodput": goodput}


def _reference(plan: Plan, work: Path) -> None:
    run = f"{plan.run}-reference"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(_job_env(plan, run))
    command = _trainer(plan, str(work / "reference-store"), work / "reference.pt")
    if plan.nproc == 1:
        command[command.index("--run") + 1] = run
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{done.stderr[-3000:]}")
