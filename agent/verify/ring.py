"""This attempt's fingerprints of its steps since its newest bundle, the last ``CAPACITY``.

The loop thread records; the threads that keep them (the store's writer, the heartbeats)
read. Recording runs once or twice per micro-batch, and on a millisecond step each
microsecond there is 0.1% (bench/fingerprint.py): so the loop only appends to a bounded log
(no lock, no bookkeeping) and notes how far a durable bundle lets the ring forget; whoever
reads folds the log into the kept positions first. A sample is digested (its bytes read
back from the device and hashed) only when someone reads it, off the loop where it can be.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from agent.verify.compare import Fingerprint, Place
from agent.verify.digest import digest

CAPACITY = 2048  # the control plane keeps as many per attempt and rank (CKPT_FINGERPRINT_RING)
# A position is recorded at most twice (its loss, then its sample at ``maybe_save``): what
# a full log forgets unread is older than the newest ``CAPACITY`` positions it holds.
LOG_LENGTH = 2 * CAPACITY

Loss = torch.Tensor | float | None
_Recorded = tuple[Place, torch.Tensor | None, Loss]


@dataclass(slots=True)
class _Entry:
    sample: torch.Tensor | None = None
    loss: Loss = None
    made: Fingerprint | None = None  # the digested fingerprint, once read


class Ring:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # over the kept positions (readers fold concurrently)
        self._log: deque[_Recorded] = deque(maxlen=LOG_LENGTH)  # the loop's, until a fold
        self._forget: Place | None = None  # positions up to here go at the next fold
        # Oldest first, a FIFO: a dict's first key after many deletions at its front takes a
        # scan over their slots to find (a microsecond a record, measured at capacity).
        self._entries: OrderedDict[Place, _Entry] = OrderedDict()
        self._version = 0

    @property
    def version(self) -> int:
        """Changes with every record and drop."""
        self._fold()
        return self._version

    def record(self, place: Place, *, sample: torch.Tensor | None, loss: Loss) -> None:
        """Keep what was computed at ``place`` (merged with what is kept there already)."""
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss = loss.detach()  # not its graph; read back when digested
        self._log.append((place, sample, loss))  # atomic: no lock

    def drop_through(self, place: Place) -> None:
        """Forget the positions up to ``place`` (a bundle there is durable: no attempt
        resumes to before it), at the next fold: positions come in order, so none recorded
        since is among them."""
        self._forget = place  # atomic; a durable bundle only moves forward

    def clear(self) -> None:
        with self._lock:
            self._log.clear()
            self._entries.clear()
            self._forget = None
            self._version += 1

    def snapshot(self, *, after: Place | None = None) -> list[Fingerprint]:
        """The fingerprints kept (after ``after``), by position."""
        self._fold()
        with self._lock:
            entries = [
                (place, entry, entry.sample, entry.loss, entry.made)
                for place, entry in sorted(self._entries.items())
                if after is None or place > after
            ]
        prints = []
        for place, entry, sample, loss, kept in entries:
            made = kept or _made(place, sample, loss)
            if kept is None:
                with self._lock:  # kept unless a record changed the entry meanwhile
                    if entry.sample is sample and entry.loss is loss:
                        entry.made = made
            prints.append(made)
        return prints

    def _fold(self) -> None:
        """Move the log into the kept positions, in the order recorded, and forget those a
        durable bundle covers."""
        with self._lock:
            while self._log:
                place, sample, loss = self._log.popleft()  # atomic against an append
                entry = self._entries.get(place)
                if entry is None:
                    self._entries[place] = _Entry(sample, loss)
                    if len(self._entries) > CAPACITY:  # positions come in order: the oldest
                        self._entries.popitem(last=False)
                else:
                    entry.sample = entry.sample if sample is None else sample
                    entry.loss = entry.loss if loss is None else loss
                    entry.made = None
                self._version += 1
            forget = self._forget
            while forget is not None and self._entries and next(iter(self._entries)) <= forget:
                self._entries.popitem(last=False)
                self._version += 1


def _made(place: Place, sample: torch.Tensor | None, loss: Loss) -> Fingerprint:
    parts = {} if sample is None else digest(sample)
    value = None if loss is None else float(loss)
    if value is not None and not math.isfinite(value):
        parts["loss"], value = repr(value), None
    return Fingerprint(*place, loss=value, parts=parts)
