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

Which tensors need no copy because they did not change is ``unchanged``; the snapshot a
save persists, and the wait it imposes on the next optimizer step, is ``snapshot.Staged``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping

import torch
from torch.utils.hooks import RemovableHandle

from agent.save.snapshot import Staged
from agent.save.unchanged import Fingerprint, sample_equal
from agent.state.capture import LayerState, capture, optimizer_memory, stable_memory
from agent.state.objects import TrainingObjects
from ckpt.core.contract import RESTORE_ORDER, Layer

log = logging.getLogger("ckpt")


def stage_layers(
    objects: TrainingObjects, staging: StagingArea, *, skip_unchanged: bool, overlap: bool
) -> tuple[dict[Layer, LayerState], Staged]:
    """Capture the six layers and copy their tensors into the staging buffers (with
    ``overlap``, the optimizers' tensors later)."""
    captured = capture(objects)
    stable = stable_memory(objects) if skip_unchanged else set()
    stepped = optimizer_memory(objects)
    staged = staging.stage(
        {name: tensor for _, tensors in captured.values() for name, tensor in tensors.items()},
        volatile=lambda t: t.untyped_storage().data_ptr() not in stable,
        deferrable=lambda t: t.untyped_storage().data_ptr() in stepped,
        overlap=overlap,
    )
    states = {
        layer: LayerState(captured[layer][0], {n: staged.tensors[n] for n in captured[layer][1]})
        for layer in RESTORE_ORDER
    }
    return states, staged


class StagingArea:
    """Reusable host buffers, one per tensor name, within an optional byte ``budget``.

    Not thread-safe: stage only while no persist is reading the buffers.
    """

    def __init__(self, *, budget: int | None = None) -> None:
        self.budget = budget
        self._buffers: dict[str, torch.Tensor] = {}
        self._fingerprints: dict[str, Fingerprint] = {}
        self._rounds = itertools.count()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: Staged | None = None
        self._told_over_budget = False

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self._buffers.values())

    def hold_steps(
        self, optimizers: Iterable[torch.optim.Optimizer], *, stalled: Callable[[float], None]
    ) -> list[RemovableHandle]:
        """Make every step of ``optimizers`` first wait (``before_step``) until the last save
        no longer needs the tensors it changes: the overlapped copies, the tensors read in
        place over the budget. ``stalled`` is told how long each step waited; the hooks'
        handles remove them."""

        def hook(*_: object) -> None:
            started = time.perf_counter()
            self.before_step()
            stalled(time.perf_counter() - started)

        return [optimizer.register_step_pre_hook(hook) for optimizer in optimizers]

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
        self._last = None  # its tensors are the buffers: they are freed only with it
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
            fingerprint = None if volatile(source) else Fingerprint.of(source)
            if (
                fingerprint is not None
                and fingerprint.same(self._fingerprints.get(name))
                and sample_equal(source, buffer, offset=offset)
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
