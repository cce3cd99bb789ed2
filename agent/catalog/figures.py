"""A rank's save figures on their way to the control plane: each save's ride on the rank's
next layer record (``POST /v1/bundles/{id}/layers/{rank}``), so a save costs no request of
its own for them; those left when the attempt ends or the checkpointer closes are sent on
their own."""

from __future__ import annotations

import logging
import threading

from agent.catalog.client import ControlPlane
from ckpt.core.contract import SaveFigures
from ckpt.core.errors import ControlPlaneError

log = logging.getLogger("ckpt")

# The most saves' figures kept unsent (a long outage): the oldest are dropped beyond.
MAX_PENDING = 16

Figures = tuple[int, SaveFigures]  # a bundle's id, and this rank's figures of its save


class PendingFigures:
    """The figures not yet sent, oldest first; taken by a record, put back when it failed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Figures] = []

    def keep(self, bundle_id: int, figures: SaveFigures) -> None:
        with self._lock:
            self._pending = [*self._pending, (bundle_id, figures)][-MAX_PENDING:]

    def take(self) -> list[Figures]:
        with self._lock:
            taken, self._pending = self._pending, []
        return taken

    def put_back(self, taken: list[Figures]) -> None:
        """Figures a record did not deliver, before any kept since."""
        with self._lock:
            self._pending = [*taken, *self._pending][-MAX_PENDING:]

    def send(self, control: ControlPlane, *, rank: int, patience: float) -> None:
        """Send the figures no record took (at close), unless the control plane does not
        answer: each call waits ``patience`` at most."""
        for bundle_id, figures in self.take():
            if control.unreachable:
                return
            try:
                control.report_save(bundle_id, rank=rank, figures=figures, patience=patience)
            except ControlPlaneError as err:
                log.warning("could not report the figures of bundle %d: %s", bundle_id, err)
