"""The wire contract shared by the agent and the control plane: the bundle manifest.

Depends on nothing heavier than pydantic, so both a training image (no FastAPI) and the
control plane (no torch) import it.

A bundle is one checkpoint of a run at one step. For every rank it holds six layers, each
stored as one safetensors-compatible *payload* that is cut into content-addressed *blobs*.
The manifest lists all of it and is written last: it is the bundle's commit record.
"""

from __future__ import annotations

import enum
import unicodedata
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

MANIFEST_FORMAT = "ckpt.bundle/1"
MAX_BYTES = 2**62  # sizes and offsets: far beyond any payload, inside a signed 64-bit column
# A trillion steps: beyond any training run, and a bound that keeps counters derived from
# steps (steps lost) meaningful.
MAX_STEP = 2**40
SHA256_HEX = r"^[0-9a-f]{64}$"
# No control characters: no NUL (Postgres text cannot hold it), no line breaks or escape
# sequences (the text reaches logs and terminals). C0, DEL, C1 and the Unicode line breaks.
PRINTABLE = r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029]*$"
# The characters a reader cannot see, by Unicode category: controls, format characters (the
# bidirectional overrides among them: "\u202elive" reads "evil"; zero-width marks), line
# and paragraph separators, surrogates. Names and versions may hold none.
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
# The safetensors dtype codes a payload may hold (the agent's ``format/dtypes.py`` maps torch
# dtypes onto these; a test keeps the two in step).
DTYPE_CODES = (
    "F64",
    "F32",
    "F16",
    "BF16",
    "F8_E4M3",
    "F8_E5M2",
    "I64",
    "I32",
    "I16",
    "I8",
    "U64",
    "U32",
    "U16",
    "U8",
    "BOOL",
)


class Layer(enum.StrEnum):
    """The six layers of training state, declared in their fixed restore order."""

    WEIGHTS = "weights"
    OPTIMIZER = "optimizer"
    SCHEDULER = "scheduler"
    RNG = "rng"
    DATA = "data"
    COUNTERS = "counters"


RESTORE_ORDER: tuple[Layer, ...] = tuple(Layer)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BlobRef(_Frozen):
    """One content-addressed blob: a byte range of a layer's payload."""

    sha256: Annotated[str, Field(pattern=SHA256_HEX)]
    size: Annotated[int, Field(ge=0, le=MAX_BYTES, strict=True)]


def _known_dtype(code: str) -> str:
    if code not in DTYPE_CODES:
        raise ValueError(f"unknown dtype {code!r}: use one of {', '.join(DTYPE_CODES)}")
    return code


Dtype = Annotated[
    str,
    Field(max_length=16, json_schema_extra={"enum": list(DTYPE_CODES)}),
    AfterValidator(_known_dtype),
]
Extent = Annotated[int, Field(ge=0, le=MAX_BYTES, strict=True)]  # a dimension, or a byte offset


class TensorEntry(_Frozen):
    """Where one tensor lies in its payload's data section (safetensors conventions)."""

    dtype: Dtype
    shape: Annotated[tuple[Extent, ...], Field(max_length=64)]  # torch allows 64 dimensions
    data_offsets: tuple[Extent, Extent]

    @model_validator(mode="after")
    def _begin_before_end(self) -> TensorEntry:
        begin, end = self.data_offsets
        if begin > end:
            raise ValueError(f"data_offsets {list(self.data_offsets)} begin after they end")
        return self


class LayerRecord(_Frozen):
    """One (rank, layer) payload: its blobs in order and its tensor index."""

    payload_bytes: Annotated[int, Field(ge=8, le=MAX_BYTES, strict=True)]
    header_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES, strict=True)]
    blobs: tuple[BlobRef, ...]
    tensors: dict[str, TensorEntry]

    @model_validator(mode="after")
    def _blobs_cover_payload(self) -> LayerRecord:
        sizes: dict[str, int] = {}
        for blob in self.blobs:
            if sizes.setdefault(blob.sha256, blob.size) != blob.size:
                raise ValueError(
                    f"blob {blob.sha256} is listed with sizes {sizes[blob.sha256]} and "
                    f"{blob.size}: one SHA-256, one content, one size"
                )
        total = sum(blob.size for blob in self.blobs)
        if total != self.payload_bytes:
            raise ValueError(f"blobs hold {total} bytes but the payload has {self.payload_bytes}")
        if not self.blobs or self.blobs[0].size != self.header_bytes:
            raise ValueError("the first blob must be the payload header, alone")
        data = max((entry.data_offsets[1] for entry in self.tensors.values()), default=0)
        if self.header_bytes + data != self.payload_bytes:
            raise ValueError(
                f"header ({self.header_bytes}) and tensors ({data}) do not add up to the "
                f"payload ({self.payload_bytes} bytes)"
            )
        return self


class RankRecord(_Frozen):
    rank: Annotated[int, Field(ge=0, strict=True)]
    layers: dict[Layer, LayerRecord]


def check_visible(text: str) -> str:
    """Return ``text`` if a reader sees every character of it, else raise ``ValueError``."""
    for position, char in enumerate(text):
        if unicodedata.category(char) in HIDDEN_CATEGORIES:
            what = unicodedata.name(char, "a control character")
            raise ValueError(
                f"U+{ord(char):04X} ({what}) at position {position}: no control or format "
                "characters here (bidirectional overrides, zero-width marks), which make the "
                "text read as another"
            )
    return text


VersionText = Annotated[
    str, Field(max_length=128, pattern=PRINTABLE), AfterValidator(check_visible)
]


class Versions(_Frozen):
    """The versions that wrote a bundle: short printable strings ("2.13.0+cu124")."""

    ckpt: VersionText
    python: VersionText
    torch: VersionText


class CatalogRef(_Frozen):
    """Where the control plane keeps the bundle: lets ``ckpt catalog rebuild`` restore lineage."""

    bundle_id: int
    parent_id: int | None
    epoch: int


ImportFormat = Literal["hf", "lightning", "dcp", "torch"]


class Imported(_Frozen):
    """How ``ckpt import`` made a bundle from another tool's checkpoint.

    ``missing`` are the layers the source could not fill and the user accepted without
    (``--accept-missing``): the bundle is *imported, partial*, a resume restores the other
    layers only, and it is never a bit-exact bundle.
    """

    format: ImportFormat
    source: Annotated[str, Field(max_length=4096, pattern=PRINTABLE)]
    missing: tuple[Layer, ...] = ()

    @property
    def partial(self) -> bool:
        return bool(self.missing)


class Manifest(_Frozen):
    """The commit record of a bundle; a bundle without one does not exist."""

    format: str = MANIFEST_FORMAT
    run: str
    step: Annotated[int, Field(ge=0, le=MAX_STEP, strict=True)]
    # Which micro-batch of the step's gradient accumulation (0: at the step's start); a
    # bundle is named by its position, (step, micro step).
    micro_step: Annotated[int, Field(ge=0, le=MAX_STEP, strict=True)] = 0
    world_size: Annotated[int, Field(ge=1, strict=True)]
    created_at: str
    versions: Versions
    ranks: tuple[RankRecord, ...]
    catalog: CatalogRef | None = None  # None when written store-only
    imported: Imported | None = None  # made by ``ckpt import``, not by a save

    @model_validator(mode="after")
    def _known_format(self) -> Manifest:
        if self.format != MANIFEST_FORMAT:
            raise ValueError(
                f"unknown manifest format {self.format!r}; expected {MANIFEST_FORMAT!r}"
            )
        ranks = [record.rank for record in self.ranks]
        if len(set(ranks)) != len(ranks) or any(rank >= self.world_size for rank in ranks):
            raise ValueError(
                f"ranks {ranks} must be distinct and below world_size {self.world_size}"
            )
        missing = set(self.imported.missing) if self.imported is not None else set()
        if any(missing & record.layers.keys() for record in self.ranks):
            raise ValueError(
                f"imported.missing names {sorted(missing)}, and a rank records one of them"
            )
        return self

    @property
    def position(self) -> tuple[int, int]:
        """(step, micro step): where in the run this bundle was saved; bundles order by it."""
        return (self.step, self.micro_step)


Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False, strict=True)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES, strict=True)]


class SaveFigures(_Frozen):
    """What one rank's save of a bundle cost (``PUT /v1/bundles/{id}/saves/{rank}``).

    ``stall_seconds`` is the time training waited (staging the state, plus waiting for the
    save before it when one was still in flight); ``persist_seconds`` runs from the end of
    staging until the bundle was committed; ``new_bytes`` are the bytes this save uploaded
    (the rest of ``payload_bytes`` was already in the store; a blob uploaded twice, because it
    vanished before the commit, counts twice). ``tax_seconds`` is the save tax: the extra
    wall-clock time the training loop paid for the save, from ``save()`` until durable (its
    optimizer steps over the median step before it; the stall included); None when unknown
    (the loop had made too few steps without a save in flight).
    """

    stall_seconds: Seconds
    persist_seconds: Seconds
    payload_bytes: Bytes
    new_bytes: Bytes
    tax_seconds: Seconds | None = None


def missing_parts(manifest: Manifest) -> list[tuple[int, Layer]]:
    """Every (rank, layer) the manifest lacks; empty when the bundle is complete (an
    imported bundle may lack the layers its import accepted as missing)."""
    present = {(record.rank, layer) for record in manifest.ranks for layer in record.layers}
    accepted = manifest.imported.missing if manifest.imported is not None else ()
    return [
        (rank, layer)
        for rank in range(manifest.world_size)
        for layer in RESTORE_ORDER
        if (rank, layer) not in present and layer not in accepted
    ]
