"""A rank's layers in the catalog, looked up and recorded together: a record of six layers
runs as many statements as a record of one."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.bundles.repository import BATCH
from service.models import Layer, LayerBlob, utcnow
from service.sql import insert


def get_layers(
    session: Session, *, bundle_id: int, rank: int, layers: Collection[str]
) -> dict[str, Layer]:
    """The rank's ``layers`` of the bundle that are recorded, by name; one statement."""
    rows = session.scalars(
        select(Layer).where(
            Layer.bundle_id == bundle_id, Layer.rank == rank, Layer.layer.in_(sorted(layers))
        )
    )
    return {row.layer: row for row in rows}


@dataclass(frozen=True)
class NewLayer:
    """A layer to record: its payload's size, its record as JSON, its blobs in order."""

    payload_bytes: int
    record: dict[str, object]
    blobs: list[str]


def insert_layers(
    session: Session, *, bundle_id: int, rank: int, layers: dict[str, NewLayer]
) -> set[str]:
    """Insert the rank's ``layers`` that are not recorded, and their blob references: one
    statement for the layers, one for every thousand references. Returns the names of those
    inserted (one that another transaction recorded meanwhile is not)."""
    if not layers:
        return set()
    now = utcnow()
    rows = [
        {
            "bundle_id": bundle_id,
            "rank": rank,
            "layer": name,
            "payload_bytes": new.payload_bytes,
            "record": new.record,
            "recorded_at": now,
        }
        for name, new in layers.items()
    ]
    result = session.execute(
        insert(session, Layer)
        .values(rows)
        .on_conflict_do_nothing(index_elements=["bundle_id", "rank", "layer"])
        .returning(Layer.id, Layer.layer)
    )
    ids = {name: layer_id for layer_id, name in result}
    references = [
        {"layer_id": layer_id, "seq": i, "blob_sha256": sha}
        for name, layer_id in ids.items()
        for i, sha in enumerate(layers[name].blobs)
    ]
    for start in range(0, len(references), BATCH):
        statement = insert(session, LayerBlob)
        session.execute(statement.values(references[start : start + BATCH]))
    return set(ids)


def insert_layer(session: Session, *, bundle_id: int, rank: int, layer: str, new: NewLayer) -> bool:
    """``insert_layers`` of one layer: whether it was inserted."""
    return bool(insert_layers(session, bundle_id=bundle_id, rank=rank, layers={layer: new}))
