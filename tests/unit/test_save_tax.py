"""The save tax (``agent.save.tax.StepClock``): the extra time of the steps a save overlaps,
over the median step before it, on a clock the test sets."""

from __future__ import annotations

import pytest

from agent.save.tax import MIN_STEPS, StepClock


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stepping(intervals: list[float]) -> tuple[StepClock, Clock]:
    """A clock that ticked once, then once after each interval."""
    clock = Clock()
    steps = StepClock(clock=clock)
    steps.tick()
    for interval in intervals:
        clock.now += interval
        steps.tick()
    return steps, clock


def test_the_tax_is_the_overlapped_steps_over_the_median_step() -> None:
    steps, clock = stepping([1.0, 1.0, 3.0, 1.0])  # median 1.0
    window = steps.started()
    for interval in (1.5, 1.25):  # slowed by the save's background work
        clock.now += interval
        steps.tick()
    assert steps.ended(window) == pytest.approx(0.75)


def test_the_step_still_running_counts_what_it_ran_over_a_median_step() -> None:
    steps, clock = stepping([2.0] * 4)
    window = steps.started()
    clock.now += 2.5
    steps.tick()
    clock.now += 3.0  # durable mid-step: 1 s over the median so far
    assert steps.ended(window) == pytest.approx(0.5 + 1.0)


def test_a_loop_that_waits_for_the_save_pays_all_of_it() -> None:
    steps, clock = stepping([1.0] * 4)
    window = steps.started()
    clock.now += 5.0  # no step: the loop called wait()
    assert steps.ended(window) == pytest.approx(4.0)


def test_steps_a_save_overlapped_are_not_taken_for_plain_ones() -> None:
    steps, clock = stepping([1.0] * 4)
    first = steps.started()
    for _ in range(MIN_STEPS + 1):
        clock.now += 10.0
        steps.tick()
    assert steps.ended(first) == pytest.approx(9.0 * (MIN_STEPS + 1))
    clock.now += 10.0  # the step durable came in, still overlapped
    steps.tick()
    second = steps.started()
    assert second is not None and second.median == 1.0


def test_no_tax_before_enough_plain_steps() -> None:
    steps, clock = stepping([1.0] * (MIN_STEPS - 1))
    window = steps.started()
    assert window is None
    clock.now += 4.0
    assert steps.ended(window) is None


def test_a_faster_step_while_saving_costs_nothing() -> None:
    steps, clock = stepping([1.0] * 4)
    window = steps.started()
    clock.now += 0.5
    steps.tick()
    assert steps.ended(window) == 0.0
