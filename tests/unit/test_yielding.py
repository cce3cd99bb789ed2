"""The books of ``service.yielding``: a bulk request's pauses, their budget, and the sort
in steps. Real threads and a real event loop; the server-level behaviour is
``tests/service/test_bulk_yields.py``."""

from __future__ import annotations

import asyncio
import random
import string
import threading

import pytest

from service.metrics import Metrics
from service.yielding import PriorityGate, sorted_in_steps, step_aside, turn

GUARD = 60.0  # only ends a test that would otherwise hang


def waited(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value("ckpt_bulk_yield_seconds_total")
    assert value is not None
    return value


def test_a_pause_lasts_until_the_last_priority_request_is_out() -> None:
    gate, metrics = PriorityGate(), Metrics()
    first, second = gate.serving(), gate.serving()
    first.__enter__()
    second.__enter__()
    paused, resumed = threading.Event(), threading.Event()

    def bulk() -> None:
        with turn(gate, metrics, GUARD):
            paused.set()
            step_aside()
            resumed.set()

    thread = threading.Thread(target=bulk)
    thread.start()
    assert paused.wait(GUARD)
    first.__exit__(None, None, None)
    assert not resumed.wait(0.05)  # one is still in flight
    second.__exit__(None, None, None)
    assert resumed.wait(GUARD)
    thread.join()
    assert waited(metrics) > 0


def test_the_budget_bounds_every_pause_together() -> None:
    gate, metrics = PriorityGate(), Metrics()
    with gate.serving(), turn(gate, metrics, 0.05):
        for _ in range(5):
            step_aside()  # the first spends the budget; the rest return at once
    spent = waited(metrics)
    assert 0.05 <= spent < 0.05 + 1.0


def test_no_pause_outside_a_bulk_request_nor_without_a_budget() -> None:
    gate, metrics = PriorityGate(), Metrics()
    with gate.serving():
        step_aside()  # no turn: not a bulk request
        with turn(gate, metrics, 0):
            step_aside()
    assert waited(metrics) == 0


def test_no_pause_on_the_event_loop() -> None:
    gate, metrics = PriorityGate(), Metrics()

    async def on_the_loop() -> None:
        with turn(gate, metrics, GUARD):
            step_aside()  # would stop every request: it returns at once

    with gate.serving():
        asyncio.run(asyncio.wait_for(on_the_loop(), GUARD))
    assert waited(metrics) == 0


@pytest.mark.parametrize("alphabet", [string.hexdigits.lower()[:16], "ab\u00e9\U0001f600"])
def test_the_sort_in_steps_is_sorted(alphabet: str) -> None:
    rng = random.Random(7)
    words = ["".join(rng.choices(alphabet, k=rng.randint(0, 5))) for _ in range(5000)]
    assert sorted_in_steps(words) == sorted(words)
    assert sorted_in_steps([]) == []
