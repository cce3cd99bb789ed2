"""Goodput: the parts of an attempt's time and their sum over a run (``ckpt.core.goodput``),
and the agent's account of them (``agent.attempt.goodput``) on a clock the test moves."""

from __future__ import annotations

import time

import pytest

from agent.attempt.goodput import TimeAccount, process_started_at
from ckpt.core.goodput import TimeSpent, redo_seconds


def test_goodput_is_kept_training_over_wall_time() -> None:
    spent = TimeSpent(restart_seconds=30, stall_seconds=10, train_seconds=160, redo_seconds=40)
    assert spent.wall_seconds == 200
    assert spent.goodput == pytest.approx((160 - 40) / 200)
    assert TimeSpent().goodput is None
    run = spent + TimeSpent(restart_seconds=20, train_seconds=80)
    assert run == TimeSpent(50, 10, 240, 40)
    assert run.goodput == pytest.approx(200 / 300)


def test_the_steps_lost_are_priced_at_the_mean_step_time() -> None:
    assert redo_seconds(train_seconds=100, steps_trained=50, steps_lost=10) == 20
    assert redo_seconds(train_seconds=100, steps_trained=50, steps_lost=None) == 0
    assert redo_seconds(train_seconds=100, steps_trained=0, steps_lost=3) == 0
    assert redo_seconds(train_seconds=100, steps_trained=5, steps_lost=9) == 100  # at most all


def test_the_agent_accounts_restart_stall_and_training() -> None:
    now = [time.time()]
    account = TimeAccount(clock=lambda: now[0])
    assert account.started_at <= now[0]
    assert account.figures(step=0) is None  # not ready to train yet
    now[0] += 5
    account.ready(step=100)  # resumed at step 100
    assert account.ready_at is not None
    restart = account.ready_at - account.started_at
    assert restart >= 5
    now[0] += 60
    account.stalled(4.0)
    account.ready(step=999)  # only the first counts
    figures = account.figures(step=130)
    assert figures == {
        "restart_seconds": pytest.approx(restart),
        "stall_seconds": 4.0,
        "train_seconds": pytest.approx(56.0),
        "steps_trained": 30,
    }


def test_the_process_start_is_read_from_proc() -> None:
    started = process_started_at()
    # This test process started before the test, and not days before.
    assert time.time() - 3 * 86400 < started <= time.time()
