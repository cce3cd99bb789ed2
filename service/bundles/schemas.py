from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ckpt.core.contract import (
    SHA256_HEX,
    BlobRef,
    Imported,
    Layer,
    LayerRecord,
    Manifest,
    SaveFigures,
    Versions,
)
from service.completeness import Part
from service.names import MAX_ID, Id, Reason, Step

Epoch = Annotated[int, Field(ge=1, le=MAX_ID, strict=True)]
Sha256 = Annotated[str, Field(pattern=SHA256_HEX, description="a blob's SHA-256, in hex")]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BundleOpen(_Request):
    attempt_id: Id
    epoch: Epoch
    step: Step
    micro_step: Step = Field(
        default=0,
        description="the micro step of the step's gradient accumulation it is saved at; a "
        "bundle is named by its position (step, micro step)",
    )
    # 16384 ranks: the largest jobs of today; a 409 then lists up to 98304 missing parts.
    world_size: Annotated[int, Field(ge=1, le=16384, strict=True)]
    versions: Versions
    imported: Imported | None = Field(
        default=None,
        description="made by ckpt import: the source, and the layers it accepted as missing "
        "(an imported, partial bundle commits without them and is never a bit-exact resume)",
    )


class LayerPut(_Request):
    epoch: Epoch
    record: LayerRecord


class SaveReport(_Request):
    bundle: Id
    figures: SaveFigures


# The most earlier saves' figures one record carries (an agent sends those it has not sent).
MAX_SAVES_PER_RECORD = 16


class LayersPut(_Request):
    epoch: Epoch
    layers: Annotated[
        dict[Layer, LayerRecord],
        Field(min_length=1, description="every layer of the rank to record, by name"),
    ]
    saves: Annotated[
        list[SaveReport],
        Field(
            max_length=MAX_SAVES_PER_RECORD,
            description="the figures of this rank's earlier saves, each as `PUT "
            "/v1/bundles/{bundle}/saves/{rank}` would record them; one that cannot be "
            "recorded (its bundle gone, another run's) is left out",
        ),
    ] = []


class Commit(_Request):
    epoch: Epoch


# The work of a query grows with its blobs (a store lookup each): ask in pages of this many.
MAX_BLOBS_PER_QUERY = 10_000


class BlobsQuery(_Request):
    blobs: Annotated[
        list[BlobRef],
        Field(
            max_length=MAX_BLOBS_PER_QUERY,
            description=f"at most {MAX_BLOBS_PER_QUERY} blobs a request",
        ),
    ]


class BlobsMissing(BaseModel):
    missing: list[str]


class Quarantine(_Request):
    reason: Reason
    epoch: Epoch | None = Field(
        default=None,
        description="the epoch of the caller's attempt: required from a run token (fencing)",
    )
    blob: Sha256 | None = Field(
        default=None,
        description="the blob that failed verification: the service reads it back and "
        "quarantines every complete bundle using it if it is damaged (409 intact if not); "
        "required from a run token, optional for an admin (without it: this bundle only)",
    )


class Unquarantine(_Request):
    reason: Reason | None = None


class BundlePatch(_Request):
    pinned: Annotated[bool, Field(strict=True)]


class RecordedLayer(Part):
    payload_bytes: int
    num_blobs: int


class RecordedLayers(BaseModel):
    recorded: list[RecordedLayer]  # the layers of the request, in its order


class SaveOut(BaseModel):
    """One rank's save figures (see ``ckpt.core.contract.SaveFigures``) and when they came."""

    model_config = ConfigDict(from_attributes=True)  # built from a ``Save`` row

    rank: int
    stall_seconds: float
    persist_seconds: float
    payload_bytes: int
    new_bytes: int
    tax_seconds: float | None  # the save tax; None: the rank did not know it
    reported_at: datetime


class BundleOut(BaseModel):
    id: int
    run: str
    step: int
    micro_step: int
    world_size: int
    status: str
    reason: str | None
    attempt_id: int | None
    parent_id: int | None
    pinned: bool
    created_at: datetime
    committed_at: datetime | None
    recorded: list[RecordedLayer]
    missing_layers: list[Part]  # per rank, per layer: what is not recorded yet
    manifest: Manifest | None
    saves: list[SaveOut]  # by rank: the figures the ranks reported
    imported: Imported | None = None  # made by ckpt import (None: by a save)
    partial: bool = False  # imported without some layers: never a bit-exact resume


class Committed(BaseModel):
    bundle: BundleOut
    head_id: int | None
