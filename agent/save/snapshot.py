"""A staged save: the tensors its persist reads, the copies left for later, and the wait
they impose on the next optimizer step (``staging`` makes one per save).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from ckpt.core.errors import StateChangedError


class Staged:
    """A staged snapshot: the tensors a persist reads, by name.

    Most are host buffers holding a copy; ``held`` names live tensors read in place (over
    the budget). Copies left for later (``overlap``) are made by ``finish``; the persist calls
    it first and ``release`` once it has written every held tensor (or failed), and the next
    optimizer step waits for both (``wait_for_step``).
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        unchanged: frozenset[str],
        copied_bytes: int,
        deferred: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None,
        events: list[torch.cuda.Event] | None = None,
        held: frozenset[str] = frozenset(),
    ) -> None:
        self.tensors = tensors
        self.unchanged = unchanged
        self.held = held
        self.copied_bytes = copied_bytes  # at once and deferred
        self._deferred = deferred or []
        self._events = events or []  # the side streams' copies (GPU): done when these are
        watched = [(name, source) for name, source, _ in self._deferred]
        watched += [(name, tensors[name]) for name in held]
        self._versions = {name: (t, _version(t)) for name, t in watched}
        self._lock = threading.Lock()
        self._taken = 0  # deferred copies started, by the persist thread or a waiting step
        self._left = len(self._deferred)  # deferred copies not done yet
        self._copied = threading.Event()
        self._released = threading.Event()
        self._error: BaseException | None = None
        if not self._deferred:
            self._copied.set()
        if not held:
            self._released.set()
        self._ready_at: float | None = None if self.waits else time.perf_counter()
        self._blocked_since: float | None = None
        self.failed = False

    @property
    def waits(self) -> bool:
        """Whether the next optimizer step may have to wait for this save."""
        return bool(self._deferred or self.held)

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def finish(self) -> None:
        """Make the deferred copies. The persist thread and a waiting optimizer step share
        them, tensor by tensor; each returns once all are made.

        Raises:
            StateChangedError: a tensor was written in place before it was copied.
        """
        if self._events:
            with self._lock:
                if not self._copied.is_set():
                    for event in self._events:
                        event.synchronize()
                    self._done_copying()
        else:
            while (item := self._take()) is not None:
                _, source, buffer = item
                try:
                    buffer.copy_(source)
                except BaseException as err:
                    self._error = err
                    raise
                finally:
                    with self._lock:
                        self._left -= 1
                        if self._left == 0:
                            self._done_copying()
            self._copied.wait()
        if self._error is not None:
            raise self._error

    def _take(self) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        with self._lock:
            if self._taken == len(self._deferred):
                return None
            self._taken += 1
            return self._deferred[self._taken - 1]

    def _done_copying(self) -> None:
        """Under the lock: every deferred copy is made; were their tensors left alone?"""
        self._error = self._error or self._changed([name for name, _, _ in self._deferred])
        self._copied.set()
        if self._released.is_set():
            self._ready_at = time.perf_counter()

    def release(self, *, check: bool = True) -> None:
        """The persist has read every held tensor (or gave up): training may step.

        Raises:
            StateChangedError: (``check``) a held tensor was written in place meanwhile.
        """
        if self._released.is_set():
            return
        error = self._changed(sorted(self.held)) if check else None
        if self._copied.is_set():
            self._ready_at = time.perf_counter()
        self._released.set()
        if error is not None:
            raise error

    def abandon(self) -> None:
        """The save will not be persisted: copy nothing more and let training step."""
        self.failed = True
        with self._lock:
            self._taken = self._left = 0
            self._deferred = []
            self._copied.set()
        self.release(check=False)

    def wait_for_step(self) -> None:
        """Block an optimizer step until nothing of this save needs the live tensors,
        making deferred copies meanwhile."""
        if self._released.is_set() and self._copied.is_set():
            return
        self._blocked_since = time.perf_counter()
        with contextlib.suppress(StateChangedError):  # the save's failure, from its persist
            self.finish()
        self._released.wait()

    @property
    def step_wait_seconds(self) -> float:
        """How long an optimizer step waited for this save (so far)."""
        if self._blocked_since is None:
            return 0.0
        ready = self._ready_at if self._ready_at is not None else time.perf_counter()
        return max(0.0, ready - self._blocked_since)

    def _changed(self, names: list[str]) -> StateChangedError | None:
        changed = [n for n in names if _version(self._versions[n][0]) != self._versions[n][1]]
        if not changed:
            return None
        self.failed = True
        return StateChangedError(
            f"{len(changed)} tensor(s) changed in place after save() and before the next "
            f"optimizer step, while the save still needed them ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}); this save is not kept. Write "
            f"parameters and optimizer state only in the optimizer's step, or turn "
            f"overlap off (Checkpointer(overlap=False), CKPT_OVERLAP=0)"
        )


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (None: an inference tensor has none)."""
    return None if tensor.is_inference() else tensor._version
