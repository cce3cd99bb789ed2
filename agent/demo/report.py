"""What ``ckpt demo`` prints at the end: every attempt, the SIGKILL drill as it happened,
the comparison with the reference run, and commands that work as printed."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from agent.demo.compare import differences
from agent.demo.server import dashboard_url
from agent.summary import format_bytes

DRILL_RECORD = "sigkill-drill.json"  # what the SIGKILL drill did, written by the trainer


def report(
    work: Path, facts: dict[str, Any], *, sigterms: int, kill_upload_at: int, nproc: int = 1
) -> int:
    """Print what happened and the comparison; 0 when bit-identical to the reference.

    With ``nproc`` > 1 every rank's final state (``final.pt.rank<R>``) is compared with the
    reference's, and the verdict covers them all.
    """
    attempts = facts["lineage"]["attempts"]
    drill = _drill_record(work)
    sigkills = int(drill is not None and drill["outcome"] == "killed")
    finals, references = _states(work / "final.pt", nproc), _states(work / "reference.pt", nproc)
    stored = sum(save["payload_bytes"] for save in facts["saves"])
    uploaded = sum(save["new_bytes"] for save in facts["saves"])
    print()
    print(
        f"attempts:                     {len(attempts)} ({sigterms} SIGTERMs sent, "
        f"{sigkills} SIGKILL{'' if sigkills == 1 else 's'} in an upload)"
    )
    for attempt in attempts:
        print(format_attempt(attempt))
    print(f"goodput (time):               {format_goodput(facts.get('goodput'))}")
    print(f"SIGKILL drill:                {format_drill(drill, step=kill_upload_at)}")
    print(f"bundles saved:                {len(facts['bundles'])}")
    print(
        f"bytes:                        {format_bytes(stored)} in bundles, "
        f"{format_bytes(uploaded)} uploaded ({format_bytes(stored - uploaded)} deduplicated)"
    )
    print(f"micro-batches compared:       {_compared(finals)} (the last attempt that trained)")
    found = _differences(references, finals)
    verdicts = f"resumes verified:             {format_verdicts(attempts)}"
    if found:
        print("BIT-EXACT: NO")
        for item in found:
            print(f"  - {item}")
        print(verdicts)
        return 1
    every = "" if nproc == 1 else f" on every rank ({nproc})"
    print(f"BIT-EXACT: yes - every parameter, optimizer tensor, LR and loss is identical{every}")
    print(verdicts)
    if any((a.get("verification") or {}).get("verdict") == "diverged" for a in attempts):
        print("  - a resume diverged from the steps it replayed, yet the run is bit-exact")
        return 1
    return 0


def format_verdicts(attempts: list[dict[str, Any]]) -> str:
    """What each resume proved about the steps it replayed (``agent.verify``), by attempt."""
    said = [
        f"attempt {attempt['epoch']} {format_verification(attempt['verification'])}"
        for attempt in attempts
        if attempt.get("verification")
    ]
    return ", ".join(said) or "none reported"


def format_verification(verification: dict[str, Any]) -> str:
    """``verified 37 steps``, ``diverged at 1204: loss 2.3811 vs 2.3809`` (got vs expected, as
    ``ckpt attempts`` and the agent's own line say it), ``unverifiable``."""
    if verification["verdict"] == "verified":
        return f"verified {verification['steps_compared']} steps"
    first = verification.get("first_difference")
    if verification["verdict"] == "diverged" and first:
        return f"diverged at {first['step']}: {first['part']} {first['got']} vs {first['expected']}"
    return str(verification["verdict"])


def _states(path: Path, nproc: int) -> list[dict[str, Any]]:
    """The final state of each rank: ``path`` itself for one, ``path.rank<R>`` for many."""
    paths = [path] if nproc == 1 else [Path(f"{path}.rank{rank}") for rank in range(nproc)]
    return [torch.load(each, weights_only=True) for each in paths]


def _compared(finals: list[dict[str, Any]]) -> str:
    counts = {len(final["positions"]) for final in finals}
    if len(finals) == 1:
        return str(counts.pop())
    per_rank = counts.pop() if len(counts) == 1 else "/".join(map(str, sorted(counts)))
    return f"{per_rank} per rank on {len(finals)} ranks"


def _differences(references: list[dict[str, Any]], finals: list[dict[str, Any]]) -> list[str]:
    """What differs, rank by rank (named when there are many)."""
    if len(finals) == 1:
        return differences(references[0], finals[0])
    return [
        f"rank {rank}: {item}"
        for rank, (reference, final) in enumerate(zip(references, finals, strict=True))
        for item in differences(reference, final)
    ]


def _drill_record(work: Path) -> dict[str, Any] | None:
    """What the trainer recorded of the SIGKILL drill (``drills.record_drill``), if anything."""
    try:
        record: dict[str, Any] = json.loads((work / DRILL_RECORD).read_text())
    except FileNotFoundError:
        return None
    return record


def format_attempt(attempt: dict[str, Any]) -> str:
    """One attempt of the lineage: how it ended, where, and what it cost."""
    reason = attempt["end_reason"] or "not ended"
    step = "?" if attempt["last_step"] is None else attempt["last_step"]
    line = f"  attempt {attempt['epoch']}: {reason} at step {step}"
    if reason == "finished":
        return line
    if reason == "preempted":
        committed = "yes" if attempt["final_save_committed"] else "no"
        line += f", final save committed: {committed}"
    elif reason == "lost":
        line += " (killed: no final save, no goodbye)"
    lost = attempt.get("steps_lost")
    bound = "at least " if attempt.get("steps_lost_exact") is False else ""
    return f"{line}, steps lost: {'?' if lost is None else f'{bound}{lost}'}"


def format_goodput(answer: dict[str, Any] | None) -> str:
    """The run's goodput (time) as ``GET /v1/runs/{run}/goodput`` answers it (the definition
    is ``ckpt.core.goodput``'s), to the dashboard's precision (``percent``)."""
    spent = (answer or {}).get("time") or {}
    if spent.get("goodput") is None:
        return "unknown (no attempt reported its time)"
    return (
        f"{percent(spent['goodput'])} of {spent['wall_seconds']:.1f} s trained and kept "
        f"(restarts {spent['restart_seconds']:.1f} s, saves {spent['stall_seconds']:.1f} s, "
        f"lost steps redone {spent['redo_seconds']:.1f} s)"
    )


def percent(share: float) -> str:
    """``46.2%``: a share as the demo and the dashboard print it."""
    return f"{share:.1%}"


def format_drill(record: dict[str, Any] | None, *, step: int) -> str:
    """What the SIGKILL drill aimed at the upload of the bundle of ``step`` did."""
    if record is None:
        return f"did not fire: no attempt after the SIGTERMs saved a bundle at or after step {step}"
    if record["outcome"] == "killed":
        return f"fired while the bundle of step {record['step']} was uploading"
    return (
        f"did not fire: the bundle of step {record['step']} had nothing to upload (the "
        "store already held every blob of it, saved by an earlier run of the same job)"
    )


def print_next_steps(server: str | None, run: str, *, ckpt: str) -> None:
    print()
    if server is None:
        print("The catalog and bundles stay in ./.ckpt. Start the control plane on them and ask:")
        print(f"  {ckpt} server &")
        server = "http://127.0.0.1:8470"
    print(
        f'  curl -H "Authorization: Bearer $(cat .ckpt/admin-token)" {server}/v1/runs/{run}/resumable'
    )
    print(
        f'  curl -H "Authorization: Bearer $(cat .ckpt/admin-token)" {server}/v1/runs/{run}/lineage'
    )
    print(f"  {ckpt} resumable {run}     # the same through the CLI")
    print(f"  {dashboard_url(server, run)}     # the dashboard (sign in with the token)")


def ckpt_here() -> str:
    return ckpt_command(
        script=sys.argv[0], on_path=shutil.which("ckpt"), python=sys.executable, cwd=Path.cwd()
    )


def ckpt_command(*, script: str, on_path: str | None, python: str, cwd: Path) -> str:
    """How to type ``ckpt`` in ``cwd`` so that it runs this installation.

    ``ckpt`` when that name on PATH is this one; else the console script (the one running,
    or the one beside ``python``), shown relative to ``cwd`` when under it, e.g.
    ``.venv/bin/ckpt``; else ``python -m ckpt`` with this interpreter.
    """
    running = Path(script)
    beside = Path(python).parent / "ckpt"
    installed = running if running.name == "ckpt" and running.is_file() else beside
    if not installed.is_file():
        return f"{_shown(Path(python), cwd=cwd)} -m ckpt"
    if on_path is not None and os.path.samefile(on_path, installed):
        return "ckpt"
    return _shown(installed, cwd=cwd)


def _shown(path: Path, *, cwd: Path) -> str:
    """``path`` as typed in ``cwd``: relative when under it (``./ckpt``, ``.venv/bin/ckpt``)."""
    absolute = Path(os.path.normpath(cwd / path))
    if absolute.is_relative_to(cwd):
        relative = absolute.relative_to(cwd).as_posix()
        return shlex.quote(relative if "/" in relative else f"./{relative}")
    return shlex.quote(str(absolute))
