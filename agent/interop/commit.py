"""An imported checkpoint's layers committed as a bundle: store-only, or through the
control plane, by the same steps as a save (``agent.catalog``).

Store-only, the manifest is written last, as ``StoreCatalog`` does. Through the control
plane the import registers an attempt of the run (which fences any older one: import into
a run whose job is not running), opens the bundle with its ``imported`` record, uploads
the blobs the control plane lacks, records every layer, commits (the control plane checks
every blob in the store and writes the manifest) and ends the attempt.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.catalog.client import ControlPlane
from agent.catalog.manifests import versions, write_manifest
from agent.catalog.store import store_held
from agent.format import skeleton
from agent.interop.found import Found
from agent.save.upload import HeldBlobs, WriteStats, durable_together, upload_layers
from agent.state.capture import LayerState
from ckpt.core.contract import RESTORE_ORDER, BlobRef, Imported, Layer, LayerRecord, Manifest
from ckpt.core.errors import BundleExistsError
from ckpt.core.storage import ObjectStore, keys


def commit_to_store(
    store: ObjectStore, found: Found, *, run: str, blob_bytes: int, imported: Imported
) -> Manifest:
    """Upload every layer found and write the manifest last (never over another bundle).

    Raises:
        BundleExistsError: the run has a bundle at the source's step already.
    """
    if store.size(keys.manifest_key(run, found.step, 0)) is not None:
        raise BundleExistsError(
            f"run {run} has a bundle at step {found.step} already; import into another run"
        )
    records = upload(store, found, blob_bytes=blob_bytes, held=store_held(store, set()))
    return write_manifest(
        store,
        run=run,
        position=(found.step, 0),
        world_size=1,
        ranks={0: records},
        imported=imported,
    )


def commit_through(
    control: ControlPlane,
    store: ObjectStore,
    found: Found,
    *,
    run: str,
    blob_bytes: int,
    imported: Imported,
) -> Manifest:
    """Register an attempt, open, upload, record and commit the bundle, end the attempt.

    Raises:
        ControlPlaneError: the control plane refused a step (its message says why).
        StoreError: the store failed.
    """
    attempt = control.register(run, pod=None, node=None, resume=False)
    reason = "failed"
    try:
        bundle_id = control.open_bundle(
            run,
            attempt=attempt,
            step=found.step,
            micro_step=0,
            world_size=1,
            versions=versions(),
            imported=imported,
        )

        def held(blobs: list[BlobRef]) -> set[str]:
            return {blob.sha256 for blob in blobs} - control.missing_blobs(blobs)

        records = upload(store, found, blob_bytes=blob_bytes, held=held)
        control.record_layers(bundle_id, rank=0, epoch=attempt.epoch, records=records)
        manifest = control.commit(bundle_id, epoch=attempt.epoch)
        reason = "finished"
        return manifest
    finally:
        control.end(
            attempt.attempt_id,
            reason=reason,
            final_save_committed=reason == "finished",
            step=found.step,
        )


def upload(
    store: ObjectStore, found: Found, *, blob_bytes: int, held: HeldBlobs
) -> dict[Layer, LayerRecord]:
    """Every layer found, cut into blobs, hashed and stored unless ``held``."""
    stats = WriteStats()
    states = {
        layer: _state(found.layers[layer], layer)
        for layer in RESTORE_ORDER
        if layer in found.layers
    }
    with durable_together(store):
        return upload_layers(store, states, blob_bytes=blob_bytes, stats=stats, held=held)


def _state(state: Mapping[str, object], layer: Layer) -> LayerState:
    tree, tensors = skeleton.encode(state, root=(str(layer),))
    return LayerState(skeleton=tree, tensors={n: t.contiguous() for n, t in tensors.items()})
