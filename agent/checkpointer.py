"""The Checkpointer: the training loop's one handle on ckpt.

A thin guard over the phases, each in a folder of its own: ``agent``'s docstring lists them,
those a save passes through first (save/, state/, catalog/), then restore/, attempt/, ranks/
and verify/ (each step's fingerprint, a resume's replayed steps against the dead attempt's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Unpack

import torch
from torch import nn

from agent.attempt.goodput import TimeAccount
from agent.attempt.grace import Preemption
from agent.catalog import open_catalog
from agent.config import Config, Keywords
from agent.counters import Counters
from agent.data.epochs import Epochs
from agent.launch.finished import note_finished
from agent.ranks.base import MEET_SECONDS, Ranks, job_ranks
from agent.restore.resume import Restorer, ResumeResult
from agent.save.persist import Persister
from agent.save.policy import Position
from agent.save.result import PendingSave, SaveResult
from agent.save.schedule import SaveSchedule
from agent.save.staging import StagingArea, stage_layers
from agent.state.objects import Generator, gather, replicated_layers
from agent.stateful import Stateful
from agent.summary import announce
from agent.verify.compare import Verification
from agent.verify.verifier import open_verifier
from ckpt.core.contract import RESTORE_ORDER, Layer
from ckpt.core.storage import ObjectStore, open_store

__all__ = ["Checkpointer"]

log = logging.getLogger("ckpt")


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
        store: where bundles go (``CKPT_STORE``): a directory, ``s3://bucket/prefix``, or
            an ``ObjectStore``.
        **settings: ``server``, ``token``, ``every_steps``, ``every_seconds``, ``every``,
            ``in_flight``, ``overlap``, ``grace_seconds``...: the other settings of
            ``Config`` (each also a ``CKPT_*`` variable), typed by ``Keywords``.

    Raises:
        ValueError: bad configuration or a data pipeline that cannot resume, saying what to change.
        TypeError: a keyword that is no setting (misspelt).
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
        generators: Mapping[str, Generator] | None = None,
        store: str | ObjectStore | None = None,
        **settings: Unpack[Keywords],
    ) -> None:
        store_url = store if store is None or isinstance(store, str) else store.url
        self.config = Config.resolve({**settings, "run": run, "store": store_url})
        self.store: ObjectStore = (
            open_store(self.config.store) if store is None or isinstance(store, str) else store
        )
        self.objects = gather(
            models=models,
            optimizers=optimizers,
            schedulers=schedulers,
            data=data,
            scaler=scaler,
            extras=extras,
            generators=generators,
        )
        self.ranks: Ranks = job_ranks(timeout=self.config.rank_timeout_seconds)
        self.rank, self.world_size = self.ranks.rank, self.ranks.world_size
        self._wire()

    def _wire(self) -> None:
        """Connect the phases: catalog, restore, persist, preemption."""
        config = self.config
        self._catalog = open_catalog(
            config, store=self.store, ranks=self.ranks, step=lambda: self.counters.step
        )
        self._restorer = Restorer(
            store=self.store, catalog=self._catalog, objects=self.objects, ranks=self.ranks
        )
        self._staging = StagingArea(budget=config.staging_bytes)
        self.time_spent = TimeAccount()  # where this attempt's time goes (goodput)
        optimizers = self.objects.optimizers.values()
        self._step_hooks = self._staging.hold_steps(optimizers, stalled=self.time_spent.stalled)
        self._persister = Persister(
            run=config.run,
            store=self.store,
            catalog=self._catalog,
            blob_bytes=config.blob_bytes,
            ranks=self.ranks,
            replicated=replicated_layers(self.objects, world_size=self.world_size),
            quiet=config.quiet,
        )
        self._verifier = open_verifier(
            config,
            objects=self.objects,
            ranks=self.ranks,
            catalog=self._catalog,
            store=self.store,
            durable=lambda: self._persister.durable_at,
        )
        self._step_hooks += self._persister.steps.watch(optimizers)
        self._preemption = Preemption(
            run=config.run,
            ranks=self.ranks,
            grace_seconds=config.grace_seconds,
            persister=self._persister,
            save=self.save,
            position=self._position,
            end=self._end,
            install=config.handle_signals,
        )
        self._schedule = SaveSchedule(
            config,
            catalog=self._catalog,
            ranks=self.ranks,
            persister=self._persister,
            preemption=self._preemption,
            time_spent=self.time_spent,
            step=lambda: self.counters.step,
        )
        self._epochs = Epochs(self.objects.data, self.counters)
        self._catalog.account(lambda: self.time_spent.figures(self.counters.step))

    @property
    def counters(self) -> Counters:
        """The live counters; the loop reads and advances them."""
        return self.objects.counters

    @property
    def stopping(self) -> bool:
        """Whether SIGTERM or SIGINT reached this process: the next ``maybe_save()`` ends it."""
        return self._preemption.requested

    @property
    def verification(self) -> Verification | None:
        """What the resume proved about the steps it replayed, once known (``agent.verify``)."""
        return self._verifier.verification

    def step_done(self, loss: torch.Tensor | float | None = None) -> None:
        """Fingerprint the current position with the ``loss`` of the micro-batch that reached
        it, for a resume to compare: call after advancing the counters, before ``maybe_save``."""
        self._verifier.record(self._position(), loss=loss)

    def _position(self) -> Position:
        return Position(step=self.counters.step, micro_step=self.counters.micro_step)

    def resume(
        self,
        *,
        layers: Iterable[Layer | str] = RESTORE_ORDER,
        from_run: str | None = None,
        from_step: int | None = None,
    ) -> ResumeResult:
        """Restore the latest resumable bundle of the run, or report a fresh start.

        Layers are restored in the fixed order weights, optimizer, scheduler, rng, data,
        counters. Restoring only some is a warm start, not a bit-exact resume: do it from
        another run (``from_run="base", layers=["weights"]``), since with the counters back at
        zero, saves would collide with this run's own bundles (and are refused).

        Args:
            layers: the layers to restore; all six by default.
            from_run: read the latest bundle of this run instead of the checkpointer's own
                (left out: ``CKPT_FROM_RUN`` while this run has none of its own; ``Config``).
            from_step: with ``from_run``, that run's bundle at this step, not its latest.

        Returns:
            Which bundle was restored (``bundle=None`` when there was none).

        Raises:
            CorruptBundleError: every resumable bundle has a blob that does not match its
                manifest (one that fails is quarantined and the one before it is used). The
                weights and optimizer state may hold parts of it: rebuild them to train.
            BundleFormatError: the bundle is malformed (as above for weights and optimizer).
            IncompatibleBundleError: the bundle does not fit these objects (rebuild them).
            StoreError: the store failed to answer, or a blob read here failed its check while
                the control plane reads it back intact (a fault on the way): retry.
            ValueError: ``from_step`` names no complete bundle of that run.
        """
        self.wait()
        result, own = self._restorer.restore(
            self.config, layers=layers, from_run=from_run, from_step=from_step
        )
        if result.step is None:
            self.time_spent.ready(self.counters.step)
            return result
        # The loop continues from the restored position (the run's own bundle: durable).
        self._schedule.saved(self._position())
        self._epochs.restart()
        if whole := own and result.layers == RESTORE_ORDER:
            self._catalog.resumed(self._position())
            self._persister.resumed_at(self._position())
        self.ranks.barrier(timeout=MEET_SECONDS)  # every rank restored before any trains
        where = f"{result.bundle} at {self._position()} (layers {', '.join(result.layers)})"
        announce(f"ckpt: run {self.config.run}: resumed from {where}", quiet=self.config.quiet)
        if whole:  # after the line above: a verdict follows the resume it judges
            self._verifier.resumed(self._position())
        self.time_spent.ready(self.counters.step)
        return result

    def batches(self) -> Iterator[Any]:
        """Iterate the rest of the current epoch of ``data``, then advance the epoch.

        Starts where the run stopped (the restored position), counts each batch handed
        out as consumed, and leaves the random streams exactly as the uninterrupted run
        would. Breaking out and calling it again continues the same epoch with the same
        iterator. Call ``maybe_save`` at the end of the loop body, after the batch is used.
        """
        return self._epochs.batches()

    def maybe_save(self) -> PendingSave | None:
        """Save if the policy says so at the current position; call once per micro-batch.

        While the previous save is still writing its bytes, a due save waits for it
        (``in_flight="wait"``, the default) or is skipped (``in_flight="skip"``: None is
        returned and the next call tries again). A save never waits on the control plane:
        while it does not answer, saves go to the store and are committed in the background
        when it answers again (in a job of many ranks, by rank 0; ``agent.catalog.job``).

        After SIGTERM or SIGINT this is where the process ends: it waits for the save in
        flight, saves once more if its last measured save fits in what is left of the grace
        period (else keeps the last bundle), ends the attempt as preempted, and raises
        ``SystemExit(128 + signal)`` (143 for SIGTERM).
        """
        self.time_spent.ready(self.counters.step)  # when the loop did not resume() first
        position = self._position()
        self._verifier.at(position)
        if not self._schedule.due(position):
            return None
        return self.save()

    def save(self) -> PendingSave:
        """Stage a bundle of the current state and persist it in the background.

        Returns once every tensor is copied into the staging buffers: training may then
        change the state. At most one save is in flight: this first waits for the one
        before it. Call ``wait()`` on the result, or ``Checkpointer.wait()``, for the
        bundle to be durable. A position that is durable already (saved, or resumed from)
        is not saved again: the result is that bundle, done.

        Raises:
            UnrepresentableStateError: a state value has no safe representation (names its key path).
            BundleExistsError: store-only, the position has a resumable bundle and this
                process did not resume the run (all layers) from before it: resume first, or
                save to a new run. A later micro step of a saved step is a new bundle, and a
                bundle the resume skipped (incomplete, damaged, after where it resumed) is
                saved again, replacing it.
            StoreError, ControlPlaneError, FencedError: the previous save's persist failed
                (raised here, once, so that no failed save goes unnoticed; what the persist
                itself raises, ``PendingSave.wait`` raises).
        """
        started = time.perf_counter()
        self._persister.settle(block=True)
        position = self._position()
        if position == self._persister.durable_at:
            log.info("run %s: %s is saved already; nothing to save", self.config.run, position)
            return self._persister.already_durable()
        counters = self.counters
        step, *_ = self.ranks.agree(
            (position.step, position.micro_step, counters.epoch, counters.batch),
            what="the position of a save (step, micro step, epoch, batch)",
            timeout=MEET_SECONDS,
        )
        self._catalog.check_save(position)
        states, staged = stage_layers(
            self.objects,
            self._staging,
            skip_unchanged=self.config.skip_unchanged,
            overlap=self.config.overlap,
        )
        try:
            self._schedule.saved(position)
            self._verifier.saved(position)
            stall = time.perf_counter() - started
            pending = self._persister.submit(
                states, staged, step=step, stall=stall, position=position
            )
        except BaseException:
            staged.abandon()
            raise
        self.time_spent.stalled(stall)
        self._schedule.measured(stall)
        return pending

    def wait(self) -> SaveResult | None:
        """Block until the save in flight (if any) is durable, and the steps' fingerprints are
        kept where the next attempt reads them.

        Raises:
            StoreError, ControlPlaneError, FencedError: its persist failed (see ``save``),
                unless ``PendingSave.wait`` already raised that failure.
        """
        result = self._persister.wait()
        self._verifier.flush()
        return result

    def release_staging(self) -> int:
        """Wait for the save in flight, then free the staging buffers (a copy of the state
        in host memory, pinned for GPU tensors); the next save allocates them again.
        Returns the bytes freed.

        Raises:
            StoreError, ControlPlaneError, FencedError: the save in flight failed.
        """
        self.wait()
        return self._staging.release()

    def end(self, reason: str = "finished", *, final_save_committed: bool = False) -> None:
        """Tell the control plane how this attempt ended (finished, preempted or failed), after
        the save in flight ends (an unanswered commit waits at most ``server_retry_seconds``,
        then is left to the next attempt, logged); "finished" also tells ``ckpt launch`` not to
        restart it. A no-op store-only, or when no attempt was registered.

        Raises:
            StoreError, ControlPlaneError, FencedError: the save in flight failed (the end is
                reported all the same).
        """
        deadline = time.monotonic() + self.config.server_retry_seconds  # commits and the end
        try:
            self._persister.finish(seconds=self.config.server_retry_seconds)
            self._verifier.finish()
            if reason == "finished":
                note_finished(rank=self.rank, world_size=self.world_size)
        finally:
            patience = max(deadline - time.monotonic(), 5.0)
            self._end(reason, final_save_committed=final_save_committed, patience=patience)

    def _end(self, reason: str, *, final_save_committed: bool, patience: float | None) -> None:
        self._catalog.end(
            reason,
            final_save_committed=final_save_committed,
            step=self.counters.step,
            patience=patience,
        )

    def close(self) -> None:
        """Wait for the save in flight (its commit at most ``server_retry_seconds``, as ``end``),
        then release what it holds: its threads, the signals (back to their handlers before
        it), the data's live iterator (and with it a DataLoader's workers) and the
        control-plane connection. The attempt is not ended: see ``end``.

        Raises:
            StoreError, ControlPlaneError, FencedError: the save in flight failed.
        """
        try:
            self._persister.finish(seconds=self.config.server_retry_seconds)
        finally:
            for hook in self._step_hooks:
                hook.remove()
            self._schedule.close()
            self._preemption.close()
            self._epochs.close()
            self._persister.close()
            self._verifier.close()
            self._catalog.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
