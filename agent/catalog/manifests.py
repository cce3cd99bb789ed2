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

from ckpt.core.contract import Layer, LayerRecord, Manifest, RankRecord, Versions, missing_parts
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
    step: int,
    world_size: int,
    ranks: Mapping[int, Mapping[Layer, LayerRecord]],
) -> Manifest:
    """Write the manifest, last: from now on the bundle is resumable."""
    manifest = Manifest(
        run=run,
        step=step,
        world_size=world_size,
        created_at=datetime.now(UTC).isoformat(),
        versions=versions(),
        ranks=tuple(
            RankRecord(rank=rank, layers=dict(layers)) for rank, layers in sorted(ranks.items())
        ),
    )
    missing = missing_parts(manifest)
    assert not missing, f"refusing to commit an incomplete bundle: {missing}"
    store.put(keys.manifest_key(run, step), [manifest.model_dump_json(indent=1).encode()])
    return manifest


def bundle_name(manifest: Manifest) -> str:
    return bundle_name_at(manifest.run, manifest.step)


def bundle_name_at(run: str, step: int) -> str:
    return keys.manifest_key(run, step).removesuffix("/manifest.json")


def load_manifest(store: ObjectStore, key: str) -> Manifest:
    """Parse and validate one manifest.

    Raises:
        BundleFormatError: the manifest is not valid JSON of a known format.
    """
    try:
        return Manifest.model_validate_json(store.get(key))
    except ValidationError as err:
        raise BundleFormatError(f"{key}: not a valid ckpt manifest: {err}") from err


def latest_manifest(store: ObjectStore, run: str, *, below: int | None = None) -> Manifest | None:
    """The newest bundle of ``run`` (below step ``below``) whose manifest is valid and
    complete, or None.

    Blobs without a manifest (an interrupted save) are not bundles and are ignored; a
    manifest that fails validation is skipped with a warning.
    """
    steps = {key: keys.manifest_step(key) for key in store.list_keys(keys.bundles_prefix(run))}
    manifests = {
        key: step
        for key, step in steps.items()
        if step is not None and (below is None or step < below)
    }
    for key in sorted(manifests, key=manifests.__getitem__, reverse=True):
        try:
            manifest = load_manifest(store, key)
        except BundleFormatError as err:
            log.warning("skipping unreadable bundle: %s", err)
            continue
        if manifest.run != run or missing_parts(manifest):
            log.warning("skipping %s: it is incomplete or belongs to another run", key)
            continue
        return manifest
    return None


def layer_record(manifest: Manifest, *, rank: int, layer: Layer) -> LayerRecord:
    """What the manifest records for one rank's layer."""
    return next(r for r in manifest.ranks if r.rank == rank).layers[layer]
