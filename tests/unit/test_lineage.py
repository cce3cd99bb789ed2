"""The run's tree of bundles: ``service.lineage``."""

from __future__ import annotations

import random

import pytest

from service.lineage import Node, ancestry, children, forks, head_after_commit, resumable
from service.models import BundleStatus

COMPLETE = BundleStatus.COMPLETE
PENDING = BundleStatus.PENDING
FAILED = BundleStatus.FAILED
QUARANTINED = BundleStatus.QUARANTINED
DELETED = BundleStatus.DELETED


def tree(*nodes: Node) -> dict[int, Node]:
    return {node.id: node for node in nodes}


def rolled_back() -> dict[int, Node]:
    """Attempt 1 saves 1 <- 2 <- 3; a rollback to 2; attempt 2 resumes there: 2 <- 4 <- 5.

    1 ── 2 ─┬─ 3            (attempt 1, abandoned by the rollback)
            └─ 4 ── 5       (attempt 2, the live branch; 5 is pending)
    """
    return tree(
        Node(id=1, step=10, status=COMPLETE, parent_id=None, attempt_id=1),
        Node(id=2, step=20, status=COMPLETE, parent_id=1, attempt_id=1),
        Node(id=3, step=30, status=COMPLETE, parent_id=2, attempt_id=1),
        Node(id=4, step=30, status=COMPLETE, parent_id=2, attempt_id=2),
        Node(id=5, step=40, status=PENDING, parent_id=4, attempt_id=2),
    )


def with_status(nodes: dict[int, Node], statuses: dict[int, str]) -> dict[int, Node]:
    out = dict(nodes)
    for bundle_id, status in statuses.items():
        node = out[bundle_id]
        out[bundle_id] = Node(node.id, node.step, status, node.parent_id, node.attempt_id)
    return out


# ancestry


def test_ancestry_is_the_live_branch_newest_first() -> None:
    nodes = rolled_back()
    assert ancestry(5, nodes) == [5, 4, 2, 1]
    assert ancestry(3, nodes) == [3, 2, 1]
    assert ancestry(1, nodes) == [1]


def test_ancestry_of_no_head_is_empty() -> None:
    assert ancestry(None, rolled_back()) == []
    assert ancestry(None, {}) == []


def test_ancestry_of_an_unknown_head_is_empty() -> None:
    assert ancestry(99, rolled_back()) == []


def test_ancestry_stops_where_a_parent_is_gone() -> None:
    nodes = rolled_back()
    del nodes[2]  # e.g. not in the snapshot
    assert ancestry(5, nodes) == [5, 4]


@pytest.mark.timeout(10)
def test_ancestry_stops_at_a_cycle() -> None:
    nodes = tree(
        Node(id=1, step=10, status=PENDING, parent_id=3, attempt_id=1),
        Node(id=2, step=20, status=PENDING, parent_id=1, attempt_id=1),
        Node(id=3, step=30, status=PENDING, parent_id=2, attempt_id=1),
    )
    assert ancestry(3, nodes) == [3, 2, 1]
    assert ancestry(1, nodes) == [1, 3, 2]
    assert resumable(3, nodes) is None  # terminates, and finds nothing complete


@pytest.mark.timeout(10)
def test_ancestry_stops_at_a_self_loop() -> None:
    nodes = tree(Node(id=7, step=1, status=COMPLETE, parent_id=7, attempt_id=None))
    assert ancestry(7, nodes) == [7]
    assert resumable(7, nodes) == nodes[7]


@pytest.mark.timeout(10)
def test_a_cycle_below_the_head_keeps_every_bundle_once() -> None:
    nodes = tree(
        Node(id=1, step=10, status=COMPLETE, parent_id=2, attempt_id=1),
        Node(id=2, step=20, status=FAILED, parent_id=1, attempt_id=1),
        Node(id=3, step=30, status=PENDING, parent_id=2, attempt_id=1),
    )
    assert ancestry(3, nodes) == [3, 2, 1]
    assert resumable(3, nodes) == nodes[1]


# resumable


def test_resumable_is_the_newest_complete_bundle_on_the_live_branch() -> None:
    nodes = rolled_back()
    assert resumable(5, nodes) == nodes[4]  # 5 is pending
    assert resumable(4, nodes) == nodes[4]
    assert resumable(3, nodes) == nodes[3]


@pytest.mark.parametrize("status", [PENDING, FAILED, QUARANTINED, DELETED])
def test_resumable_skips_bundles_that_are_not_complete(status: str) -> None:
    nodes = with_status(rolled_back(), {4: status})
    # Never the complete bundle 3 on the abandoned branch, though its step is higher.
    assert resumable(5, nodes) == nodes[2]


def test_resumable_walks_down_to_the_root() -> None:
    nodes = with_status(rolled_back(), {4: FAILED, 2: QUARANTINED})
    assert resumable(5, nodes) == nodes[1]


def test_resumable_is_none_without_a_complete_bundle_on_the_live_branch() -> None:
    nodes = with_status(rolled_back(), {4: FAILED, 2: QUARANTINED, 1: DELETED})
    assert resumable(5, nodes) is None
    assert nodes[3].status == COMPLETE  # a complete bundle off the live branch does not count


def test_resumable_of_no_head_is_none() -> None:
    assert resumable(None, rolled_back()) is None
    assert resumable(None, {}) is None


def test_resumable_accepts_a_plain_string_status() -> None:
    # Rows carry the column's string, not the enum.
    nodes = tree(Node(id=1, step=1, status="complete", parent_id=None, attempt_id=1))
    assert resumable(1, nodes) == nodes[1]


# head_after_commit


def test_the_head_moves_to_the_committed_bundle() -> None:
    nodes = rolled_back()
    # Attempt 2 resumed from 2 (the head after the rollback) and commits 4.
    assert head_after_commit(2, nodes[4], nodes) == 4
    # And then 5, whose parent 4 is the head.
    assert head_after_commit(4, nodes[5], nodes) == 5


def test_the_head_stays_when_it_already_descends_from_the_committed_bundle() -> None:
    nodes = rolled_back()
    # A later save (5) committed before an earlier one (4) of the same attempt.
    assert head_after_commit(5, nodes[4], nodes) == 5
    assert head_after_commit(5, nodes[2], nodes) == 5
    assert head_after_commit(5, nodes[5], nodes) == 5  # committing the head itself


def test_the_head_leaves_another_branch_for_the_committed_bundle() -> None:
    nodes = rolled_back()
    # The head is on the abandoned branch; 4 does not descend from it, nor it from 4.
    assert head_after_commit(3, nodes[4], nodes) == 4
    assert head_after_commit(3, nodes[5], nodes) == 5


def test_the_first_commit_of_a_run_becomes_the_head() -> None:
    nodes = rolled_back()
    assert head_after_commit(None, nodes[1], nodes) == 1


def test_the_head_moves_when_it_is_an_ancestor_of_the_committed_bundle() -> None:
    nodes = rolled_back()
    assert head_after_commit(1, nodes[3], nodes) == 3


# children and forks


def test_children_maps_each_parent_to_its_children_by_id() -> None:
    nodes = list(rolled_back().values())
    random.Random(7).shuffle(nodes)
    assert children(nodes) == {1: [2], 2: [3, 4], 4: [5]}


def test_children_of_nothing_is_empty() -> None:
    assert children([]) == {}
    assert children([Node(id=1, step=0, status=COMPLETE, parent_id=None, attempt_id=1)]) == {}


def test_a_rollback_makes_a_fork() -> None:
    assert forks(rolled_back().values()) == [2]


def test_a_straight_line_has_no_forks() -> None:
    nodes = [
        Node(id=i, step=10 * i, status=COMPLETE, parent_id=i - 1 if i > 1 else None, attempt_id=1)
        for i in range(1, 6)
    ]
    assert forks(nodes) == []


def test_forks_are_sorted_and_include_lost_saves() -> None:
    nodes = [
        *rolled_back().values(),
        # A second rollback, to 4: attempt 3 resumes there.
        Node(id=6, step=40, status=COMPLETE, parent_id=4, attempt_id=3),
        # A lost save: attempt 1 saved twice under 1 (the first never became the parent).
        Node(id=7, step=15, status=FAILED, parent_id=1, attempt_id=1),
    ]
    random.Random(3).shuffle(nodes)
    assert children(nodes) == {1: [2, 7], 2: [3, 4], 4: [5, 6]}
    assert forks(nodes) == [1, 2, 4]
