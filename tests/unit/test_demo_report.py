"""What ``ckpt demo`` prints: commands that work as printed, every attempt, the SIGKILL
drill as it happened, and a verdict that covers every rank. (The demo itself runs in
tests/integration/test_demo.py.)"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.demo.compare import differences
from agent.demo.report import (
    ckpt_command,
    format_attempt,
    format_drill,
    format_goodput,
    report,
)


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho ckpt-here\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A project directory with ``.venv/bin/{python,ckpt}``; returns the project."""
    project = tmp_path / "my project"
    executable(project / ".venv" / "bin" / "python")
    executable(project / ".venv" / "bin" / "ckpt")
    return project


def test_the_console_script_under_the_cwd_is_shown_relative(venv: Path) -> None:
    script = venv / ".venv" / "bin" / "ckpt"
    python = str(venv / ".venv" / "bin" / "python")
    assert ckpt_command(script=str(script), on_path=None, python=python, cwd=venv) == (
        ".venv/bin/ckpt"
    )
    # as typed: a relative argv[0]
    assert ckpt_command(script=".venv/bin/ckpt", on_path=None, python=python, cwd=venv) == (
        ".venv/bin/ckpt"
    )


def test_the_name_alone_when_path_finds_this_very_script(venv: Path) -> None:
    script = str(venv / ".venv" / "bin" / "ckpt")
    python = str(venv / ".venv" / "bin" / "python")
    assert ckpt_command(script=script, on_path=script, python=python, cwd=venv) == "ckpt"


def test_another_ckpt_on_path_is_not_trusted(venv: Path, tmp_path: Path) -> None:
    other = executable(tmp_path / "elsewhere" / "ckpt")
    script = str(venv / ".venv" / "bin" / "ckpt")
    python = str(venv / ".venv" / "bin" / "python")
    assert ckpt_command(script=script, on_path=str(other), python=python, cwd=venv) == (
        ".venv/bin/ckpt"
    )


def test_outside_the_cwd_the_path_is_absolute_and_quoted(venv: Path, tmp_path: Path) -> None:
    script = venv / ".venv" / "bin" / "ckpt"
    python = str(venv / ".venv" / "bin" / "python")
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    shown = ckpt_command(script=str(script), on_path=None, python=python, cwd=elsewhere)
    assert shlex.split(shown) == [str(script)]
    done = subprocess.run(
        f"{shown} --version", shell=True, capture_output=True, text=True, check=True
    )
    assert done.stdout == "ckpt-here\n"  # it runs as printed, space in the path and all


def test_python_dash_m_finds_the_script_beside_its_interpreter(venv: Path) -> None:
    python = str(venv / ".venv" / "bin" / "python")
    main = str(venv / "src" / "ckpt" / "__main__.py")
    assert ckpt_command(script=main, on_path=None, python=python, cwd=venv) == ".venv/bin/ckpt"


def test_without_a_console_script_it_is_python_dash_m(tmp_path: Path) -> None:
    python = executable(tmp_path / "env" / "bin" / "python")
    shown = ckpt_command(script="-c", on_path=None, python=str(python), cwd=tmp_path)
    assert shown == "env/bin/python -m ckpt"


def attempt(epoch: int, reason: str | None, step: int | None, **more: Any) -> dict[str, Any]:
    fields = {"final_save_committed": None, "steps_lost": None, **more}
    return {"epoch": epoch, "end_reason": reason, "last_step": step, **fields}


@pytest.mark.parametrize(
    ("row", "line"),
    [
        (
            attempt(1, "lost", 2, steps_lost=2),
            "  attempt 1: lost at step 2 (killed: no final save, no goodbye), steps lost: 2",
        ),
        (
            attempt(2, "preempted", 12, final_save_committed=True, steps_lost=0),
            "  attempt 2: preempted at step 12, final save committed: yes, steps lost: 0",
        ),
        (
            attempt(3, "preempted", 25, final_save_committed=False),
            "  attempt 3: preempted at step 25, final save committed: no, steps lost: ?",
        ),
        (attempt(4, "finished", 30), "  attempt 4: finished at step 30"),
        (attempt(5, None, None), "  attempt 5: not ended at step ?, steps lost: ?"),
    ],
)
def test_format_attempt(row: dict[str, Any], line: str) -> None:
    assert format_attempt(row) == line


def test_format_goodput_prints_the_control_planes_answer() -> None:
    parts = {"restart": 6.0, "stall": 2.0, "train": 32.0, "redo": 5.0, "wall": 40.0}
    spent: dict[str, Any] = {f"{part}_seconds": value for part, value in parts.items()}
    answer = {"run": "r", "attempts": 2, "time": spent | {"goodput": 27 / 40}}
    assert format_goodput(answer) == (
        "67.5% of 40.0 s trained and kept (restarts 6.0 s, saves 2.0 s, lost steps redone 5.0 s)"
    )
    assert format_goodput({"time": spent | {"goodput": None}}).startswith("unknown")
    assert format_goodput(None).startswith("unknown")


def test_the_report_prints_bytes_in_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saves = [
        {"payload_bytes": 3_400_000, "new_bytes": 1_200_000},
        {"payload_bytes": 600_000, "new_bytes": 0},
    ]
    facts: dict[str, Any] = {"lineage": {"attempts": []}, "bundles": [], "saves": saves}
    torch.save(rank_state(1), tmp_path / "reference.pt")
    torch.save(rank_state(1), tmp_path / "final.pt")
    assert report(tmp_path, facts, sigterms=0, kill_upload_at=5) == 0
    out = capsys.readouterr().out
    assert (
        "bytes:                        4.00 MB in bundles, 1.20 MB uploaded (2.80 MB deduplicated)\n"
        in out
    )
    assert "goodput (time):               unknown" in out


def test_format_drill_says_what_happened() -> None:
    assert format_drill({"outcome": "killed", "step": 10}, step=10) == (
        "fired while the bundle of step 10 was uploading"
    )
    skipped = format_drill({"outcome": "nothing to upload", "step": 10}, step=10)
    assert skipped.startswith("did not fire: the bundle of step 10 had nothing to upload")
    assert format_drill(None, step=15).startswith("did not fire: no attempt after the SIGTERMs")


def rank_state(value: float) -> dict[str, Any]:
    """A final state as ``agent.demo.ranks`` writes it, per rank."""
    return {
        "model": {"w": torch.full((2,), value)},
        "optimizer": {},
        "lr": [0.1],
        "scaler": {},
        "positions": [(1, 1), (2, 0)],
        "losses": torch.tensor([0.5, 0.25]),
        "record_lrs": [0.1, 0.1],
    }


def test_the_verdict_on_many_ranks_covers_every_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    facts: dict[str, Any] = {"lineage": {"attempts": []}, "bundles": [], "saves": []}
    for rank in (0, 1):
        torch.save(rank_state(rank), tmp_path / f"reference.pt.rank{rank}")
        torch.save(rank_state(rank), tmp_path / f"final.pt.rank{rank}")
    assert report(tmp_path, facts, sigterms=0, kill_upload_at=5, nproc=2) == 0
    out = capsys.readouterr().out
    assert (
        "micro-batches compared:       2 per rank on 2 ranks (the last attempt that trained)" in out
    )
    assert "identical on every rank (2)" in out

    torch.save(rank_state(7), tmp_path / "final.pt.rank1")  # rank 1 alone differs
    assert report(tmp_path, facts, sigterms=0, kill_upload_at=5, nproc=2) == 1
    out = capsys.readouterr().out
    assert "BIT-EXACT: NO\n  - rank 1: parameter/buffer w differs\n" in out


def test_a_differing_loss_sequence_says_where_it_first_differs() -> None:
    def run(losses: list[float]) -> dict[str, Any]:
        positions = [(step, micro) for step in range(1, 3) for micro in range(2)]
        return {
            "model": {},
            "optimizer": {},
            "lr": [0.1],
            "scaler": {},
            "positions": positions[-len(losses) :],
            "losses": torch.tensor(losses, dtype=torch.float64),
            "record_lrs": [0.1] * len(losses),
        }

    reference = run([1.0, 0.5, 0.25, 0.125])
    assert differences(reference, run([0.5, 0.25, 0.125])) == []
    assert differences(reference, run([0.5, 0.25, 0.1])) == [
        "the per-micro-batch loss sequence differs",
        "first at micro-batch 2 of the resume, position (2, 1): 0.125 != 0.1",
    ]
