"""The Checkpointer: the training loop's one handle on ckpt."""

from __future__ import annotations

import logging
import os
import platform
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from agent import layers
from agent.bundle import (
    HeldBlobs,
    LayerState,
    WriteStats,
    bundle_name,
    commit_bundle,
    latest_manifest,
    layer_record,
    read_layer,
    store_held,
    upload_layer,
)
from agent.client import ControlPlane, IncompleteCommitError, Registration, default_token
from agent.config import Config
from agent.counters import Counters
from agent.data import Resumed, data_source
from agent.errors import (
    BundleExistsError,
    CkptError,
    CorruptBundleError,
    IncompatibleBundleError,
)
from agent.format import skeleton
from agent.layers import TrainingObjects
from agent.policy import Position, SavePolicy
from agent.stateful import Stateful
from agent.storage import ObjectStore, open_store
from agent.storage.keys import manifest_key
from service import __version__
from service.contract import RESTORE_ORDER, BlobRef, Layer, LayerRecord, Manifest, Versions

log = logging.getLogger("ckpt")

T = TypeVar("T")

_CAPTURE: dict[Layer, Callable[[TrainingObjects], layers.State]] = {
    Layer.WEIGHTS: layers.capture_weights,
    Layer.OPTIMIZER: layers.capture_optimizer,
    Layer.SCHEDULER: layers.capture_scheduler,
    Layer.RNG: layers.capture_rng,
    Layer.DATA: layers.capture_data,
    Layer.COUNTERS: layers.capture_counters,
}
_RESTORE: dict[Layer, Callable[[TrainingObjects, layers.State], None]] = {
    Layer.WEIGHTS: layers.restore_weights,
    Layer.OPTIMIZER: layers.restore_optimizer,
    Layer.SCHEDULER: layers.restore_scheduler,
    Layer.RNG: layers.restore_rng,
    Layer.DATA: layers.restore_data,
    Layer.COUNTERS: layers.restore_counters,
}
# Capturing other objects' state can consume randomness, so the rng layer goes first.
_CAPTURE_ORDER = (Layer.RNG, *(layer for layer in RESTORE_ORDER if layer is not Layer.RNG))


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
class SaveResult:
    """What one ``save`` wrote."""

    bundle: str
    step: int
    payload_bytes: int
    new_bytes: int
    seconds: float


def _named(objects: T | Iterable[T] | Mapping[str, T] | None, kind: type[Any]) -> dict[str, T]:
    """``{name: object}`` from one object (named "0"), a list (named by position) or a dict."""
    if objects is None:
        return {}
    if isinstance(objects, Mapping):
        return {str(name): value for name, value in objects.items()}
    if isinstance(objects, kind) or not isinstance(objects, Iterable):
        return {"0": objects}
    return {str(i): value for i, value in enumerate(objects)}


class Checkpointer:
    """Captures all six layers of a training run and resumes it bit-exactly.

    Configure by keyword or by ``CKPT_*`` environment variable (see ``agent.config.Config``);
    a keyword wins. Objects may be given singly, as a list, or as a ``{name: object}`` dict;
    names must stay the same across restarts.

    Args:
        run: the run's name (``CKPT_RUN``); every attempt of the run uses the same one.
        models: the model(s): parameters and buffers, plus ``.grad`` mid-accumulation.
        optimizers: optimizer(s); parameters they own that no model has (fp32 master
            copies) are saved with the weights.
        schedulers: LR scheduler(s), or anything with ``state_dict``/``load_state_dict``.
        data: what the loop iterates: a ``DataLoader`` with ``ResumableSampler``, a torchdata
            ``StatefulDataLoader``, or any stateful object.
        scaler: an AMP ``GradScaler``.
        extras: other stateful objects (an EMA...), saved with the weights.
        generators: ``torch.Generator``, ``numpy.random.Generator`` or ``RandomState``
            objects to capture with the global RNGs.
        store, server, token, every_steps, every_seconds, blob_bytes: see ``Config``.

    Raises:
        ValueError: bad configuration or a data pipeline that cannot resume, saying what to change.
    """

    def __init__(
        self,
        *,
        run: str | None = None,
        models: nn.Module | Iterable[nn.Module] | Mapping[str, nn.Module],
        optimizers: torch.optim.Optimizer
        | Iterable[torch.optim.Optimizer]
        | Mapping[str, torch.optim.Optimizer]
        | None = None,
        schedulers: Stateful | Iterable[Stateful] | Mapping[str, Stateful] | None = None,
        data: object | None = None,
        scaler: Stateful | None = None,
        extras: Mapping[str, Stateful] | None = None,
        generators: Mapping[str, layers.Generator] | None = None,
        store: str | ObjectStore | None = None,
        server: str | None = None,
        token: str | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        blob_bytes: int | None = None,
    ) -> None:
        store_url = store if isinstance(store, str) or store is None else store.url
        self.config = Config.resolve(
            {
                "run": run,
                "store": store_url,
                "server": server,
                "token": token,
                "every_steps": every_steps,
                "every_seconds": every_seconds,
                "blob_bytes": blob_bytes,
            }
        )
        self.store: ObjectStore = (
            store
            if store is not None and not isinstance(store, str)
            else open_store(self.config.store)
        )
        self.policy = SavePolicy(
            every_steps=self.config.every_steps, every_seconds=self.config.every_seconds
        )
        self.objects = TrainingObjects(
            models=_named(models, nn.Module),
            optimizers=_named(optimizers, torch.optim.Optimizer),
            schedulers=_named(schedulers, Stateful),
            scaler=scaler,
            data=data_source(data) if data is not None else None,
            extras=dict(extras or {}),
            generators=dict(generators or {}),
        )
        if not self.objects.models:
            raise ValueError("pass at least one model: Checkpointer(models=model, ...)")
        for name, generator in self.objects.generators.items():
            if not isinstance(generator, layers.GENERATOR_TYPES):
                raise ValueError(
                    f"generators[{name!r}] is a {type(generator).__name__}; pass torch.Generator, "
                    "numpy.random.Generator or numpy.random.RandomState objects"
                )
        self.rank = 0
        self.world_size = 1
        self._last_saved: Position | None = None
        self._last_save_time = time.monotonic()
        self._resumed: Resumed | None = None
        self._epoch_batches: Iterator[Any] | None = None  # the live iterator of this epoch
        self._own_steps: set[int] = set()  # steps of bundles this process resumed or wrote
        self._verified: set[str] = set()  # blobs known to be intact in the store
        self.control = (
            ControlPlane(self.config.server, token=self.config.token or default_token())
            if self.config.server
            else None
        )
        self._attempt: Registration | None = None  # this process's attempt, once registered
        self._committed: dict[int, Manifest] = {}  # this attempt's bundles, by step

    @property
    def counters(self) -> Counters:
        """The live counters; the loop reads and advances them."""
        return self.objects.counters

    def _position(self) -> Position:
        return Position(step=self.counters.step, micro_step=self.counters.micro_step)

    def resume(
        self, *, layers: Iterable[Layer | str] = RESTORE_ORDER, from_run: str | None = None
    ) -> ResumeResult:
        """Restore the latest resumable bundle of the run, or report a fresh start.

        Layers are restored in the fixed order weights, optimizer, scheduler, rng, data,
        counters. Restoring only some is a warm start, not a bit-exact resume: do it from
        another run (``from_run="base", layers=["weights"]``), since with the counters back at
        zero, saves would collide with this run's own bundles (and are refused).

        Args:
            layers: the layers to restore; all six by default.
            from_run: read the latest bundle of this run instead of the checkpointer's own.

        Returns:
            Which bundle was restored (``bundle=None`` when there was none).

        Raises:
            CorruptBundleError: every resumable bundle has a blob that does not match its
                manifest (one that fails is quarantined and the one before it is used).
                Every layer is read and verified before any is restored, so the objects
                are left untouched.
            BundleFormatError: the bundle is malformed (objects untouched, as above).
            IncompatibleBundleError: the bundle does not fit these objects. The layers before
                the one that failed are already restored: rebuild the objects before training.
        """
        wanted = {Layer(layer) for layer in layers}
        source_run = from_run or self.config.run
        restored = tuple(layer for layer in RESTORE_ORDER if layer in wanted)
        manifest, states = self._read_newest_intact(
            source_run, own=source_run == self.config.run, wanted=restored
        )
        if manifest is None:
            log.info(
                "run %s: no resumable bundle in %s; starting fresh", source_run, self.store.url
            )
            return ResumeResult(bundle=None, step=None, layers=())
        name = bundle_name(manifest)
        if Layer.WEIGHTS in states and Layer.COUNTERS not in states:
            states[Layer.WEIGHTS]["grads"] = None  # partial sums belong to the old micro step
        for layer in restored:
            try:
                _RESTORE[layer](self.objects, states.pop(layer))
            except CkptError:
                raise
            except (ValueError, RuntimeError, KeyError, TypeError, IndexError) as err:
                raise IncompatibleBundleError(
                    f"bundle {name}: its {layer} layer does not fit these objects ({err}); "
                    f"the layers before it are already restored, so rebuild the objects "
                    "before training"
                ) from err
        self._last_saved = self._position()
        self._last_save_time = time.monotonic()
        self._resumed = Resumed(epoch=self.counters.epoch, batch=self.counters.batch)
        self._epoch_batches = None
        if source_run == self.config.run:
            self._own_steps.add(manifest.step)
        log.info(
            "run %s: resumed from %s (step %d, layers %s)",
            self.config.run,
            name,
            manifest.step,
            [str(x) for x in restored],
        )
        return ResumeResult(bundle=name, step=manifest.step, layers=restored)

    def _read_newest_intact(
        self, run: str, *, own: bool, wanted: tuple[Layer, ...]
    ) -> tuple[Manifest | None, dict[Layer, layers.State]]:
        """The newest resumable bundle whose every blob verifies, read but not restored.

        A bundle that fails verification is quarantined in the catalog (store-only: skipped)
        and the one before it is tried, loudly. When every bundle fails, this raises rather
        than start the run from scratch.
        """
        manifest = self._find_resumable(run, own=own)
        failed: list[CorruptBundleError] = []
        while manifest is not None:
            self._check_compatible(manifest)
            try:
                return manifest, {layer: self._read(manifest, layer) for layer in wanted}
            except CorruptBundleError as err:
                log.error(
                    "run %s: %s. Quarantining it and falling back to the bundle before it.",
                    run,
                    err,
                )
                failed.append(err)
                manifest = self._fall_back(run, manifest, own=own, reason=str(err))
        if failed:
            names = ", ".join(err.bundle for err in failed)
            raise CorruptBundleError(
                f"run {run}: every resumable bundle failed verification ({names}); refusing to "
                f"start from scratch. Check the store; to really start over, use a new run name. "
                f"Last failure: {failed[-1]}",
                bundle=failed[-1].bundle,
                blob=failed[-1].blob,
            )
        return None, {}

    def _fall_back(
        self, run: str, manifest: Manifest, *, own: bool, reason: str
    ) -> Manifest | None:
        """The resumable bundle once ``manifest``'s is set aside."""
        if self.control is None:
            if own:  # the rotten bundle's step is saved again, replacing it
                self._own_steps.add(manifest.step)
            return latest_manifest(self.store, run, below=manifest.step)
        if manifest.catalog is not None:
            self.control.quarantine(manifest.catalog.bundle_id, reason=reason)
        if own:  # register again: the new attempt resumes from (and records) the fallback
            self._attempt = self._register(resume=True)
            return self._attempt.resume_from
        return self.control.resumable(run)

    def _find_resumable(self, run: str, *, own: bool) -> Manifest | None:
        """Store-only: the newest valid manifest. With a control plane: register this attempt
        (fencing every older one) and take the bundle the service says to resume from."""
        if self.control is None:
            return latest_manifest(self.store, run)
        self._attempt = self._register(resume=own)
        return self._attempt.resume_from if own else self.control.resumable(run)

    def _register(self, *, resume: bool) -> Registration:
        assert self.control is not None
        attempt = self.control.register(
            self.config.run,
            pod=os.environ.get("CKPT_POD") or socket.gethostname(),
            node=os.environ.get("CKPT_NODE"),
            resume=resume,
        )
        log.info(
            "run %s: registered attempt %d (epoch %d) with %s",
            self.config.run,
            attempt.attempt_id,
            attempt.epoch,
            self.control.url,
        )
        return attempt

    def _read(self, manifest: Manifest, layer: Layer) -> layers.State:
        skeleton_json, tensors = read_layer(self.store, manifest, rank=self.rank, layer=layer)
        record = layer_record(manifest, rank=self.rank, layer=layer)
        self._verified.update(blob.sha256 for blob in record.blobs)
        state: layers.State = skeleton.decode(skeleton_json, tensors)
        return state

    def _check_compatible(self, manifest: Manifest) -> None:
        if manifest.world_size != self.world_size:
            raise IncompatibleBundleError(
                f"bundle {bundle_name(manifest)} was saved by {manifest.world_size} ranks; "
                f"this job has {self.world_size}"
            )
        if manifest.versions.torch != torch.__version__:
            log.warning(
                "bundle %s was saved with torch %s, this process runs %s: kernels may differ, so "
                "the resumed run may not be bit-exact",
                bundle_name(manifest),
                manifest.versions.torch,
                torch.__version__,
            )

    def batches(self) -> Iterator[Any]:
        """Iterate the rest of the current epoch of ``data``, then advance the epoch.

        Starts where the run stopped (the restored position), counts each batch handed
        out as consumed, and leaves the random streams exactly as the uninterrupted run
        would. Breaking out and calling it again continues the same epoch with the same
        iterator. Call ``maybe_save`` at the end of the loop body, after the batch is used.
        """
        source = self.objects.data
        if source is None:
            raise ValueError("batches() needs data=: pass the loader to the Checkpointer")
        counters = self.counters
        if self._epoch_batches is None:
            source.begin_epoch(counters.epoch)
            resumed, self._resumed = self._resumed, None
            self._epoch_batches = source.batches(resumed=resumed)
        for batch in self._epoch_batches:
            counters.batch += 1
            source.consumed()
            yield batch
        self._epoch_batches = None
        counters.epoch += 1
        counters.batch = 0

    def maybe_save(self) -> SaveResult | None:
        """Save if the policy says so at the current position; call once per micro-batch."""
        seconds = time.monotonic() - self._last_save_time
        if not self.policy.due(self._position(), last=self._last_saved, seconds_since_last=seconds):
            return None
        return self.save()

    def save(self) -> SaveResult:
        """Write a bundle of the current state now and return when it is durable.

        Raises:
            UnrepresentableStateError: a state value has no safe representation (names its key path).
            StoreError: the store failed; no manifest was written, so no bundle exists.
            FencedError: a newer attempt of the run registered; this process must stop.
            ControlPlaneError: the control plane refused the bundle (its message says why)
                or stayed unreachable through the retries.
        """
        started = time.perf_counter()
        step = self.counters.step
        if self.control is None:
            self._check_not_replacing(step)
        states = self._capture()
        stats = WriteStats()
        manifest = (
            self._persist_store_only(states, stats, step=step)
            if self.control is None
            else self._persist_with_control_plane(states, stats, step=step)
        )
        self._own_steps.add(manifest.step)
        self._last_saved = self._position()
        self._last_save_time = time.monotonic()
        result = SaveResult(
            bundle=bundle_name(manifest),
            step=manifest.step,
            payload_bytes=stats.payload_bytes,
            new_bytes=stats.new_bytes,
            seconds=time.perf_counter() - started,
        )
        log.info(
            "run %s: saved %s (%d bytes, %d new) in %.3f s",
            self.config.run,
            result.bundle,
            result.payload_bytes,
            result.new_bytes,
            result.seconds,
        )
        return result

    def _upload(
        self, states: Mapping[Layer, LayerState], stats: WriteStats, held: HeldBlobs
    ) -> dict[Layer, LayerRecord]:
        return {
            layer: upload_layer(
                self.store, state, blob_bytes=self.config.blob_bytes, stats=stats, held=held
            )
            for layer, state in states.items()
        }

    def _persist_store_only(
        self, states: Mapping[Layer, LayerState], stats: WriteStats, *, step: int
    ) -> Manifest:
        records = self._upload(states, stats, store_held(self.store, self._verified))
        return commit_bundle(
            self.store,
            run=self.config.run,
            step=step,
            world_size=self.world_size,
            ranks={self.rank: records},
        )

    def _persist_with_control_plane(
        self, states: Mapping[Layer, LayerState], stats: WriteStats, *, step: int
    ) -> Manifest:
        """Persist through the control plane: one bundle per attempt and step."""
        control = self.control
        assert control is not None
        if self._attempt is None:
            self._attempt = self._register(resume=False)
        attempt = self._attempt
        if step in self._committed:
            # The catalog holds one bundle per attempt and step; the one already committed
            # is a valid resume point for this step (the micro-batches since are replayed).
            log.warning(
                "run %s: this attempt already committed a bundle at step %d; keeping it",
                self.config.run,
                step,
            )
            return self._committed[step]
        self._committed[step] = manifest = self._persist_bundle(
            control, attempt, states, stats, step
        )
        return manifest

    def _persist_bundle(
        self,
        control: ControlPlane,
        attempt: Registration,
        states: Mapping[Layer, LayerState],
        stats: WriteStats,
        step: int,
    ) -> Manifest:
        """Open, upload what the store lacks, record every layer, commit. A commit that finds
        blobs gone (collected while this save deduplicated against them) uploads them again."""
        bundle_id = control.open_bundle(
            self.config.run,
            attempt=attempt,
            step=step,
            world_size=self.world_size,
            versions=Versions(
                ckpt=__version__, python=platform.python_version(), torch=torch.__version__
            ),
        )
        force: set[str] = set()

        def held(blobs: list[BlobRef]) -> set[str]:
            return {b.sha256 for b in blobs} - control.missing_blobs(blobs) - force

        for _ in range(2):
            records = self._upload(states, stats, held)
            for layer, record in records.items():
                control.record_layer(
                    bundle_id, rank=self.rank, layer=layer, epoch=attempt.epoch, record=record
                )
            try:
                return control.commit(bundle_id, epoch=attempt.epoch)
            except IncompleteCommitError as err:
                if not err.blobs:
                    raise
                log.warning(
                    "bundle %d: %d blob(s) vanished; uploading them again",
                    bundle_id,
                    len(err.blobs),
                )
                force = err.blobs
                stats.seen.clear()
                stats.payload_bytes = 0
        return control.commit(bundle_id, epoch=attempt.epoch)

    def end(self, reason: str = "finished", *, final_save_committed: bool = False) -> None:
        """Tell the control plane how this attempt ended (finished, preempted or failed).

        A no-op store-only, or when no attempt was registered.
        """
        if self.control is not None and self._attempt is not None:
            self.control.end(
                self._attempt.attempt_id,
                reason=reason,
                final_save_committed=final_save_committed,
                step=self.counters.step,
            )

    def close(self) -> None:
        """Release the control-plane connection (the attempt is not ended: see ``end``)."""
        if self.control is not None:
            self.control.close()

    def _check_not_replacing(self, step: int) -> None:
        if step in self._own_steps or self.store.size(manifest_key(self.config.run, step)) is None:
            return
        raise BundleExistsError(
            f"run {self.config.run} already has a bundle at step {step} that this process "
            "neither resumed from nor wrote; saving would replace it. Resume the run first "
            "(all layers), or warm-start a new run: resume(from_run=..., layers=[...])"
        )

    def _capture(self) -> dict[Layer, LayerState]:
        states: dict[Layer, LayerState] = {}
        for layer in _CAPTURE_ORDER:
            state = _CAPTURE[layer](self.objects)
            encoded, tensors = skeleton.encode(state, root=(str(layer),))
            states[layer] = LayerState(
                encoded, {name: t.detach().cpu() for name, t in tensors.items()}
            )
        return {layer: states[layer] for layer in RESTORE_ORDER}
