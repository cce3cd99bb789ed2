"""An imported, partial manifest: complete without the layers it accepted as missing, and
never recording one of them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from pydantic import ValidationError

from ckpt.core.contract import (
    BlobRef,
    Imported,
    Layer,
    LayerRecord,
    Manifest,
    RankRecord,
    Versions,
    missing_parts,
)

RECORD = LayerRecord(
    payload_bytes=8, header_bytes=8, blobs=(BlobRef(sha256="a" * 64, size=8),), tensors={}
)


def manifest(layers: Sequence[Layer], imported: Imported | None) -> Manifest:
    return Manifest(
        run="r",
        step=4,
        world_size=1,
        created_at="2026-12-05T00:00:00+00:00",
        versions=Versions(ckpt="1", python="3.11", torch="2.13"),
        ranks=(RankRecord(rank=0, layers=dict.fromkeys(layers, RECORD)),),
        imported=imported,
    )


def test_the_accepted_layers_are_not_missing_and_the_others_are() -> None:
    held = [layer for layer in Layer if layer not in (Layer.RNG, Layer.DATA)]
    partial = Imported(format="lightning", source="x.ckpt", missing=(Layer.RNG, Layer.DATA))
    assert partial.partial and missing_parts(manifest(held, partial)) == []
    accepted_one = Imported(format="lightning", source="x.ckpt", missing=(Layer.DATA,))
    assert missing_parts(manifest(held, accepted_one)) == [(0, Layer.RNG)]
    assert missing_parts(manifest(held, None)) == [(0, Layer.RNG), (0, Layer.DATA)]


def test_a_layer_accepted_as_missing_cannot_be_recorded() -> None:
    imported = Imported(format="torch", source="s.pt", missing=(Layer.DATA,))
    with pytest.raises(ValidationError, match=r"imported\.missing names"):
        manifest(list(Layer), imported)
