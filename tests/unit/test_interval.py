"""The automatic save interval: the estimator against known traces, the Young/Daly rule,
the agent's re-evaluation, and a simulation on a synthetic preemption trace in which the
automatic interval loses less work than fixed intervals 4x shorter and 4x longer."""

from __future__ import annotations

import logging
import math
import random

import pytest

from agent.attempt.interval import REFRESH_SECONDS, AutoInterval
from ckpt.core.errors import ControlPlaneError
from ckpt.core.interval import History, bounded, waste_per_hour, young_daly

HOUR = 3600.0


def test_the_estimate_is_the_prior_without_history_and_the_plain_mean_with_much() -> None:
    assert History().mtbf(prior_seconds=4 * HOUR) == 4 * HOUR
    # 10 h alive, 4 preemptions, a 2 h prior: (10 + 2) / (4 + 1) h.
    assert History(10 * HOUR, 4).mtbf(prior_seconds=2 * HOUR) == pytest.approx(2.4 * HOUR)
    # Much history: the prior hardly matters.
    long = History(10_000 * HOUR, 5_000)
    assert long.mtbf(prior_seconds=100 * HOUR) == pytest.approx(2 * HOUR, rel=0.02)
    # Exposure without preemptions lengthens the estimate past the prior.
    assert History(30 * HOUR, 0).mtbf(prior_seconds=4 * HOUR) == 34 * HOUR
    assert History(1, 2) + History(3, 4) == History(4, 6)


def test_the_estimator_recovers_the_mean_of_an_exponential_trace() -> None:
    rng = random.Random(7)
    true_mtbf = 3 * HOUR
    lives = [rng.expovariate(1 / true_mtbf) for _ in range(2000)]
    history = sum((History(life, 1) for life in lives), History())
    assert history.mtbf(prior_seconds=HOUR) == pytest.approx(true_mtbf, rel=0.05)


def test_young_daly_balances_the_cost_of_saves_and_of_redone_work() -> None:
    cost, mtbf = 2.0, 4 * HOUR
    best = young_daly(cost_seconds=cost, mtbf_seconds=mtbf)
    assert best == pytest.approx(math.sqrt(2 * 2.0 * 4 * HOUR))
    at_best = waste_per_hour(interval_seconds=best, cost_seconds=cost, mtbf_seconds=mtbf)
    for other in (best / 4, best / 2, best * 2, best * 4):
        assert (
            waste_per_hour(interval_seconds=other, cost_seconds=cost, mtbf_seconds=mtbf) > at_best
        )
    # At the optimum both halves are equal: 3600 * 2 * cost / T.
    assert at_best == pytest.approx(3600 * 2 * cost / best)
    assert bounded(5, low=10, high=20) == 10 and bounded(25, low=10, high=20) == 20


def test_the_agent_re_evaluates_as_the_cost_and_the_estimate_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    estimates = [4 * HOUR]
    asked = []

    def estimate() -> float:
        asked.append(now[0])
        return estimates[-1]

    auto = AutoInterval(
        run="r",
        low=60,
        high=6 * HOUR,
        mtbf_seconds=None,
        estimate=estimate,
        quiet=False,
        clock=lambda: now[0],
    )
    assert auto.current() == 60  # no save measured yet: save soon, to measure one
    assert auto.waste_seconds_per_hour() is None
    with caplog.at_level(logging.INFO, logger="ckpt"):
        auto.measured(2.0)
    expected = math.sqrt(2 * 2.0 * 4 * HOUR)
    assert auto.current() == pytest.approx(expected)
    assert "saving every 240 s" in caplog.text
    assert auto.waste_seconds_per_hour() == pytest.approx(
        waste_per_hour(interval_seconds=expected, cost_seconds=2.0, mtbf_seconds=4 * HOUR)
    )
    # The estimate is asked again only after REFRESH_SECONDS.
    estimates.append(16 * HOUR)
    now[0] = REFRESH_SECONDS - 1
    assert auto.current() == pytest.approx(expected)
    now[0] = REFRESH_SECONDS
    assert auto.current() == pytest.approx(2 * expected)  # sqrt(4) times longer
    assert asked == [0.0, REFRESH_SECONDS]
    # The cost is a running average of the saves.
    auto.measured(2.0 + 10 / 0.3)  # moves the average by 10 s
    assert auto.cost_seconds == pytest.approx(12.0)

    # Bounds hold; a failed estimate keeps the last one.
    def failing() -> float:
        raise ControlPlaneError("down")

    bounded_auto = AutoInterval(
        run="r", low=60, high=100, mtbf_seconds=None, estimate=failing, quiet=True
    )
    bounded_auto.measured(50.0)
    assert bounded_auto.current() == 100
    # A configured mean is never replaced by an estimate.
    fixed = AutoInterval(run="r", low=1, high=1e9, mtbf_seconds=HOUR, estimate=estimate, quiet=True)
    fixed.measured(8.0)
    assert fixed.current() == pytest.approx(math.sqrt(2 * 8 * HOUR))


def simulate(
    trace: list[float], *, cost: float, interval: float | None, prior: float
) -> tuple[float, int]:
    """Seconds lost over a run that meets the preemptions of ``trace`` (each attempt's time
    until it is taken away), saving every ``interval`` seconds of training, or, with None,
    at the automatic interval, re-estimated at each restart from the attempts so far.

    Lost: each save's cost, and the training since the last save at each preemption.
    """
    lost, saves, history = 0.0, 0, History()
    for life in trace:
        if interval is None:
            mtbf = history.mtbf(prior_seconds=prior)
            every = young_daly(cost_seconds=cost, mtbf_seconds=mtbf)
        else:
            every = interval
        # Within an attempt: train ``every``, stall ``cost``, again, until taken away.
        period = every + cost
        whole = int(life // period)
        saves += whole
        lost += whole * cost + (life - whole * period)  # the unsaved tail is redone
        history += History(life, 1)
    return lost, saves


def test_on_a_preemption_trace_auto_loses_less_than_intervals_4x_shorter_and_longer() -> None:
    rng = random.Random(2026)
    mtbf, cost = 2 * HOUR, 30.0  # a spot pool taken back every 2 h; a save stalls 30 s
    trace = [rng.expovariate(1 / mtbf) for _ in range(3000)]
    # The agent does not know the pool: it starts from a prior 4x too optimistic.
    auto, _ = simulate(trace, cost=cost, interval=None, prior=8 * HOUR)
    best = young_daly(cost_seconds=cost, mtbf_seconds=mtbf)
    shorter, _ = simulate(trace, cost=cost, interval=best / 4, prior=0)
    longer, _ = simulate(trace, cost=cost, interval=best * 4, prior=0)
    total = sum(trace)
    print(
        f"lost per hour: auto {3600 * auto / total:.0f} s, 4x shorter "
        f"{3600 * shorter / total:.0f} s, 4x longer {3600 * longer / total:.0f} s"
    )
    assert auto < shorter
    assert auto < longer
    # And near what the formula promises for the true mean.
    promised = waste_per_hour(interval_seconds=best, cost_seconds=cost, mtbf_seconds=mtbf)
    assert 3600 * auto / total == pytest.approx(promised, rel=0.15)
