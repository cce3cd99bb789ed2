"""The training loop's walk through the data, epoch by epoch, from the restored position."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from agent.counters import Counters
from agent.data.sources import DataSource, Resumed


class Epochs:
    """Hands out the batches of the current epoch and advances the epoch at its end.

    The first iterator after a resume starts where the bundle left the data; every batch
    handed out counts as consumed. Breaking out and coming back continues the same epoch
    with the same iterator.
    """

    def __init__(self, source: DataSource | None, counters: Counters) -> None:
        self._source, self._counters = source, counters
        self._resumed: Resumed | None = None
        self._batches: Iterator[Any] | None = None  # the live iterator of this epoch

    def restart(self) -> None:
        """The counters were restored: the next iterator starts at their position."""
        self._resumed = Resumed(epoch=self._counters.epoch, batch=self._counters.batch)
        self._batches = None

    def close(self) -> None:
        """Drop the live iterator: a DataLoader's shuts its workers down when it goes (the
        interpreter's exit cannot stop workers that ignore SIGTERM, as ranks.md shields them)."""
        self._batches = None

    def batches(self) -> Iterator[Any]:
        source, counters = self._source, self._counters
        if source is None:
            raise ValueError("batches() needs data=: pass the loader to the Checkpointer")
        if self._batches is None:
            source.begin_epoch(counters.epoch)
            resumed, self._resumed = self._resumed, None
            self._batches = source.batches(resumed=resumed)
        for batch in self._batches:
            counters.batch += 1
            source.consumed()
            yield batch
        self._batches = None
        counters.epoch += 1
        counters.batch = 0
