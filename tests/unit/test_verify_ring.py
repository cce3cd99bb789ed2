"""This attempt's fingerprints since its newest bundle (agent.verify.ring): the loop appends,
a reader folds; the newest ``CAPACITY`` positions are kept, those a durable bundle covers go."""

from __future__ import annotations

import threading

import torch

from agent.verify.ring import CAPACITY, LOG_LENGTH, Ring


def places(ring: Ring) -> list[tuple[int, int]]:
    return [each.place for each in ring.snapshot()]


def test_a_position_recorded_twice_keeps_its_loss_and_its_sample() -> None:
    ring = Ring()
    before = ring.version
    ring.record((3, 0), sample=None, loss=torch.tensor(2.5, requires_grad=True) * 1)
    ring.record((3, 0), sample=torch.arange(4.0), loss=None)
    ring.record((3, 1), sample=None, loss=1.5)
    (first, second) = ring.snapshot()
    assert (first.place, first.loss, sorted(first.parts)) == (
        (3, 0),
        2.5,
        ["params", "params_norm"],
    )
    assert (second.place, second.loss, second.parts) == ((3, 1), 1.5, {})
    assert ring.version != before


def test_a_loss_that_is_not_finite_is_kept_as_a_part() -> None:
    ring = Ring()
    ring.record((1, 0), sample=None, loss=float("inf"))
    (kept,) = ring.snapshot()
    assert kept.loss is None and kept.parts == {"loss": "inf"}


def test_positions_a_durable_bundle_covers_go_at_the_next_read() -> None:
    ring = Ring()
    for step in range(6):
        ring.record((step, 0), sample=None, loss=float(step))
    ring.drop_through((3, 0))
    ring.record((6, 0), sample=None, loss=6.0)
    assert places(ring) == [(4, 0), (5, 0), (6, 0)]
    assert [each.place for each in ring.snapshot(after=(5, 0))] == [(6, 0)]
    ring.clear()
    assert places(ring) == []


def test_the_newest_capacity_positions_are_kept_however_long_nobody_reads() -> None:
    ring = Ring()
    total = LOG_LENGTH + 100  # more than the log holds between two reads
    for step in range(total):
        ring.record((step, 0), sample=None, loss=1.0)
    kept = places(ring)
    assert len(kept) == CAPACITY and kept[-1] == (total - 1, 0) and kept[0] == (total - CAPACITY, 0)
    for step in range(total, total + 10):
        ring.record((step, 0), sample=None, loss=1.0)
    assert places(ring)[-1] == (total + 9, 0) and len(places(ring)) == CAPACITY


def test_a_reader_folding_while_the_loop_records_loses_nothing() -> None:
    ring, count = Ring(), CAPACITY - 1
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            ring.snapshot()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for step in range(count):
            ring.record((step, 0), sample=None, loss=float(step))
            ring.record((step, 0), sample=torch.tensor([float(step)]), loss=None)
    finally:
        done.set()
        reader.join()
    kept = ring.snapshot()
    assert [each.place for each in kept] == [(step, 0) for step in range(count)]
    assert all(each.loss == each.step and "params" in each.parts for each in kept)
