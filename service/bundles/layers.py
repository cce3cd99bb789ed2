"""A rank's layers in the catalog, looked up and recorded together: a record of six layers
runs as many statements as a record of one."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import bindparam, select, text
from sqlalchemy.orm import Session

from service.bundles.repository import BATCH
from service.models import Layer, LayerBlob, UTCDateTime, utcnow
from service.sql import insert, plain_words


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
    statement for the layers, one for the references (on SQLite, one for every thousand).
    Returns the names of those inserted (one that another transaction recorded meanwhile
    is not)."""
    if not layers:
        return set()
    now = utcnow()
    if session.get_bind().dialect.name == "postgresql":
        return _insert_as_arrays(session, bundle_id=bundle_id, rank=rank, layers=layers, now=now)
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


def _insert_as_arrays(
    session: Session, *, bundle_id: int, rank: int, layers: dict[str, NewLayer], now: datetime
) -> set[str]:
    """``insert_layers`` on PostgreSQL: two statements, each compiled once."""
    rows = [
        {"layer": name, "payload_bytes": new.payload_bytes, "record": new.record}
        for name, new in layers.items()
    ]
    inserted = session.execute(
        _NEW_LAYERS, {"bundle_id": bundle_id, "rank": rank, "rows": json.dumps(rows), "now": now}
    )
    ids = {name: layer_id for layer_id, name in inserted}
    references = [
        (layer_id, i, sha)
        for name, layer_id in ids.items()
        for i, sha in enumerate(layers[name].blobs)
    ]
    if references:
        layer_ids, seqs, shas = zip(*references, strict=True)
        session.execute(
            _REFERENCES, {"ids": list(layer_ids), "seqs": list(seqs), "shas": plain_words(shas)}
        )
    return set(ids)


# PostgreSQL: the rows as one JSON text or as arrays, one statement however many, compiled
# once (a multi-row VALUES is built and bound row by row, which cost a record of six layers
# most of its CPU).
_NEW_LAYERS = text(
    """
    INSERT INTO layer (bundle_id, rank, layer, payload_bytes, record, recorded_at)
    SELECT :bundle_id, :rank, new.layer, new.payload_bytes, new.record, :now
    FROM json_to_recordset(CAST(:rows AS json)) AS new(layer text, payload_bytes bigint, record json)
    ON CONFLICT (bundle_id, rank, layer) DO NOTHING
    RETURNING id, layer
    """
).bindparams(bindparam("now", type_=UTCDateTime()))
_REFERENCES = text(
    """
    INSERT INTO layer_blob (layer_id, seq, blob_sha256)
    SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:seqs AS int[]), CAST(:shas AS varchar[]))
    """
)


def insert_layer(session: Session, *, bundle_id: int, rank: int, layer: str, new: NewLayer) -> bool:
    """``insert_layers`` of one layer: whether it was inserted."""
    return bool(insert_layers(session, bundle_id=bundle_id, rank=rank, layers={layer: new}))
