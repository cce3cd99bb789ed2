"""The Checkpointer: the training loop's one handle on ckpt."""

from __future__ import annotations

import logging
import os
import platform
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn

from agent import layers
from agent.bundle import (
    BlobHashes,
    BlobSources,
    HeldBlobs,
    LayerState,
    WriteStats,
    bundle_name,
    bundle_name_at,
    commit_bundle,
    latest_manifest,
    layer_record,
    read_layer,
    store_held,
    upload_layer,
)
from agent.client import ControlPlane, IncompleteCommitError, Registration, default_token
from agent.config import Config, InFlight
from agent.counters import Counters
from agent.data import Resumed, data_source
from agent.errors import (
    BundleExistsError,
    CkptError,
    CorruptBundleError,
    FencedError,
    IncompatibleBundleError,
)
from agent.format import skeleton
from agent.layers import TrainingObjects
from agent.policy import Position, SavePolicy
from agent.preemption import Preemption
from agent.progress import Progress
from agent.staging import Staged, StagingArea
from agent.stateful import Stateful
from agent.storage import ObjectStore, open_store
from agent.storage.keys import manifest_key
from service import __version__
from service.contract import (
    RESTORE_ORDER,
    BlobRef,
    Layer,
    LayerRecord,
    Manifest,
    SaveFigures,
    Versions,
)

log = logging.getLogger("ckpt")

T = TypeVar("T")
# Hash and store every layer's blobs, asking ``HeldBlobs`` which the store already holds.
Upload = Callable[[HeldBlobs], dict[Layer, LayerRecord]]

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
    """What one save wrote and what it cost, once durable.

    Attributes:
        stall_seconds: how long ``save`` held training up (staging, plus waiting for the
            save before it when that one was still in flight).
        persist_seconds: from the end of staging until the bundle was committed.
        payload_bytes: the bundle's bytes (this rank); new_bytes: those uploaded, the rest
            being blobs the store already held.
    """

    bundle: str
    step: int
    payload_bytes: int
    new_bytes: int
    stall_seconds: float
    persist_seconds: float

    @property
    def throughput(self) -> float:
        """Bundle bytes persisted per second."""
        return self.payload_bytes / self.persist_seconds if self.persist_seconds else 0.0

    @property
    def dedup_ratio(self) -> float:
        """The fraction of the bundle that was uploaded: 1.0 when nothing was in the store."""
        return self.new_bytes / self.payload_bytes if self.payload_bytes else 0.0

    @property
    def figures(self) -> SaveFigures:
        return SaveFigures(
            stall_seconds=self.stall_seconds,
            persist_seconds=self.persist_seconds,
            payload_bytes=self.payload_bytes,
            new_bytes=self.new_bytes,
        )


class PendingSave:
    """A staged save; its persist (hash, upload, commit) runs in the background.

    The save is *staged* when ``Checkpointer.save`` returns it: the state was copied, so
    training may change it. It is *durable* once the bundle is committed: ``wait()``.
    """

    def __init__(
        self, *, bundle: str, step: int, stall_seconds: float, future: Future[SaveResult]
    ) -> None:
        self.bundle = bundle
        self.step = step
        self.stall_seconds = stall_seconds
        self.raised = False  # whether wait() already raised the persist's failure
        self._future = future

    @property
    def durable(self) -> bool:
        """Whether the bundle is committed (False while in flight or when the persist failed)."""
        return self._future.done() and self._future.exception() is None

    def done(self) -> bool:
        """Whether the persist ended, committed or failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until the bundle is durable.

        Raises:
            TimeoutError: still in flight after ``timeout`` seconds.
            StoreError, ControlPlaneError, FencedError: the persist failed (see ``save``).
        """
        try:
            return self._future.result(timeout)
        except BaseException as err:
            self.raised = self._future.done() and self._future.exception() is err
            raise

    def __repr__(self) -> str:
        state = "durable" if self.durable else "done" if self.done() else "in flight"
        return f"<PendingSave {self.bundle} {state}>"


def _exit_now(code: int) -> NoReturn:
    """Leave without waiting for threads (an upload that can no longer finish in time)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


def _pod_name() -> str:
    """``CKPT_POD`` (the hostname by default), with ``/CKPT_POD_UID`` when set: a recreated
    pod may reuse its name, never its UID."""
    name = os.environ.get("CKPT_POD") or socket.gethostname()
    uid = os.environ.get("CKPT_POD_UID")
    return f"{name}/{uid}" if uid else name


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
        store, server, token, every_steps, every_seconds, blob_bytes, in_flight,
            skip_unchanged, grace_seconds, handle_signals, heartbeat_seconds: see ``Config``.

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
        in_flight: InFlight | str | None = None,
        skip_unchanged: bool | None = None,
        grace_seconds: float | None = None,
        handle_signals: bool | None = None,
        heartbeat_seconds: float | None = None,
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
                "in_flight": in_flight,
                "skip_unchanged": skip_unchanged,
                "grace_seconds": grace_seconds,
                "handle_signals": handle_signals,
                "heartbeat_seconds": heartbeat_seconds,
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
        self._staging = StagingArea()
        self._persister = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist")
        self._in_flight: PendingSave | None = None
        self._blob_hashes: Mapping[BlobSources, str] = {}  # of the last persist, for reuse
        self._durable_at: Position | None = None  # where this process's newest bundle is
        self._save_seconds: float | None = None  # stall + persist of the last durable save
        self._heartbeats: threading.Thread | None = None
        self._stopping = threading.Event()  # stops the heartbeats
        self._exit_lock = threading.Lock()
        self._ended = False
        # The agent's deadline leaves the interpreter time to exit (about a second here).
        grace = self.config.grace_seconds
        margin = min(max(1.0, 0.1 * grace), 5.0, grace / 2)
        self._preemption = Preemption(
            deadline_seconds=grace - margin, on_deadline=self._deadline_passed
        )
        if self.config.handle_signals:
            self._preemption.install()

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
                Blobs are read straight into the existing weights and optimizer state, so
                those may then hold parts of a rejected bundle: rebuild them before training.
            BundleFormatError: the bundle is malformed (weights and optimizer state may hold
                parts of it, as above).
            IncompatibleBundleError: the bundle does not fit these objects. The layers before
                the one that failed are already restored: rebuild the objects before training.
        """
        self.wait()
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
            progress = Progress(
                f"ckpt: restoring {bundle_name(manifest)}",
                sum(layer_record(manifest, rank=self.rank, layer=x).payload_bytes for x in wanted),
            )
            try:
                return manifest, {layer: self._read(manifest, layer, progress) for layer in wanted}
            except CorruptBundleError as err:
                log.error(
                    "run %s: %s. Quarantining it and falling back to the bundle before it.",
                    run,
                    err,
                )
                failed.append(err)
                manifest = self._fall_back(run, manifest, own=own, reason=str(err))
            finally:
                progress.close()
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
            pod=_pod_name(),
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
        if self._heartbeats is None:
            self._heartbeats = threading.Thread(
                target=self._beat, name="ckpt-heartbeat", daemon=True
            )
            self._heartbeats.start()
        return attempt

    def _beat(self) -> None:
        """Tell the control plane every ``heartbeat_seconds`` that the attempt is alive and
        at which step; it marks attempts whose heartbeats stop as lost."""
        control = self.control
        assert control is not None
        while not self._stopping.wait(self.config.heartbeat_seconds):
            attempt = self._attempt
            if attempt is None:
                continue
            try:
                control.heartbeat(
                    attempt.attempt_id,
                    step=self.counters.step,
                    patience=self.config.heartbeat_seconds,
                )
            except FencedError as err:
                log.error("run %s: %s; heartbeats stop", self.config.run, err)
                return
            except CkptError as err:
                log.warning("run %s: heartbeat failed: %s", self.config.run, err)

    def _read(self, manifest: Manifest, layer: Layer, progress: Progress) -> layers.State:
        skeleton_json, tensors = read_layer(
            self.store,
            manifest,
            rank=self.rank,
            layer=layer,
            into=self._live_tensors(layer),
            progress=progress.advance,
        )
        record = layer_record(manifest, rank=self.rank, layer=layer)
        self._verified.update(blob.sha256 for blob in record.blobs)
        state: layers.State = skeleton.decode(skeleton_json, tensors)
        return state

    def _live_tensors(self, layer: Layer) -> dict[str, torch.Tensor]:
        """The tensors a layer's blobs are read straight into: the weights and optimizer
        state that exist already (restoring them then copies nothing)."""
        if layer not in (Layer.WEIGHTS, Layer.OPTIMIZER):
            return {}
        _, tensors = skeleton.encode(_CAPTURE[layer](self.objects), root=(str(layer),))
        return tensors

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

    def maybe_save(self) -> PendingSave | None:
        """Save if the policy says so at the current position; call once per micro-batch.

        While the previous save is still persisting, a due save waits for it
        (``in_flight="wait"``, the default) or is skipped (``in_flight="skip"``: None is
        returned and the next call tries again).

        After SIGTERM or SIGINT this is where the process ends: it waits for the save in
        flight, saves once more if its last measured save fits in what is left of the grace
        period (else keeps the last bundle), ends the attempt as preempted, and raises
        ``SystemExit(128 + signal)`` (143 for SIGTERM).
        """
        if self._preemption.requested:
            self._preempt()
        seconds = time.monotonic() - self._last_save_time
        if not self.policy.due(self._position(), last=self._last_saved, seconds_since_last=seconds):
            return None
        if self.config.in_flight is InFlight.SKIP and not self._settle(block=False):
            log.info("run %s: a save is still in flight; skipping this one", self.config.run)
            return None
        return self.save()

    def save(self) -> PendingSave:
        """Stage a bundle of the current state and persist it in the background.

        Returns once every tensor is copied into the staging buffers: training may then
        change the state. At most one save is in flight: this first waits for the one
        before it. Call ``wait()`` on the result, or ``Checkpointer.wait()``, for the
        bundle to be durable.

        Raises:
            UnrepresentableStateError: a state value has no safe representation (names its key path).
            BundleExistsError: store-only, the step has a bundle this process did not write.
            StoreError, ControlPlaneError, FencedError: the previous save's persist failed
                (raised here, once, so that no failed save goes unnoticed).

        The persist itself raises, from ``wait()``:
            StoreError: the store failed; no manifest was written, so no bundle exists.
            FencedError: a newer attempt of the run registered; this process must stop.
            ControlPlaneError: the control plane refused the bundle (its message says why)
                or stayed unreachable through the retries.
        """
        started = time.perf_counter()
        self._settle(block=True)
        step = self.counters.step
        if self.control is None:
            self._check_not_replacing(step)
        states, staged = self._stage()
        self._own_steps.add(step)
        self._last_saved = position = self._position()
        self._last_save_time = time.monotonic()
        stall = time.perf_counter() - started
        future = self._persister.submit(
            self._persist, states, staged, step=step, stall=stall, position=position
        )
        self._in_flight = PendingSave(
            bundle=bundle_name_at(self.config.run, step),
            step=step,
            stall_seconds=stall,
            future=future,
        )
        return self._in_flight

    def wait(self) -> SaveResult | None:
        """Block until the save in flight (if any) is durable.

        Raises:
            StoreError, ControlPlaneError, FencedError: its persist failed (see ``save``),
                unless ``PendingSave.wait`` already raised that failure.
        """
        pending = self._in_flight
        if pending is None or pending.raised:
            self._in_flight = None
            return None
        try:
            return pending.wait()
        finally:
            if pending.done():  # not when interrupted: its buffers are still in use
                self._in_flight = None

    def _settle(self, *, block: bool) -> bool:
        """Whether a new save may stage now: none in flight, or (``block``) it has ended."""
        pending = self._in_flight
        if pending is not None and not block and not pending.done():
            return False
        self.wait()
        return True

    def _stage(self) -> tuple[dict[Layer, LayerState], Staged]:
        """Capture the six layers and copy their tensors into the staging buffers."""
        skeletons = {}
        tensors: dict[str, torch.Tensor] = {}
        names: dict[Layer, list[str]] = {}
        for layer in _CAPTURE_ORDER:
            state = _CAPTURE[layer](self.objects)
            skeletons[layer], layer_tensors = skeleton.encode(state, root=(str(layer),))
            tensors.update(layer_tensors)
            names[layer] = list(layer_tensors)
        stable = self._stable_memory()
        staged = self._staging.stage(
            tensors, volatile=lambda t: t.untyped_storage().data_ptr() not in stable
        )
        states = {
            layer: LayerState(skeletons[layer], {n: staged.tensors[n] for n in names[layer]})
            for layer in RESTORE_ORDER
        }
        return states, staged

    def _stable_memory(self) -> set[int]:
        """Memory that changes only through ops that bump the version counter: the frozen
        parameters of the models. Kernels that write tensors without bumping it include
        fused optimizers (the parameters and their state) and batch norm (its running
        statistics), so everything else is copied and hashed at every save."""
        if not self.config.skip_unchanged:
            return set()
        return {
            param.untyped_storage().data_ptr()
            for model in self.objects.models.values()
            for param in model.parameters()
            if not param.requires_grad
        }

    def _persist(
        self,
        states: Mapping[Layer, LayerState],
        staged: Staged,
        *,
        step: int,
        stall: float,
        position: Position,
    ) -> SaveResult:
        """The background half of a save: hash, upload, record and commit."""
        started = time.perf_counter()
        name = bundle_name_at(self.config.run, step)
        kept = self.control is not None and step in self._committed  # no new bundle then
        stats = WriteStats()
        hashes = BlobHashes(previous=self._blob_hashes, unchanged=staged.unchanged)
        progress = Progress(f"ckpt: saving {name}", sum(t.nbytes for t in staged.tensors.values()))

        def upload(held: HeldBlobs) -> dict[Layer, LayerRecord]:
            stats.seen.clear()  # a second round uploads the blobs that vanished again
            stats.payload_bytes = 0
            return {
                layer: upload_layer(
                    self.store,
                    state,
                    blob_bytes=self.config.blob_bytes,
                    stats=stats,
                    held=held,
                    hashes=hashes,
                    progress=progress.advance,
                )
                for layer, state in states.items()
            }

        try:
            manifest = (
                self._persist_store_only(upload, step=step)
                if self.control is None
                else self._persist_with_control_plane(upload, step=step)
            )
        except Exception:
            log.exception("run %s: saving %s failed", self.config.run, name)
            raise
        finally:
            self._blob_hashes = hashes.current
            progress.close()
        result = SaveResult(
            bundle=bundle_name(manifest),
            step=manifest.step,
            payload_bytes=stats.payload_bytes,
            new_bytes=stats.new_bytes,
            stall_seconds=stall,
            persist_seconds=time.perf_counter() - started,
        )
        if not kept:
            self._durable_at = position
        self._save_seconds = result.stall_seconds + result.persist_seconds
        log.info(
            "run %s: saved %s: %d bytes, %d new (%.1f%%), stall %.3f s, persist %.3f s "
            "(%.2f GB/s), %d bytes copied and %d hashed again",
            self.config.run,
            result.bundle,
            result.payload_bytes,
            result.new_bytes,
            100 * result.dedup_ratio,
            result.stall_seconds,
            result.persist_seconds,
            result.throughput / 1e9,
            staged.copied_bytes,
            result.payload_bytes - hashes.reused_bytes,
        )
        self._report(manifest, result)
        return result

    def _report(self, manifest: Manifest, result: SaveResult) -> None:
        """Send the save's figures to the control plane; a failure costs only the figures."""
        if self.control is None or manifest.catalog is None:
            return
        try:
            self.control.report_save(
                manifest.catalog.bundle_id, rank=self.rank, figures=result.figures
            )
        except CkptError as err:
            log.warning(
                "run %s: could not report the figures of %s: %s",
                self.config.run,
                result.bundle,
                err,
            )

    def _persist_store_only(self, upload: Upload, *, step: int) -> Manifest:
        records = upload(store_held(self.store, self._verified))
        self._verified.update(b.sha256 for record in records.values() for b in record.blobs)
        return commit_bundle(
            self.store,
            run=self.config.run,
            step=step,
            world_size=self.world_size,
            ranks={self.rank: records},
        )

    def _persist_with_control_plane(self, upload: Upload, *, step: int) -> Manifest:
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
        self._committed[step] = manifest = self._persist_bundle(control, attempt, step, upload)
        return manifest

    def _persist_bundle(
        self,
        control: ControlPlane,
        attempt: Registration,
        step: int,
        upload: Upload,
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
            records = upload(held)
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
        return control.commit(bundle_id, epoch=attempt.epoch)

    def end(self, reason: str = "finished", *, final_save_committed: bool = False) -> None:
        """Tell the control plane how this attempt ended (finished, preempted or failed),
        after the save in flight ends.

        A no-op store-only, or when no attempt was registered.

        Raises:
            StoreError, ControlPlaneError, FencedError: the save in flight failed (the end is
                reported all the same).
        """
        try:
            self.wait()
        finally:
            self._end(reason, final_save_committed=final_save_committed, patience=None)

    def _end(self, reason: str, *, final_save_committed: bool, patience: float | None) -> None:
        """End the attempt once (the deadline action may race the loop to it)."""
        with self._exit_lock:
            if self._ended:
                return
            self._ended = True
        self._stopping.set()
        if self.control is not None and self._attempt is not None:
            self.control.end(
                self._attempt.attempt_id,
                reason=reason,
                final_save_committed=final_save_committed,
                step=self.counters.step,
                patience=patience,
            )

    def close(self) -> None:
        """Wait for the save in flight, then release the background thread and the
        control-plane connection (the attempt is not ended: see ``end``).

        Raises:
            StoreError, ControlPlaneError, FencedError: the save in flight failed.
        """
        try:
            self.wait()
        finally:
            self._stopping.set()
            self._preemption.uninstall()
            self._persister.shutdown(wait=True)
            if self.control is not None:
                self.control.close()

    # -- preemption ----------------------------------------------------------------------

    def _budget(self) -> float:
        """Seconds left before the deadline of the signal's grace period."""
        return self._preemption.deadline_seconds - self._preemption.elapsed()

    def _preempt(self) -> NoReturn:
        """At a step boundary after a signal: make the newest state durable if there is time,
        end the attempt as preempted, exit."""
        signum = self._preemption.signum
        assert signum is not None
        finished = False
        try:
            finished = self._finish_in_flight()
            if finished and self._position() != self._durable_at:
                finished = self._emergency_save()
        finally:
            self._preemption.settle()  # from here on the exit is this thread's
            committed = self._durable_at == self._position()
            try:
                self._end(
                    "preempted", final_save_committed=committed, patience=max(self._budget(), 0.5)
                )
            except CkptError as err:
                log.error("run %s: could not end the attempt: %s", self.config.run, err)
        log.warning(
            "run %s: preempted by %s at step %d; %s; exiting with %d",
            self.config.run,
            signal.Signals(signum).name,
            self.counters.step,
            "this position is saved" if committed else f"the last bundle is at {self._durable_at}",
            128 + signum,
        )
        if not finished:  # an upload still runs: the interpreter's exit would wait for it
            _exit_now(128 + signum)
        raise SystemExit(128 + signum)

    def _finish_in_flight(self) -> bool:
        """Wait for the save in flight within the budget; False when time ran out."""
        pending = self._in_flight
        if pending is None:
            return True
        try:
            pending.wait(timeout=max(self._budget(), 0.0))
        except TimeoutError:
            log.error(
                "run %s: the save in flight did not finish within the grace period", self.config.run
            )
            return False
        except CkptError as err:
            log.error("run %s: the save in flight failed: %s", self.config.run, err)
        self._in_flight = None
        return True

    def _emergency_save(self) -> bool:
        """Save once more if the last measured save fits; False when it ran out of time."""
        estimate, left = self._save_seconds, self._budget()
        if estimate is None or estimate > left:
            known = (
                "no save was measured yet" if estimate is None else f"a save takes {estimate:.1f} s"
            )
            log.warning(
                "run %s: not saving after the signal (%s, %.1f s left); the last bundle stays",
                self.config.run,
                known,
                left,
            )
            return True
        try:
            self.save().wait(timeout=max(self._budget(), 0.0))
        except TimeoutError:
            log.error("run %s: the emergency save did not finish in time", self.config.run)
            return False
        except CkptError as err:
            log.error("run %s: the emergency save failed: %s", self.config.run, err)
        return True

    def _deadline_passed(self) -> None:
        """The grace period is nearly over and the loop reached no step boundary (it is in
        a long step, an evaluation, a stuck collective): end the attempt and the process
        now, keeping the last bundle."""
        signum = self._preemption.signum or signal.SIGTERM
        log.error(
            "run %s: no step boundary within the grace period; exiting with the last bundle (%s)",
            self.config.run,
            self._durable_at,
        )
        try:
            self._end("preempted", final_save_committed=False, patience=1.0)
        except CkptError as err:
            log.error("run %s: could not end the attempt: %s", self.config.run, err)
        with self._exit_lock:
            _exit_now(128 + signum)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _check_not_replacing(self, step: int) -> None:
        if step in self._own_steps or self.store.size(manifest_key(self.config.run, step)) is None:
            return
        raise BundleExistsError(
            f"run {self.config.run} already has a bundle at step {step} that this process "
            "neither resumed from nor wrote; saving would replace it. Resume the run first "
            "(all layers), or warm-start a new run: resume(from_run=..., layers=[...])"
        )
