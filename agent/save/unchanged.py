"""Which staged tensors still hold their last save's bytes, so need no copy and no hash.

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

from dataclasses import dataclass

import torch

SAMPLES = 4096


@dataclass(frozen=True)
class Fingerprint:
    """Where a tensor's bytes live and how often they were written in place."""

    # Held, so that no other tensor can be allocated at this address while it is compared.
    storage: torch.UntypedStorage
    layout: tuple[object, ...]
    version: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Fingerprint | None:
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

    def same(self, other: Fingerprint | None) -> bool:
        return (
            other is not None
            and self.storage.data_ptr() == other.storage.data_ptr()
            and self.layout == other.layout
            and self.version == other.version
        )


def sample_equal(source: torch.Tensor, buffer: torch.Tensor, *, offset: int) -> bool:
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
