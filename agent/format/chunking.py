"""Cut a payload into blobs along a deterministic layout.

Blob boundaries follow tensor boundaries, and every tensor of ``GROUP_BYTES`` or more has
blobs of its own, so a tensor that did not change between two bundles lands in
byte-identical blobs with the same SHA-256 and is not stored twice (the frozen base of a
LoRA run costs nothing after the first bundle). Only smaller tensors share blobs, so a
changed one costs at most one group. The header, which changes with every save, is always
a blob of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_BLOB_BYTES = 64 << 20
# S3's largest PutObject: a blob goes up in one request, whose SHA-256 the store keeps.
MAX_BLOB_BYTES = 5 << 30
GROUP_BYTES = 1 << 20


def plan_blobs(
    spans: Sequence[tuple[int, int]], *, blob_bytes: int, group_bytes: int | None = None
) -> list[tuple[int, int]]:
    """Byte ranges of the blobs of a payload.

    Args:
        spans: consecutive ``(begin, end)`` ranges: the header first, then each tensor.
        blob_bytes: the largest blob, except that a header larger than this stays whole.
        group_bytes: tensors smaller than this are grouped (default: ``blob_bytes``).

    Returns:
        Consecutive ranges covering the payload: the header alone; tensors smaller than
        ``group_bytes`` grouped in order while the group fits in ``blob_bytes``; a larger
        tensor alone, cut into ``blob_bytes`` pieces from its own start.
    """
    if blob_bytes < 1:
        raise ValueError(f"blob_bytes must be positive, got {blob_bytes}")
    group_bytes = blob_bytes if group_bytes is None else group_bytes
    if not spans:
        return []
    blobs = [spans[0]]
    group: tuple[int, int] | None = None
    for begin, end in spans[1:]:
        if end == begin:
            continue
        if end - begin >= min(group_bytes, blob_bytes):
            if group:
                blobs.append(group)
                group = None
            blobs.extend((lo, min(lo + blob_bytes, end)) for lo in range(begin, end, blob_bytes))
        elif group and end - group[0] <= blob_bytes:
            group = (group[0], end)
        else:
            if group:
                blobs.append(group)
            group = (begin, end)
    if group:
        blobs.append(group)
    return blobs
