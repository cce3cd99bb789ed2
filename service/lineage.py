"""The run's tree of bundles: which branch is live, where its head is, what to resume from.

Pure functions over a snapshot of the run's bundles; no I/O.

Every bundle points at its parent: the previous bundle of its attempt, or the bundle the
attempt resumed from. A rollback makes an older bundle the head, so the next attempt's
bundles grow a second child under it: a fork. The live branch is the head and its ancestors.

Attempts follow one another by epoch. When one ends other than finished, its successor
repeats the steps between the bundle it resumes from and the last step the ended attempt
reported: the steps that ending lost. Exact when the attempt reported its end (the end
carries the step it stopped at); a lower bound when it was marked lost (killed, it said
nothing after its last heartbeat, and may have trained past the step that carried).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from service.models import BundleStatus, EndReason


@dataclass(frozen=True)
class Node:
    id: int
    step: int
    status: str
    parent_id: int | None
    attempt_id: int | None


@dataclass(frozen=True)
class AttemptNode:
    id: int
    epoch: int
    last_step: int | None  # the last step it reported (heartbeat or end)
    end_reason: str | None  # None while it runs
    resumed_step: int | None  # the step of the bundle it resumed from; None: a fresh start


# A snapshot of the run's bundles, or a function that looks one up (the catalog does, so
# that walking from the head reads only the few bundles it passes).
Nodes = Mapping[int, Node] | Callable[[int], Node | None]


def _walk(head_id: int | None, nodes: Nodes) -> Iterable[Node]:
    """The head, its parent, its parent's parent... (stops at a cycle or a missing parent)."""
    lookup = nodes.get if isinstance(nodes, Mapping) else nodes
    seen: set[int] = set()
    current = head_id
    while current is not None and current not in seen:
        found = lookup(current)
        if found is None:
            return
        seen.add(current)
        yield found
        current = found.parent_id


def ancestry(head_id: int | None, nodes: Nodes) -> list[int]:
    """The head, its parent, its parent's parent... (the live branch, newest first)."""
    return [node.id for node in _walk(head_id, nodes)]


def resumable(head_id: int | None, nodes: Nodes) -> Node | None:
    """The newest complete bundle on the live branch: what the next attempt resumes from."""
    return next((n for n in _walk(head_id, nodes) if n.status == BundleStatus.COMPLETE), None)


def head_after_commit(head_id: int | None, committed: Node, nodes: Nodes) -> int:
    """Where the head goes when ``committed`` completes (its attempt is the live one).

    It moves to the committed bundle, unless the head already descends from it (a later
    save of the same attempt committed first). Steps never grow towards the root, so the
    walk stops below the committed bundle's step.
    """
    for node in _walk(head_id, nodes):
        if node.id == committed.id:
            assert head_id is not None
            return head_id
        if node.step < committed.step:
            break
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


def steps_lost(attempt: AttemptNode, successor: AttemptNode | None) -> int | None:
    """The steps of ``attempt`` that ``successor`` (the run's next attempt) trains again: its
    last reported step minus the step the successor resumed from (0 for a fresh start).

    None while unknown: the attempt has not ended or reported a step, or no successor has
    registered yet; and for a finished attempt, which loses nothing.
    """
    if attempt.end_reason in (None, EndReason.FINISHED) or attempt.last_step is None:
        return None
    if successor is None:
        return None
    assert successor.epoch > attempt.epoch, "a successor comes after the attempt"
    return max(0, attempt.last_step - (successor.resumed_step or 0))


def steps_lost_exact(end_reason: str | None) -> bool:
    """Whether an ended attempt's ``steps_lost`` is exact: its own end report carried the
    step it stopped at. Marked lost, its last step came with a heartbeat (or a notice), and
    it may have trained past it: its steps lost are then at least that many."""
    return end_reason != EndReason.LOST


def attempt_state(end_reason: str | None, *, fenced: bool) -> str:
    """How an attempt stands: how it ended, else "replaced" once it is fenced (a newer
    attempt registered, or a rollback made way for one: it can save no more), else
    "running". The sweep later marks a replaced attempt that never reported its end lost."""
    return end_reason or ("replaced" if fenced else "running")


def steps_lost_by_attempt(attempts: Iterable[AttemptNode]) -> dict[int, int | None]:
    """``steps_lost`` of each of a run's attempts, by attempt id."""
    ordered = sorted(attempts, key=lambda a: a.epoch)
    return {
        attempt.id: steps_lost(attempt, ordered[i + 1] if i + 1 < len(ordered) else None)
        for i, attempt in enumerate(ordered)
    }
