"""The run's tree of bundles: which branch is live, where its head is, what to resume from.

Pure functions over a snapshot of the run's bundles; no I/O.

Every bundle points at its parent: the previous bundle of its attempt, or the bundle the
attempt resumed from. A rollback makes an older bundle the head, so the next attempt's
bundles grow a second child under it: a fork. The live branch is the head and its ancestors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from service.models import BundleStatus


@dataclass(frozen=True)
class Node:
    id: int
    step: int
    status: str
    parent_id: int | None
    attempt_id: int | None


def ancestry(head_id: int | None, nodes: Mapping[int, Node]) -> list[int]:
    """The head, its parent, its parent's parent... (the live branch, newest first)."""
    chain: list[int] = []
    current = head_id
    while current is not None and current in nodes and current not in chain:
        chain.append(current)
        current = nodes[current].parent_id
    return chain


def resumable(head_id: int | None, nodes: Mapping[int, Node]) -> Node | None:
    """The newest complete bundle on the live branch: what the next attempt resumes from."""
    for bundle_id in ancestry(head_id, nodes):
        if nodes[bundle_id].status == BundleStatus.COMPLETE:
            return nodes[bundle_id]
    return None


def head_after_commit(head_id: int | None, committed: Node, nodes: Mapping[int, Node]) -> int:
    """Where the head goes when ``committed`` completes (its attempt is the live one).

    It moves to the committed bundle, unless the head already descends from it (a later
    save of the same attempt committed first).
    """
    if committed.id in ancestry(head_id, nodes):
        assert head_id is not None
        return head_id
    return committed.id


def children(nodes: Iterable[Node]) -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for node in sorted(nodes, key=lambda n: n.id):
        if node.parent_id is not None:
            tree.setdefault(node.parent_id, []).append(node.id)
    return tree


def forks(nodes: Iterable[Node]) -> list[int]:
    """Bundles with more than one child: where a rollback (or a lost save) split the run."""
    return sorted(parent for parent, kids in children(nodes).items() if len(kids) > 1)
