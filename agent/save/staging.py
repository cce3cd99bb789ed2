"""Staging: the snapshot of the state that a save persists while training goes on.

``StagingArea.stage`` copies every tensor of the captured state into host buffers that are
allocated on first use and reused by every later save (pinned when the source is on a GPU,
so the device-to-host copies run asynchronously and at full speed). Fresh memory costs
about 1 GB/s on first touch against 13+ GB/s for a warm buffer, so a buffer is only
reallocated when its tensor changes shape or dtype.

**Overlap.** Parameters and optimizer state change only in the optimizer's step, so their
copies need not hold training up: with ``overlap``, ``stage`` copies at once only the
tensors the next forward and backward may change (buffers such as batch-norm statistics,
gradients mid-accumulation, extras) and leaves the optimizer's tensors to the persist thread
(on a GPU: to a side CUDA stream). A pre-hook on every optimizer's ``step``
(``StagingArea.before_step``) waits until they are copied; the step takes the copy over
itself when the persist thread has not started it. Should anything write such a tensor in
place before that step, its version counter moves and the save fails (``StateChangedError``)
instead of keeping torn bytes. Writes that bypass the counter (``.data``, fused kernels
outside an optimizer step) are not seen: turn ``overlap`` off for such loops.

**Budget.** With ``budget`` bytes, buffers are given first to the tensors that must be
copied at once, then to the optimizer's tensors while they fit; the rest are *held*: the
persist reads them in place, without a copy, and the next optimizer step waits until they
are written. That trades stall for memory; buffers never exceed the budget unless the
tensors that must be copied at once do alone (said once, in the log).

A tensor whose memory and version counter are unchanged since the previous stage, and whose
sampled elements still equal its buffer's, still has its bytes in its buffer: it is not
copied again, and the persist phase reuses the SHA-256 of its blobs. Fused and custom
optimizer kernels update tensors without bumping the version counter, and so does batch
norm to its running statistics; ``volatile`` says which tensors to copy every time, leaving
the skip to frozen weights, the bulk of a LoRA-style run. Writes through ``.data`` bypass
the counter too: the sample (``SAMPLES`` elements, at offsets that move with every save)
catches a tensor rewritten as a whole (an EMA, ``.data.copy_``), not a change to a few
elements; ``Checkpointer(skip_unchanged=False)`` turns the skip off.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ckpt.core.errors import StateChangedError

log = logging.getLogger("ckpt")

SAMPLES = 4096


@dataclass(frozen=True)
class _Fingerprint:
    """Where a tensor's bytes live and how often they were written in place."""

    # Held, so that no other tensor can be allocated at this address while it is compared.
    storage: torch.UntypedStorage
    layout: tuple[object, ...]
    version: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Fingerprint | None:
        if tensor.is_inference():  # inference tensors have no version counter
            return None
        return cls(
            tensor.untyped_storage(),
            (
                tensor.device,
                tensor.dtype,
                tuple(tensor.shape),
                tuple(tensor.stride()),
                tensor.storage_offset(),
                tensor.is_neg(),
                tensor.is_conj(),
            ),
            tensor._version,
        )

    def same(self, other: _Fingerprint | None) -> bool:
        return (
            other is not None
            and self.storage.data_ptr() == other.storage.data_ptr()
            and self.layout == other.layout
            and self.version == other.version
        )


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


class StagingArea:
    """Reusable host buffers, one per tensor name, within an optional byte ``budget``.

    Not thread-safe: stage only while no persist is reading the buffers.
    """

    def __init__(self, *, budget: int | None = None) -> None:
        self.budget = budget
        self._buffers: dict[str, torch.Tensor] = {}
        self._fingerprints: dict[str, _Fingerprint] = {}
        self._rounds = itertools.count()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: Staged | None = None
        self._told_over_budget = False

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self._buffers.values())

    def before_step(self) -> None:
        """An optimizer is about to step: wait until the last save no longer needs the
        tensors it changes (an optimizer step pre-hook)."""
        last = self._last
        if last is not None:
            last.wait_for_step()

    def release(self) -> int:
        """Free every buffer (the next save allocates them again); the bytes freed.
        Call only while no save is in flight."""
        freed = self.nbytes
        self._buffers.clear()
        self._fingerprints.clear()
        return freed

    def stage(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        volatile: Callable[[torch.Tensor], bool],
        deferrable: Callable[[torch.Tensor], bool] = lambda tensor: False,
        overlap: bool = False,
    ) -> Staged:
        """Copy ``tensors`` into their buffers; with ``overlap``, leave the ``deferrable``
        ones' copies to ``Staged.finish``. Over the budget, deferrable tensors are held.

        Args:
            tensors: every tensor of the state, by a name that stays the same across saves.
            volatile: whether a tensor may change without its version counter moving
                (optimizer-updated tensors); those are copied every time.
            deferrable: whether a tensor changes only in an optimizer step (its copy may
                wait until then: ``before_step`` must run before every such step).
        """
        if self._last is not None and self._last.failed:
            self._fingerprints.clear()  # its buffers may hold half a copy
        sources = {name: tensor.detach() for name, tensor in tensors.items()}
        later = {name for name, source in sources.items() if deferrable(source)}
        held = self._held(sources, later)
        try:
            staged = self._copy(
                sources, volatile=volatile, later=later if overlap else set(), held=held
            )
        except BaseException:
            self._fingerprints.clear()  # half staged: compare nothing with this stage
            raise
        for name in self._buffers.keys() - (sources.keys() - held):  # gone, or held now
            del self._buffers[name]
            self._fingerprints.pop(name, None)
        self._last = staged
        return staged

    def _held(self, sources: Mapping[str, torch.Tensor], later: set[str]) -> frozenset[str]:
        """The deferrable tensors that get no buffer within the budget (first fit, the
        tensors that must be copied at once first)."""
        if self.budget is None:
            return frozenset()
        used = sum(source.nbytes for name, source in sources.items() if name not in later)
        if used > self.budget and not self._told_over_budget:
            self._told_over_budget = True
            log.warning(
                "ckpt: the tensors a save must copy at once (buffers, gradients mid-"
                "accumulation, extras) take %d bytes, over the staging budget of %d "
                "(CKPT_STAGING_BYTES): they are staged all the same (said once)",
                used,
                self.budget,
            )
        held = set()
        for name in later:
            size = sources[name].nbytes
            if used + size <= self.budget:
                used += size
            else:
                held.add(name)
        return frozenset(held)

    def _copy(
        self,
        sources: Mapping[str, torch.Tensor],
        *,
        volatile: Callable[[torch.Tensor], bool],
        later: set[str],
        held: frozenset[str],
    ) -> Staged:
        unchanged: set[str] = set()
        deferred: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        copied = 0
        on_gpu = False
        offset = next(self._rounds)
        staged: dict[str, torch.Tensor] = {}
        for name, source in sources.items():
            if name in held:
                staged[name] = source
                continue
            buffer = staged[name] = self._buffer(name, source)
            fingerprint = None if volatile(source) else _Fingerprint.of(source)
            if (
                fingerprint is not None
                and fingerprint.same(self._fingerprints.get(name))
                and _sample_equal(source, buffer, offset=offset)
            ):
                unchanged.add(name)
                continue
            copied += buffer.nbytes
            if fingerprint is None:
                self._fingerprints.pop(name, None)
            else:
                self._fingerprints[name] = fingerprint
            if name in later:
                deferred.append((name, source, buffer))
                continue
            on_gpu = on_gpu or source.device.type != "cpu"
            buffer.copy_(source, non_blocking=buffer.is_pinned())
        if on_gpu and torch.cuda.is_available():
            torch.cuda.synchronize()  # the staged signal means the bytes are in host memory
        return Staged(
            staged,
            unchanged=frozenset(unchanged),
            copied_bytes=copied,
            deferred=deferred,
            events=self._on_side_streams(deferred),
            held=held,
        )

    def _on_side_streams(
        self, deferred: list[tuple[str, torch.Tensor, torch.Tensor]]
    ) -> list[torch.cuda.Event]:
        """Start the deferred copies of GPU tensors on a side stream per device, after what
        the device has queued so far; the events mark them done. CPU tensors are copied
        by ``Staged.finish`` (all of them, when any tensor is on the CPU)."""
        if not deferred or any(source.device.type != "cuda" for _, source, _ in deferred):
            return []
        events = []
        for device in {source.device for _, source, _ in deferred}:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _, source, buffer in deferred:
                    if source.device == device:
                        buffer.copy_(source, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            events.append(event)
        return events

    def _buffer(self, name: str, source: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            self._fingerprints.pop(name, None)
            buffer = torch.empty(
                source.shape,
                dtype=source.dtype,
                pin_memory=source.device.type == "cuda" and torch.cuda.is_available(),
            )
            self._buffers[name] = buffer
        return buffer


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (None: an inference tensor has none)."""
    return None if tensor.is_inference() else tensor._version


def _sample_equal(source: torch.Tensor, buffer: torch.Tensor, *, offset: int) -> bool:
    """Whether ``SAMPLES`` evenly spread elements of ``source`` (from a moving offset) hold
    the same bits as in ``buffer``. Only contiguous tensors are sampled; others count as
    changed."""
    if not source.is_contiguous():
        return False
    count = source.numel()
    if count <= SAMPLES:
        return bool(torch.equal(_bits(source).cpu(), _bits(buffer)))
    stride = count // SAMPLES
    picks = torch.arange(offset % stride, count, stride, device=source.device)[:SAMPLES]
    return bool(
        torch.equal(_bits(source).reshape(-1)[picks].cpu(), _bits(buffer).reshape(-1)[picks.cpu()])
    )


_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The elements as integers of their width, so that equality is bitwise (NaN equals
    NaN, -0.0 is not 0.0)."""
    flat = tensor.reshape(-1)
    return flat.view(_INTEGERS.get(flat.element_size(), torch.uint8))
