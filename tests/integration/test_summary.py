"""What a user sees without configuring logging: one line per resume and per durable save,
in words (no internal reprs), silenced by CKPT_QUIET."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.attempt.grace import describe
from agent.save.policy import Position
from agent.summary import format_seconds

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from ckpt import Checkpointer

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(run="words", store=sys.argv[1], models=model, optimizers=optimizer) as ckpt:
        ckpt.resume()
        ckpt.counters.step += 5
        ckpt.counters.micro_step = 2
        ckpt.save().wait()
    """
)


def run(store: Path, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(store)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, **env},
    )
    return done.stderr


def test_each_resume_and_durable_save_prints_one_line(tmp_path: Path) -> None:
    first = run(tmp_path / "store").splitlines()
    assert len(first) == 2, first
    assert first[0].startswith("ckpt: run words: no resumable bundle in file://")
    assert first[1].startswith("ckpt: run words: saved step 5, micro step 2: ")
    assert "new), stall " in first[1] and "durable after " in first[1]
    second = run(tmp_path / "store").splitlines()
    assert second[0] == (
        "ckpt: run words: resumed from runs/words/bundles/000000000005_000002 at step 5, "
        "micro step 2 "
        "(layers weights, optimizer, scheduler, rng, data, counters)"
    )
    assert second[1].startswith("ckpt: run words: saved step 10, micro step 2: ")


def test_quiet_prints_nothing(tmp_path: Path) -> None:
    assert run(tmp_path / "store", CKPT_QUIET="1") == ""


@pytest.mark.parametrize(
    ("position", "text"),
    [(Position(50, 0), "step 50"), (Position(50, 3), "step 50, micro step 3")],
)
def test_positions_read_as_words(position: Position, text: str) -> None:
    assert str(position) == text
    assert describe(position) == f"the last bundle is at {text}"


def test_no_bundle_reads_as_words() -> None:
    assert describe(None) == "nothing is saved yet, so the run starts over"


def test_a_broken_stderr_fails_no_save(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "store")],
        stderr=subprocess.PIPE,
        env=os.environ,
    ) as process:
        assert process.stderr is not None
        process.stderr.close()  # every line ckpt prints now raises BrokenPipeError
        assert process.wait(timeout=300) == 0
    assert (tmp_path / "store" / "runs" / "words" / "bundles" / "000000000005_000002").is_dir()


AUTO = textwrap.dedent(
    """
    import sys
    import torch
    from ckpt import Checkpointer

    model = torch.nn.Linear(4, 4)
    # The first save comes 0.05 s in, to measure one; the interval it sizes is capped at
    # 2.5 s (the optimum for a 4 h mean time between preemptions is far longer).
    with Checkpointer(
        run="auto", store=sys.argv[1], models=model, every="auto", auto_min_seconds=0.05,
        auto_max_seconds=2.5,
    ) as ckpt:
        ckpt.resume()
        while ckpt.maybe_save() is None:
            ckpt.counters.step += 1
    """
)


def test_a_new_auto_interval_is_printed_with_its_fraction_of_a_second(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", AUTO, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    changes = [line for line in done.stderr.splitlines() if "saving every" in line]
    assert len(changes) == 1, done.stderr
    assert changes[0].startswith("ckpt: run auto: saving every 2.5 s (a save stalls ")
    assert "preemptions come every 4 h on average" in changes[0]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0123, "12.3 ms"), (0.35, "350 ms"), (2.5, "2.5 s"), (42.31, "42.3 s"), (1234.5, "1234 s")],
)
def test_durations_read_with_three_significant_figures(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text
