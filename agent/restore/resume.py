"""The read half of a resume: find the resumable bundle, read and verify it, fall back.

Every blob is downloaded in parallel and checked against its SHA-256, straight into the
live weights and optimizer state where they fit. A bundle with a blob that fails is set
aside through the catalog (quarantined; store-only, skipped) and the one before it is
tried, loudly; when every bundle fails, the resume raises rather than start from scratch.
``restore`` then puts the layers back into the objects, in order (``state.capture``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from agent.catalog.base import Catalog
from agent.catalog.manifests import bundle_name, layer_record
from agent.config import Config
from agent.data.sources import reshardable
from agent.format import skeleton
from agent.ranks.base import MEET_SECONDS, Ranks
from agent.restore.download import read_layer
from agent.state import layers
from agent.state.capture import live_tensors, put_back
from agent.state.objects import TrainingObjects
from agent.state.sharded import merge
from agent.summary import announce
from ckpt.core.contract import RESTORE_ORDER, Layer, Manifest
from ckpt.core.errors import CkptError, CorruptBundleError, IncompatibleBundleError, RankError
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


@dataclass(frozen=True)
class _Failure:
    """What went wrong reading a bundle on one rank, as the ranks tell each other."""

    message: str
    bundle: str
    blob: str
    corrupt: bool  # a blob failed its check (fall back); else a failure that ends the resume


class Restorer:
    """Reads the newest bundle of a run that is intact for every rank."""

    def __init__(
        self, *, store: ObjectStore, catalog: Catalog, objects: TrainingObjects, ranks: Ranks
    ) -> None:
        self._store, self._catalog, self._objects = store, catalog, objects
        self._ranks = ranks

    def restore(
        self,
        config: Config,
        *,
        layers: Iterable[Layer | str],
        from_run: str | None,
        from_step: int | None,
    ) -> tuple[ResumeResult, bool]:
        """Read the bundle a resume starts from (``read_start``) and put its ``layers`` back
        into the objects, in the fixed order; also whether it is the run's own bundle.

        Raises:
            See ``Checkpointer.resume``.
        """
        chosen = {Layer(layer) for layer in layers}
        wanted = tuple(layer for layer in RESTORE_ORDER if layer in chosen)
        source, manifest, states = self.read_start(
            config, from_run=from_run, from_step=from_step, wanted=wanted
        )
        if manifest is None:
            announce(
                f"ckpt: run {source}: no resumable bundle in {self._store.url}; starting fresh",
                quiet=config.quiet,
            )
            return ResumeResult(bundle=None, step=None, layers=()), False
        restored = _present(manifest, wanted)
        put_back(self._objects, states, bundle=bundle_name(manifest))
        result = ResumeResult(bundle=bundle_name(manifest), step=manifest.step, layers=restored)
        return result, source == config.run

    def read_start(
        self,
        config: Config,
        *,
        from_run: str | None,
        from_step: int | None,
        wanted: tuple[Layer, ...],
    ) -> tuple[str, Manifest | None, dict[Layer, layers.State]]:
        """Where a resume starts, read: the run it reads from, the bundle and its layers.

        ``from_run`` (and ``from_step``) name it; else this run's own newest bundle, or,
        while this run has none, the bundle ``config.from_run`` / ``config.from_step``
        name (a new run started from another run's bundle).
        """
        if from_step is not None and from_run in (None, config.run):
            raise ValueError(
                "from_step names a bundle of another run (from_run=...); to go back in this "
                "run, roll it back (POST /v1/runs/{run}/rollback) and resume"
            )
        if from_run is None:
            manifest, states = self.read_newest_intact(config.run, own=True, wanted=wanted)
            if manifest is not None or config.from_run is None:
                return config.run, manifest, states
            from_run, from_step = config.from_run, config.from_step
        own = from_run == config.run
        manifest, states = self.read_newest_intact(from_run, own=own, wanted=wanted, step=from_step)
        if manifest is None and from_step is not None:
            raise ValueError(
                f"run {from_run} has no resumable bundle at step {from_step} "
                "(see its lineage: ckpt bundle, or the dashboard)"
            )
        return from_run, manifest, states

    def read_newest_intact(
        self, run: str, *, own: bool, wanted: tuple[Layer, ...], step: int | None = None
    ) -> tuple[Manifest | None, dict[Layer, layers.State]]:
        """The newest resumable bundle whose every blob verifies, read but not restored;
        with ``step``, that step's bundle of (another) ``run`` or none.

        Every rank reads its own layers; when a blob fails on any rank, all ranks set the
        bundle aside together and try the one before it (not with ``step``).

        Raises:
            CorruptBundleError: every resumable bundle failed verification.
            BundleFormatError, IncompatibleBundleError, StoreError: see ``Checkpointer.resume``.
            RankError: another rank failed with one of those.
        """
        manifest = self._catalog.resumable(run, own=own, step=step)
        failed: list[_Failure] = []
        while manifest is not None:
            self._check_compatible(manifest)
            states, failure = self._try_read(manifest, wanted)
            failures = [f for f in self._ranks.gather(failure, timeout=MEET_SECONDS) if f]
            if not failures:
                return manifest, states
            first = failures[0]
            if not first.corrupt:
                raise RankError(f"another rank could not read {first.bundle}: {first.message}")
            log.error(
                "run %s: %s. Quarantining it and falling back to the bundle before it.",
                run,
                first.message,
            )
            failed.append(first)
            before = self._catalog.fall_back(
                run, manifest, own=own, reason=first.message, blob=first.blob
            )
            manifest = before if step is None else None
        if failed:
            raise _every_bundle_failed(run, failed)
        return None, {}

    def _try_read(
        self, manifest: Manifest, wanted: tuple[Layer, ...]
    ) -> tuple[dict[Layer, layers.State], _Failure | None]:
        """This rank's layers, or what failed. A failure other than a corrupt blob is
        raised here once the other ranks know of it."""
        try:
            return self._read_layers(manifest, wanted), None
        except CorruptBundleError as err:
            return {}, _Failure(str(err), err.bundle, err.blob, corrupt=True)
        except CkptError as err:
            self._ranks.gather(
                _Failure(str(err), bundle_name(manifest), "", corrupt=False), timeout=MEET_SECONDS
            )
            raise

    def _read_layers(
        self, manifest: Manifest, wanted: tuple[Layer, ...]
    ) -> dict[Layer, layers.State]:
        """This rank's layers; saved by another world size, every saved rank's blocks of the
        sharded layers, merged (``sharded.merge``), and one saved rank's other layers."""
        missing = _accepted_missing(manifest)
        sources = self._sources(manifest, tuple(lay for lay in wanted if lay not in missing))
        total = sum(
            layer_record(manifest, rank=rank, layer=layer).payload_bytes
            for layer, ranks in sources.items()
            for rank in ranks
        )
        progress = Progress(f"ckpt: restoring {bundle_name(manifest)}", total)
        try:
            return {
                layer: merge(
                    [self._read(manifest, layer, progress, rank=r) for r in ranks], source=0
                )
                if len(ranks) > 1
                else self._read(manifest, layer, progress, rank=ranks[0])
                for layer, ranks in sources.items()
            }
        finally:
            progress.close()

    def _sources(self, manifest: Manifest, wanted: tuple[Layer, ...]) -> dict[Layer, list[int]]:
        """The saved ranks each layer is read from: this rank's own at the same world size;
        at another, rank ``r mod saved world size`` first (its values are taken where a
        tensor is not sharded), then every other saved rank for the sharded layers."""
        if manifest.world_size == self._ranks.world_size:
            return {layer: [self._ranks.rank] for layer in wanted}
        source = self._ranks.rank % manifest.world_size
        everyone = [source, *(r for r in range(manifest.world_size) if r != source)]
        return {
            layer: everyone if layer in (Layer.WEIGHTS, Layer.OPTIMIZER) else [source]
            for layer in wanted
        }

    def _read(
        self, manifest: Manifest, layer: Layer, progress: Progress, *, rank: int
    ) -> layers.State:
        own = manifest.world_size == self._ranks.world_size
        skeleton_json, tensors = read_layer(
            self._store,
            manifest,
            rank=rank,
            layer=layer,
            into=live_tensors(self._objects, layer) if own else {},
            progress=progress.advance,
        )
        record = layer_record(manifest, rank=rank, layer=layer)
        self._catalog.verified(blob.sha256 for blob in record.blobs)
        state: layers.State = skeleton.decode(skeleton_json, tensors)
        return state

    def _check_compatible(self, manifest: Manifest) -> None:
        if manifest.world_size != self._ranks.world_size and not reshardable(self._objects.data):
            raise IncompatibleBundleError(
                f"bundle {bundle_name(manifest)} was saved by {manifest.world_size} ranks and "
                f"this job has {self._ranks.world_size}: its data position cannot be carried "
                "over to another world size with this data pipeline. Resume with "
                f"{manifest.world_size} ranks, shard the data with ResumableSampler(..., "
                "num_replicas=, rank=), or resume the other layers only: resume(layers=[...])"
            )
        if manifest.world_size != self._ranks.world_size:
            log.warning(
                "bundle %s was saved by %d ranks, this job has %d: resharding. The sharded "
                "weights and optimizer state are exact; each rank takes the rest (random "
                "streams, data position, unsharded tensors) from saved rank (rank mod %d), so "
                "the run continues, but not bit-exactly",
                bundle_name(manifest),
                manifest.world_size,
                self._ranks.world_size,
                manifest.world_size,
            )
        if manifest.versions.torch != torch.__version__:
            log.warning(
                "bundle %s was saved with torch %s, this process runs %s: kernels may differ, so "
                "the resumed run may not be bit-exact",
                bundle_name(manifest),
                manifest.versions.torch,
                torch.__version__,
            )


def _present(manifest: Manifest, wanted: tuple[Layer, ...]) -> tuple[Layer, ...]:
    """The ``wanted`` layers the bundle holds: an imported, partial bundle lacks some (the
    objects keep their own state for those, and a warning names them)."""
    missing = _accepted_missing(manifest)
    skipped = [str(layer) for layer in wanted if layer in missing]
    if skipped:
        log.warning(
            "bundle %s is imported, partial: it has no %s layer; those keep this process's "
            "own state, so the resume is not bit-exact",
            bundle_name(manifest),
            ", ".join(skipped),
        )
    return tuple(layer for layer in wanted if layer not in missing)


def _accepted_missing(manifest: Manifest) -> tuple[Layer, ...]:
    return manifest.imported.missing if manifest.imported is not None else ()


def _every_bundle_failed(run: str, failed: list[_Failure]) -> CorruptBundleError:
    names = ", ".join(failure.bundle for failure in failed)
    return CorruptBundleError(
        f"run {run}: every resumable bundle failed verification ({names}); refusing to "
        f"start from scratch. Check the store; to really start over, use a new run name. "
        f"Last failure: {failed[-1].message}",
        bundle=failed[-1].bundle,
        blob=failed[-1].blob,
    )
