"""Which complete bundles retention deletes: ``service.retention.to_delete``."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.retention import Kept, to_delete

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def kept(bundle_id: int, step: int, *, minute: int | None = None, pinned: bool = False) -> Kept:
    """A bundle committed ``minute`` minutes after T0 (default: its id)."""
    at = T0 + timedelta(minutes=bundle_id if minute is None else minute)
    return Kept(id=bundle_id, step=step, committed_at=at, pinned=pinned)


def series(*steps: int) -> list[Kept]:
    """Bundles 1, 2, ... at ``steps``, committed in that order."""
    return [kept(i, step) for i, step in enumerate(steps, start=1)]


def test_no_policy_keeps_everything() -> None:
    bundles = series(1, 2, 3, 4, 5, 6, 7)
    assert to_delete(bundles, keep_last=None, keep_every=None) == []
    assert to_delete(bundles, keep_last=None, keep_every=None, protected=[1]) == []


def test_nothing_to_consider_deletes_nothing() -> None:
    assert to_delete([], keep_last=1, keep_every=None) == []
    assert to_delete([], keep_last=None, keep_every=10) == []


@pytest.mark.parametrize(
    ("keep_last", "deleted"),
    [(1, [1, 2, 3, 4]), (2, [1, 2, 3]), (4, [1]), (5, []), (50, [])],
)
def test_keep_last_keeps_the_most_recently_committed(keep_last: int, deleted: list[int]) -> None:
    bundles = series(10, 20, 30, 40, 50)
    assert to_delete(bundles, keep_last=keep_last, keep_every=None) == deleted


def test_keep_every_keeps_multiples_of_its_step() -> None:
    bundles = series(5, 10, 15, 20, 25, 30, 35)
    # 10, 20 and 30 are multiples of 10; 35 is the newest.
    assert to_delete(bundles, keep_last=None, keep_every=10) == [1, 3, 5]


def test_keep_every_keeps_step_zero() -> None:
    bundles = series(0, 7, 9)
    assert to_delete(bundles, keep_last=None, keep_every=4) == [2]


def test_keep_last_and_keep_every_together_keep_the_union() -> None:
    bundles = series(100, 150, 200, 250, 300, 350, 375)
    # Last two: 350, 375. Every 100: 100, 200, 300.
    assert to_delete(bundles, keep_last=2, keep_every=100) == [2, 4]


@pytest.mark.parametrize("keep_last", [0, 1])
def test_the_newest_is_always_kept(keep_last: int) -> None:
    bundles = series(1, 3, 5, 7)
    # No step is a multiple of 2, and keep_last keeps at most one: that one is the newest.
    assert to_delete(bundles, keep_last=keep_last, keep_every=2) == [1, 2, 3]


def test_the_newest_is_kept_with_only_keep_every() -> None:
    bundles = series(1, 3, 5, 7)
    assert to_delete(bundles, keep_last=None, keep_every=2) == [1, 2, 3]
    assert to_delete(series(7), keep_last=None, keep_every=2) == []


def test_newest_means_last_committed_not_highest_step_or_id() -> None:
    # After a rollback the newest commit can have a lower step and a lower id.
    bundles = [
        kept(1, 10, minute=1),
        kept(2, 20, minute=2),
        kept(3, 30, minute=3),
        kept(4, 15, minute=9),
        kept(9, 40, minute=0),
    ]
    assert to_delete(bundles, keep_last=1, keep_every=None) == [9, 1, 2, 3]
    assert to_delete(bundles, keep_last=2, keep_every=None) == [9, 1, 2]


def test_pinned_bundles_are_kept() -> None:
    bundles = series(1, 2, 3, 4, 5)
    bundles[1] = kept(2, 2, pinned=True)
    bundles[3] = kept(4, 4, pinned=True)
    assert to_delete(bundles, keep_last=1, keep_every=None) == [1, 3]


def test_protected_bundles_are_kept() -> None:
    bundles = series(1, 2, 3, 4, 5)
    assert to_delete(bundles, keep_last=1, keep_every=None, protected={1, 3}) == [2, 4]
    assert to_delete(bundles, keep_last=1, keep_every=None, protected=[2]) == [1, 3, 4]


def test_unknown_protected_ids_change_nothing() -> None:
    bundles = series(1, 2, 3)
    assert to_delete(bundles, keep_last=1, keep_every=None, protected={77}) == [1, 2]


def test_the_result_is_oldest_first_whatever_the_input_order() -> None:
    bundles = [
        kept(5, 50, minute=3),
        kept(1, 10, minute=7),
        kept(3, 30, minute=1),
        kept(2, 20, minute=5),
        kept(4, 40, minute=9),
    ]
    random.Random(11).shuffle(bundles)
    assert to_delete(bundles, keep_last=1, keep_every=None) == [3, 5, 2, 1]


def test_equal_commit_times_order_by_step_then_id() -> None:
    bundles = [
        kept(1, 30, minute=5),
        kept(2, 10, minute=5),
        kept(3, 20, minute=5),
        kept(4, 20, minute=5),
        kept(5, 99, minute=1),
    ]
    # Newest: the highest (committed_at, step, id), which is bundle 1.
    assert to_delete(bundles, keep_last=1, keep_every=None) == [5, 2, 3, 4]
    assert to_delete(bundles, keep_last=2, keep_every=None) == [5, 2, 3]


@st.composite
def bundle_sets(draw: st.DrawFn) -> list[Kept]:
    ids = draw(st.lists(st.integers(1, 500), unique=True, min_size=0, max_size=25))
    return [
        Kept(
            id=bundle_id,
            step=draw(st.integers(0, 1000)),
            committed_at=T0 + timedelta(seconds=draw(st.integers(0, 100))),
            pinned=draw(st.booleans()),
        )
        for bundle_id in ids
    ]


@settings(database=None, deadline=None, max_examples=500)
@given(
    bundles=bundle_sets(),
    keep_last=st.none() | st.integers(0, 30),
    keep_every=st.none() | st.integers(1, 50),
    protected_picks=st.lists(st.integers(0, 24), max_size=5),
)
def test_retention_never_deletes_what_it_must_keep(
    bundles: list[Kept],
    keep_last: int | None,
    keep_every: int | None,
    protected_picks: list[int],
) -> None:
    protected = {bundles[i].id for i in protected_picks if i < len(bundles)}
    deleted = to_delete(bundles, keep_last=keep_last, keep_every=keep_every, protected=protected)
    ids = {b.id for b in bundles}
    by_id = {b.id: b for b in bundles}
    newest_first = sorted(bundles, key=lambda b: (b.committed_at, b.step, b.id), reverse=True)

    assert len(deleted) == len(set(deleted))
    assert set(deleted) <= ids
    kept_ids = ids - set(deleted)
    assert set(deleted) | kept_ids == ids
    if keep_last is None and keep_every is None:
        assert deleted == []
        return
    if bundles:
        assert newest_first[0].id in kept_ids
    assert not {b.id for b in bundles if b.pinned} & set(deleted)
    assert not protected & set(deleted)
    if keep_last:
        assert {b.id for b in newest_first[:keep_last]} <= kept_ids
    if keep_every is not None:
        assert not {b.id for b in bundles if b.step % keep_every == 0} & set(deleted)
    # Nothing else is kept: every bundle outside the policy is deleted.
    for bundle_id in kept_ids:
        bundle = by_id[bundle_id]
        assert (
            bundle.pinned
            or bundle_id in protected
            or bundle_id == newest_first[0].id
            or bundle_id in {b.id for b in newest_first[: keep_last or 0]}
            or (keep_every is not None and bundle.step % keep_every == 0)
        )
    # Oldest first.
    order = [b.id for b in reversed(newest_first)]
    assert deleted == [bundle_id for bundle_id in order if bundle_id in set(deleted)]
