"""This attempt's fingerprints of its steps since its newest bundle, the last ``CAPACITY``.

The loop thread records; the threads that keep them (the store's writer, the heartbeats)
read. A sample is digested (its bytes read back from the device and hashed) only when
someone reads it, off the loop where it can be.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from agent.verify.compare import Fingerprint, Place
from agent.verify.digest import digest

CAPACITY = 2048  # the control plane keeps as many per attempt and rank (CKPT_FINGERPRINT_RING)


@dataclass
class _Entry:
    sample: torch.Tensor | None = None
    loss: torch.Tensor | float | None = None
    made: Fingerprint | None = None  # the digested fingerprint, once read


class Ring:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Place, _Entry] = {}
        self.version = 0  # changes with every record and drop

    def record(
        self, place: Place, *, sample: torch.Tensor | None, loss: torch.Tensor | float | None
    ) -> None:
        """Keep what was computed at ``place`` (merged with what is kept there already)."""
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()  # read back when digested
        with self._lock:
            entry = self._entries.get(place)
            if entry is None:
                entry = self._entries[place] = _Entry()
            entry.sample = entry.sample if sample is None else sample
            entry.loss = entry.loss if loss is None else loss
            entry.made = None
            while len(self._entries) > CAPACITY:  # positions come in order: the oldest
                del self._entries[next(iter(self._entries))]
            self.version += 1

    def drop_through(self, place: Place) -> None:
        """Forget the positions up to ``place`` (a bundle there is durable: no attempt
        resumes to before it)."""
        with self._lock:
            old = [kept for kept in self._entries if kept <= place]
            for kept in old:
                del self._entries[kept]
            self.version += bool(old)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.version += 1

    def snapshot(self, *, after: Place | None = None) -> list[Fingerprint]:
        """The fingerprints kept (after ``after``), by position."""
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


def _made(
    place: Place, sample: torch.Tensor | None, loss: torch.Tensor | float | None
) -> Fingerprint:
    parts = {} if sample is None else digest(sample)
    value = None if loss is None else float(loss)
    if value is not None and not math.isfinite(value):
        parts["loss"], value = repr(value), None
    return Fingerprint(*place, loss=value, parts=parts)
