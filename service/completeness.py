"""What a bundle still lacks before it may become complete: one pure function, no I/O."""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from pydantic import BaseModel

from ckpt.core.contract import RESTORE_ORDER, Layer, LayerRecord


class BlobProblem(enum.StrEnum):
    ABSENT = "absent"
    WRONG_SIZE = "wrong_size"
    WRONG_HASH = "wrong_hash"
    # Run isolation: no bundle of the committing run (or its dedup group) used the blob
    # before, and the run has not written it since the bundle was opened. Whether the store
    # holds it at all is not said: that would tell one run about another's data.
    NOT_WRITTEN = "not_written"


# What a blob's damage (``blob.damage``) may be: facts about the store's copy alone.
DAMAGE = (BlobProblem.ABSENT, BlobProblem.WRONG_SIZE, BlobProblem.WRONG_HASH)


@dataclass(frozen=True)
class StoredBlob:
    """What the store holds under a blob's key: its size (None: absent), whether its
    SHA-256 matched (None: not read, because the catalog verified it before), and whether
    the committing run wrote it (None: not asked, the run's bundles used it before)."""

    size: int | None
    sha256_ok: bool | None = None
    written: bool | None = None


class Part(BaseModel):
    rank: int
    layer: Layer


class BadBlob(BaseModel):
    sha256: str
    size: int  # what the layer records say
    problem: BlobProblem
    found_size: int | None  # what the store holds (None: nothing)
    used_by: list[Part]


class Missing(BaseModel):
    """Everything that keeps a bundle from being complete; empty when nothing does."""

    ranks: list[int] = []  # ranks that recorded no layer at all
    layers: list[Part] = []  # every unrecorded (rank, layer), those ranks' included
    blobs: list[BadBlob] = []

    def __bool__(self) -> bool:
        return bool(self.layers or self.blobs)


_NOT_FOUND = StoredBlob(size=None)


def missing(
    *,
    world_size: int,
    recorded: Mapping[tuple[int, Layer], LayerRecord],
    stored: Mapping[str, StoredBlob],
    accepted: Collection[Layer] = (),
) -> Missing:
    """What ``recorded`` layers and ``stored`` blobs lack for a complete bundle.

    Every rank below ``world_size`` needs all six layers; every blob a recorded layer
    references must be in ``stored`` with the recorded size and a matching SHA-256 (and,
    where ``stored`` says whether, written by the committing run).
    """
    layers = missing_layers(world_size=world_size, recorded=recorded.keys(), accepted=accepted)
    ranks = [
        rank
        for rank in range(world_size)
        if not any((rank, layer) in recorded for layer in RESTORE_ORDER)
    ]
    blobs = []
    for sha256, (size, parts) in sorted(_usage(recorded).items()):
        found = stored.get(sha256)
        problem = blob_problem(size, found or _NOT_FOUND)
        if problem is not None:
            blobs.append(
                BadBlob(
                    sha256=sha256,
                    size=size,
                    problem=problem,
                    found_size=found.size if found else None,
                    used_by=[Part(rank=rank, layer=layer) for rank, layer in parts],
                )
            )
    return Missing(ranks=ranks, layers=layers, blobs=blobs)


def summary(missing: Missing) -> str:
    """What ``missing`` lists, in a few words: "2 blob(s) absent, ..."."""
    parts = []
    if missing.ranks:
        parts.append(f"ranks {missing.ranks} recorded nothing")
    if missing.layers:
        parts.append(f"{len(missing.layers)} (rank, layer) parts unrecorded")
    for problem in BlobProblem:
        count = sum(1 for blob in missing.blobs if blob.problem is problem)
        if count:
            parts.append(f"{count} blob(s) {problem.value.replace('_', ' ')}")
    return ", ".join(parts)


def missing_layers(
    *,
    world_size: int,
    recorded: Collection[tuple[int, Layer]],
    accepted: Collection[Layer] = (),
) -> list[Part]:
    """Every (rank, layer) below ``world_size`` that is not in ``recorded``, rank by rank;
    ``accepted``: layers an imported, partial bundle goes without."""
    return [
        Part(rank=rank, layer=layer)
        for rank in range(world_size)
        for layer in RESTORE_ORDER
        if (rank, layer) not in recorded and layer not in accepted
    ]


def _usage(
    recorded: Mapping[tuple[int, Layer], LayerRecord],
) -> dict[str, tuple[int, list[tuple[int, Layer]]]]:
    """Each referenced blob: the size its first record gives, and the (rank, layer) parts
    that use it, in rank and restore order."""
    usage: dict[str, tuple[int, list[tuple[int, Layer]]]] = {}
    in_order = sorted(
        recorded.items(), key=lambda item: (item[0][0], RESTORE_ORDER.index(item[0][1]))
    )
    for part, record in in_order:
        for blob in record.blobs:
            _, parts = usage.setdefault(blob.sha256, (blob.size, []))
            if part not in parts:
                parts.append(part)
    return usage


def blob_problem(size: int, found: StoredBlob) -> BlobProblem | None:
    """What is wrong with the store's copy of a blob of ``size`` bytes; None: nothing."""
    if found.written is False:
        return BlobProblem.NOT_WRITTEN
    if found.size is None:
        return BlobProblem.ABSENT
    if found.size != size:
        return BlobProblem.WRONG_SIZE
    if found.sha256_ok is False:
        return BlobProblem.WRONG_HASH
    return None
