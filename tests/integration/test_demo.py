from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# The console script pip installed beside this interpreter.
CKPT = str(Path(sys.executable).parent / "ckpt")
DEMO = [CKPT, "demo", "--steps", "30", "--every", "5", "--preemptions", "2", "--seed", "3"]


def without_the_venv_on_path() -> dict[str, str]:
    """The environment of a user who never activated the virtualenv."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    return {**os.environ, "PATH": path}


def demo(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        [*DEMO, *args],
        cwd=cwd,
        env=without_the_venv_on_path(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BIT-EXACT: yes" in done.stdout
    # Beside it, each resume's own verdict on the steps it replayed; the two agree.
    verdicts = re.search(r"^resumes verified: +(.*)$", done.stdout, re.MULTILINE)
    assert verdicts is not None and "diverged" not in verdicts.group(1), done.stdout
    return done.stdout


def sigkills_reported(out: str, *, sigterms_sent: int = 2) -> int:
    """The report's attempt count line, checked against the attempts it lists."""
    found = re.search(
        r"^attempts: +(\d+) \((\d+) SIGTERMs sent, (\d+) SIGKILLs? in an upload\)$", out, re.M
    )
    assert found, out
    count, sigterms, sigkills = map(int, found.groups())
    listed = re.findall(r"^  attempt (\d+): (\w[\w ]*) at step", out, re.M)
    assert [int(epoch) for epoch, _ in listed] == list(range(1, count + 1)), out
    assert listed[-1][1] == "finished", out  # the last attempt is listed too
    assert sigterms == sigterms_sent
    return sigkills


def launch_log(out: str, cwd: Path) -> str:
    run = re.search(r"^ckpt demo: run (\S+);", out, re.M)
    assert run, out
    return (cwd / ".ckpt" / "demo" / run.group(1) / "launch.log").read_text()


def sigkills_in_the_launch_log(out: str, cwd: Path) -> int:
    return launch_log(out, cwd).count("killed during an upload")


def hinted_ckpt(out: str) -> str:
    """The ``ckpt`` the closing hints tell the user to type."""
    found = re.search(r"^  (.+) server &$", out, re.M)
    assert found, out
    return found.group(1)


def test_ckpt_demo_reports_what_happened_on_a_new_and_on_a_reused_store(tmp_path: Path) -> None:
    first = demo(tmp_path)
    assert "SIGTERM 2 of 2 sent" in first
    assert "preempted at step" in first  # an attempt the agent ended itself
    assert "lost at step" in first  # the SIGKILLed one, marked by the control plane
    assert "/v1/runs/demo-" in first and "/resumable" in first
    assert list((tmp_path / ".ckpt" / "store" / "runs").iterdir())
    assert sigkills_reported(first) == sigkills_in_the_launch_log(first, tmp_path) == 1
    assert re.search(
        r"^goodput \(time\): +\d+\.\d% of [\d.]+ s trained and kept \(restarts ", first, re.M
    )
    assert re.search(
        r"^SIGKILL drill: +fired while the bundle of step \d+ was uploading$", first, re.M
    )
    # The resume after the SIGKILL replayed the steps since the bundle before: verified.
    assert re.search(r"^resumes verified: .*attempt \d+ verified \d+ steps", first, re.M)

    # The hints work as printed for a user who never activated the virtualenv.
    version = subprocess.run(
        f"{hinted_ckpt(first)} --version",
        shell=True,
        cwd=tmp_path,
        env=without_the_venv_on_path(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert version.returncode == 0 and version.stdout.startswith("ckpt "), version.stderr
    assert f"  {hinted_ckpt(first)} resumable demo-" in first

    # Again on the same store: the bundle the drill aims at is already there, so its upload
    # has nothing to kill, and the report says so instead of claiming a SIGKILL.
    second = demo(tmp_path)
    assert sigkills_reported(second) == sigkills_in_the_launch_log(second, tmp_path) == 0
    assert re.search(r"^SIGKILL drill: +did not fire: .* had nothing to upload", second, re.M)
    assert "lost at step" not in second


def test_ckpt_demo_on_two_ranks_restarts_the_group_and_compares_every_rank(
    tmp_path: Path,
) -> None:
    out = demo(tmp_path, "--nproc", "2", "--steps", "12", "--every", "3", "--preemptions", "1")
    assert "training 12 steps on 2 ranks (DDP, torchrun) under `ckpt launch`" in out
    assert sigkills_reported(out, sigterms_sent=1) == sigkills_in_the_launch_log(out, tmp_path) == 1
    assert "preempted at step" in out and "lost at step" in out
    assert re.search(r"^micro-batches compared: +\d+ per rank on 2 ranks", out, re.M), out
    assert "identical on every rank (2)" in out
    # The SIGTERM went to torchrun, which stopped both ranks; rank 0's SIGKILL ended the
    # group; ckpt launch read both as preemptions and restarted the whole group.
    log = launch_log(out, tmp_path)
    assert "ckpt launch: torchrun (stopped by SIGTERM) exited with 1 (preempted)" in log
    assert "ckpt launch: torchrun exited with 1: rank 0 killed by SIGKILL first (preempted)" in log
    assert log.count("preempted by SIGTERM") == 2  # each rank, at the same boundary
    assert log.count("ckpt launch: trainer succeeded") == 1


def test_ckpt_without_a_command_explains_itself() -> None:
    done = subprocess.run([CKPT], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "demo" in done.stderr
