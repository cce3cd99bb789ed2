"""The read half of a resume: find the resumable bundle, read and verify it, fall back.

Every blob is downloaded in parallel and checked against its SHA-256, straight into the
live weights and optimizer state where they fit. A bundle with a blob that fails is set
aside through the catalog (quarantined; store-only, skipped) and the one before it is
tried, loudly; when every bundle fails, the resume raises rather than start from scratch.
Putting the layers back into the objects, in order, is ``capture.put_back``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ckpt.agent import layers
from ckpt.agent.capture import live_tensors
from ckpt.agent.catalog.base import Catalog
from ckpt.agent.download import read_layer
from ckpt.agent.format import skeleton
from ckpt.agent.manifests import bundle_name, layer_record
from ckpt.agent.objects import TrainingObjects
from ckpt.core.contract import Layer, Manifest
from ckpt.core.errors import CorruptBundleError, IncompatibleBundleError
from ckpt.core.progress import Progress
from ckpt.core.storage import ObjectStore

log = logging.getLogger("ckpt")


@dataclass(frozen=True)
class ResumeResult:
    """What ``resume`` did: ``bundle`` is None on a fresh start."""

    bundle: str | None
    step: int | None
    layers: tuple[Layer, ...]

    @property
    def resumed(self) -> bool:
        return self.bundle is not None


class Restorer:
    """Reads the newest intact bundle of a run for one rank."""

    def __init__(
        self,
        *,
        store: ObjectStore,
        catalog: Catalog,
        objects: TrainingObjects,
        rank: int,
        world_size: int,
    ) -> None:
        self._store, self._catalog, self._objects = store, catalog, objects
        self._rank, self._world_size = rank, world_size

    def read_newest_intact(
        self, run: str, *, own: bool, wanted: tuple[Layer, ...]
    ) -> tuple[Manifest | None, dict[Layer, layers.State]]:
        """The newest resumable bundle whose every blob verifies, read but not restored.

        Raises:
            CorruptBundleError: every resumable bundle failed verification.
            BundleFormatError, IncompatibleBundleError: see ``Checkpointer.resume``.
        """
        manifest = self._catalog.resumable(run, own=own)
        failed: list[CorruptBundleError] = []
        while manifest is not None:
            self._check_compatible(manifest)
            try:
                return manifest, self._read_layers(manifest, wanted)
            except CorruptBundleError as err:
                log.error(
                    "run %s: %s. Quarantining it and falling back to the bundle before it.",
                    run,
                    err,
                )
                failed.append(err)
                manifest = self._catalog.fall_back(
                    run, manifest, own=own, reason=str(err), blob=err.blob
                )
        if failed:
            raise _every_bundle_failed(run, failed)
        return None, {}

    def _read_layers(
        self, manifest: Manifest, wanted: tuple[Layer, ...]
    ) -> dict[Layer, layers.State]:
        total = sum(
            layer_record(manifest, rank=self._rank, layer=layer).payload_bytes for layer in wanted
        )
        progress = Progress(f"ckpt: restoring {bundle_name(manifest)}", total)
        try:
            return {layer: self._read(manifest, layer, progress) for layer in wanted}
        finally:
            progress.close()

    def _read(self, manifest: Manifest, layer: Layer, progress: Progress) -> layers.State:
        skeleton_json, tensors = read_layer(
            self._store,
            manifest,
            rank=self._rank,
            layer=layer,
            into=live_tensors(self._objects, layer),
            progress=progress.advance,
        )
        record = layer_record(manifest, rank=self._rank, layer=layer)
        self._catalog.verified(blob.sha256 for blob in record.blobs)
        state: layers.State = skeleton.decode(skeleton_json, tensors)
        return state

    def _check_compatible(self, manifest: Manifest) -> None:
        if manifest.world_size != self._world_size:
            raise IncompatibleBundleError(
                f"bundle {bundle_name(manifest)} was saved by {manifest.world_size} ranks; "
                f"this job has {self._world_size}"
            )
        if manifest.versions.torch != torch.__version__:
            log.warning(
                "bundle %s was saved with torch %s, this process runs %s: kernels may differ, so "
                "the resumed run may not be bit-exact",
                bundle_name(manifest),
                manifest.versions.torch,
                torch.__version__,
            )


def _every_bundle_failed(run: str, failed: list[CorruptBundleError]) -> CorruptBundleError:
    names = ", ".join(err.bundle for err in failed)
    return CorruptBundleError(
        f"run {run}: every resumable bundle failed verification ({names}); refusing to "
        f"start from scratch. Check the store; to really start over, use a new run name. "
        f"Last failure: {failed[-1]}",
        bundle=failed[-1].bundle,
        blob=failed[-1].blob,
    )
