"""Which complete bundles retention deletes: one pure function, no I/O."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import NamedTuple


class Kept(NamedTuple):
    """A complete bundle, as retention sees it (a tuple: garbage collection makes one for
    every complete bundle of every crowded run, a million at a time)."""

    id: int
    step: int
    committed_at: datetime
    pinned: bool
    micro_step: int = 0  # a save mid-accumulation; retention counts it as its step's


def to_delete(
    bundles: Sequence[Kept],
    *,
    keep_last: int | None,
    keep_every: int | None,
    protected: Collection[int] = (),
) -> list[int]:
    """The ids of complete bundles the policy does not keep, oldest first.

    Kept: the ``keep_last`` most recently committed, those whose step is a multiple of
    ``keep_every``, pinned ones, ``protected`` ones (the head and what the run resumes
    from) and, always, the newest. With neither number set, everything is kept.
    """
    if keep_last is None and keep_every is None:
        return []
    newest_first = sorted(bundles, key=lambda b: (b.committed_at, b.step, b.id), reverse=True)
    keep = {b.id for b in newest_first[: max(keep_last or 0, 1)]}
    keep |= {b.id for b in bundles if b.pinned or b.id in protected}
    if keep_every is not None:
        keep |= {b.id for b in bundles if b.step % keep_every == 0}
    return [b.id for b in reversed(newest_first) if b.id not in keep]
