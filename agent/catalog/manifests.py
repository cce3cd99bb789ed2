"""Manifests, the commit records of bundles: naming, writing, finding the newest, reading.

A bundle exists only once its manifest does; store-only, the agent writes it last
(``write_manifest``), and with a control plane the control plane does at commit.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Mapping
from datetime import UTC, datetime

import torch
from pydantic import ValidationError

from ckpt.core.contract import (
    Imported,
    Layer,
    LayerRecord,
    Manifest,
    RankRecord,
    Versions,
    missing_parts,
)
from ckpt.core.errors import BundleFormatError
from ckpt.core.storage import ObjectStore, keys
from ckpt.core.version import __version__

log = logging.getLogger("ckpt")


def versions() -> Versions:
    """The versions that made a bundle: a resume under others may not be bit-exact."""
    return Versions(ckpt=__version__, python=platform.python_version(), torch=torch.__version__)


def write_manifest(
    store: ObjectStore,
    *,
    run: str,
    position: tuple[int, int],
    world_size: int,
    ranks: Mapping[int, Mapping[Layer, LayerRecord]],
    imported: Imported | None = None,
) -> Manifest:
    """Write the manifest, last: from now on the bundle is resumable (``imported``: made by
    ``ckpt import``, lacking the layers it names)."""
    step, micro_step = position
    manifest = Manifest(
        run=run,
        step=step,
        micro_step=micro_step,
        world_size=world_size,
        created_at=datetime.now(UTC).isoformat(),
        versions=versions(),
        ranks=tuple(
            RankRecord(rank=rank, layers=dict(layers)) for rank, layers in sorted(ranks.items())
        ),
        imported=imported,
    )
    missing = missing_parts(manifest)
    assert not missing, f"refusing to commit an incomplete bundle: {missing}"
    store.put(
        keys.manifest_key(run, step, micro_step), [manifest.model_dump_json(indent=1).encode()]
    )
    return manifest


def bundle_name(manifest: Manifest) -> str:
    return bundle_name_at(manifest.run, manifest.position)


def bundle_name_at(run: str, position: tuple[int, int]) -> str:
    return keys.bundle_key(run, *position)


def load_manifest(store: ObjectStore, key: str) -> Manifest:
    """Parse and validate one manifest.

    Raises:
        BundleFormatError: the manifest is not valid JSON of a known format.
    """
    try:
        return Manifest.model_validate_json(store.get(key))
    except ValidationError as err:
        raise BundleFormatError(f"{key}: not a valid ckpt manifest: {err}") from err


def latest_manifest(
    store: ObjectStore, run: str, *, below: tuple[int, int] | None = None
) -> Manifest | None:
    """The newest bundle of ``run`` (before position ``below``: (step, micro step)) whose
    manifest is valid and complete, or None.

    Blobs without a manifest (an interrupted save) are not bundles and are ignored; a
    manifest that fails validation is skipped with a warning.
    """
    found = {key: keys.manifest_position(key) for key in store.list_keys(keys.bundles_prefix(run))}
    manifests = {
        key: position
        for key, position in found.items()
        if position is not None and (below is None or position < below)
    }
    for key in sorted(manifests, key=manifests.__getitem__, reverse=True):
        manifest = usable_manifest(store, run, key)
        if manifest is not None:
            return manifest
    return None


def usable_manifest(store: ObjectStore, run: str, key: str) -> Manifest | None:
    """The manifest at ``key`` if it is a valid, complete manifest of ``run``; else None,
    with a warning (a resume skips it, and a save at its position replaces it)."""
    try:
        manifest = load_manifest(store, key)
    except BundleFormatError as err:
        log.warning("skipping unreadable bundle: %s", err)
        return None
    if manifest.run != run or missing_parts(manifest):
        log.warning("skipping %s: it is incomplete or belongs to another run", key)
        return None
    return manifest


def layer_record(manifest: Manifest, *, rank: int, layer: Layer) -> LayerRecord:
    """What the manifest records for one rank's layer."""
    return next(r for r in manifest.ranks if r.rank == rank).layers[layer]
