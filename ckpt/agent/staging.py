"""Staging: the snapshot of the state that a save persists while training goes on.

``StagingArea.stage`` copies every tensor of the captured state into host buffers that are
allocated on first use and reused by every later save (pinned when the source is on a GPU,
so the device-to-host copies run asynchronously and at full speed). Fresh memory costs
about 1 GB/s on first touch against 13+ GB/s for a warm buffer, so a buffer is only
reallocated when its tensor changes shape or dtype.

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

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class Staged:
    """A staged snapshot: CPU buffers by tensor name, and the names copied this time."""

    tensors: dict[str, torch.Tensor]
    unchanged: frozenset[str]  # names whose buffers were left as the previous stage wrote them
    copied_bytes: int


class StagingArea:
    """Reusable host buffers, one per tensor name.

    Not thread-safe: stage only while no persist is reading the buffers.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._fingerprints: dict[str, _Fingerprint] = {}
        self._rounds = itertools.count()

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self._buffers.values())

    def stage(
        self, tensors: Mapping[str, torch.Tensor], *, volatile: Callable[[torch.Tensor], bool]
    ) -> Staged:
        """Copy ``tensors`` into their buffers and wait until the copies are done.

        Args:
            tensors: every tensor of the state, by a name that stays the same across saves.
            volatile: whether a tensor may change without its version counter moving
                (optimizer-updated tensors); those are copied every time.
        """
        try:
            unchanged, copied = self._copy(tensors, volatile=volatile)
        except BaseException:
            self._fingerprints.clear()  # half staged: compare nothing with this stage
            raise
        for name in self._buffers.keys() - tensors.keys():  # gone from the state
            del self._buffers[name]
            self._fingerprints.pop(name, None)
        return Staged({name: self._buffers[name] for name in tensors}, frozenset(unchanged), copied)

    def _copy(
        self, tensors: Mapping[str, torch.Tensor], *, volatile: Callable[[torch.Tensor], bool]
    ) -> tuple[set[str], int]:
        unchanged: set[str] = set()
        copied = 0
        on_gpu = False
        offset = next(self._rounds)
        for name, tensor in tensors.items():
            source = tensor.detach()
            buffer = self._buffer(name, source)
            fingerprint = None if volatile(source) else _Fingerprint.of(source)
            if (
                fingerprint is not None
                and fingerprint.same(self._fingerprints.get(name))
                and _sample_equal(source, buffer, offset=offset)
            ):
                unchanged.add(name)
                continue
            on_gpu = on_gpu or source.device.type != "cpu"
            buffer.copy_(source, non_blocking=buffer.is_pinned())
            copied += buffer.nbytes
            if fingerprint is None:
                self._fingerprints.pop(name, None)
            else:
                self._fingerprints[name] = fingerprint
        if on_gpu and torch.cuda.is_available():
            torch.cuda.synchronize()  # the staged signal means the bytes are in host memory
        return unchanged, copied

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
