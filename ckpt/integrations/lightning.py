"""Lightning 2.x: six-layer bundles from ``Trainer.fit`` and a bit-exact resume.

    from ckpt.integrations.lightning import CheckpointCallback

    trainer = pl.Trainer(max_steps=..., callbacks=[CheckpointCallback(run="my-run", every_steps=100)])
    trainer.fit(model, loader)  # resumes from the run's latest resumable bundle, if any

A callback, not a ``CheckpointIO`` plugin: ``CheckpointIO`` only receives the dict that
``Trainer.save_checkpoint`` assembled, when Lightning decides to save, and is handed one
back in the middle of Lightning's own restore. A bit-exact resume needs more than that
dict: the live optimizer objects before the loops start (ckpt reads blobs straight into
them), the global random streams at the exact point they were captured, the data position
of the batch just consumed, and the stop signal handled at a step boundary. A callback sees
every one of those moments:

``on_fit_start``
    The optimizers and schedulers exist (``strategy.setup`` built them) and no loop has
    run. The callback builds the train loader through the fit loop (``setup_data``, which the
    loop would otherwise call first thing and then skips), creates the ``Checkpointer`` over
    the module, the optimizers, the schedulers, the loader and the AMP scaler, and resumes:
    ckpt restores its six layers, then the fit loop's progress (``global_step``, the epoch,
    the batch and optimizer progress, exactly what Lightning's own checkpoints hold) is loaded
    from the counters layer, so Lightning's loops restart mid-epoch as after a
    ``ckpt_path`` resume. The loader's iterator, created by ``setup_data`` before the
    restore, is created again at the restored position; when that epoch's iterator had been
    created before the save, creating it again must not draw from the restored global
    generator (the uninterrupted run drew once), so the draw is undone.
``on_train_start``
    Lightning zeroes the gradients between ``on_fit_start`` and the loop
    (``Trainer._run_stage``); a bundle saved mid-accumulation holds gradients, so they are put
    back here. A bundle saved after an epoch's last batch goes on with a fresh next epoch
    (``_start_next_epoch``), not with Lightning's mid-epoch restart of it.
``on_train_batch_end``
    The batch is consumed: the data position and the counters advance, and
    ``Checkpointer.maybe_save`` saves when the policy says (``every_steps`` only once an
    optimizer step completed; ``accumulate_grad_batches`` is honoured) or, after SIGTERM or
    SIGINT, saves once more, ends the attempt and raises ``SystemExit(143)``.
``on_fit_end``
    ``Checkpointer.end``: the last save is durable and the attempt finished.

Signals. ckpt catches SIGTERM and SIGINT (``handle_signals``, the default): the next batch end
saves, ends the attempt and exits 143. Lightning's ``SignalConnector`` puts its own SIGTERM
handler over ckpt's after ``on_fit_start``; its flag stops the loop with ``SIGTERMException``
(exit code 0) at the end of the batch, which may come before ckpt's watcher thread noted the
signal, and the final save would be lost. So ``on_train_start`` gives SIGTERM back to ckpt's
handler for the fit; Lightning's teardown restores what it found, and ckpt's ``close`` then
its own predecessors (after an exception, ckpt closes first: the callback then leaves
Lightning nothing to restore, or SIGTERM and Ctrl-C would go to a closed handler).

Data. The train loader must resume by itself: a ``DataLoader`` with ckpt's
``ResumableSampler``, or torchdata's ``StatefulDataLoader`` (see docs/usage.md, "the rules
for bit-exactness"); other loaders are refused with advice. Lightning's fetcher does not
prefetch from a loader whose length it knows, so the batch handed to the step is the last
one consumed.

Validation inside an epoch (``val_check_interval``) is resumed as Lightning resumes its own
checkpoints: a validation due right after the saved batch is not run by the resumed process
(Lightning fast-forwards it), though its iterator is created, so the random streams stay
those of the uninterrupted run.

The callback reaches into private parts of Lightning 2.x: ``FitLoop._data_fetcher`` and
``_combined_loader`` (the loader and its iterator) and ``Trainer._signal_connector`` (its
SIGTERM flag and the handlers it restores); the extra pins ``lightning<3``.
"""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torch.utils.data import DataLoader

from agent.checkpointer import Checkpointer
from agent.config import InFlight
from agent.interop.framework_keys import LIGHTNING_FIT_LOOP
from agent.restore.resume import ResumeResult
from agent.state.objects import Generator
from agent.stateful import Stateful
from ckpt.core.storage import ObjectStore

__all__ = ["CheckpointCallback", "CheckpointerOptions"]

_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


class CheckpointerOptions(TypedDict, total=False):
    """The ``Checkpointer`` keywords the callback passes through (see ``Checkpointer``)."""

    extras: Mapping[str, Stateful]
    generators: Mapping[str, Generator]
    store: str | ObjectStore
    server: str
    token: str
    every_steps: int
    every_seconds: float
    every: str
    auto_min_seconds: float
    auto_max_seconds: float
    mtbf_seconds: float
    blob_bytes: int
    in_flight: InFlight | str
    skip_unchanged: bool
    overlap: bool
    staging_bytes: int
    grace_seconds: float
    handle_signals: bool
    heartbeat_seconds: float
    quiet: bool
    rank_timeout_seconds: float
    notices: str | list[str]
    notice_poll_seconds: float
    metadata_url: str


@dataclass
class _Resumed:
    """What the callback puts back after Lightning's own steps between restore and loop."""

    grads: dict[nn.Parameter, torch.Tensor]
    next_epoch: bool  # saved at an epoch's last batch: the run goes on with the next epoch


class CheckpointCallback(pl.Callback):
    """Saves six-layer bundles during ``Trainer.fit`` and resumes the run bit-exactly.

    ``trainer.fit(model, loader)`` resumes from the run's latest resumable bundle (no
    ``ckpt_path``): weights, optimizer, scheduler, rng, data and the fit loop's progress.

    Args:
        run: the run's name (``CKPT_RUN``); every attempt of the run uses the same one.
        options: passed to ``Checkpointer`` (``every_steps``, ``store``, ``server``...);
            ``CKPT_*`` environment variables work as usual.

    Raises (from ``trainer.fit``):
        ValueError: more than one train loader, or one that cannot resume (says what to
            change); or a checkpoint path given to ``fit`` while the run has a bundle.
    """

    def __init__(self, *, run: str | None = None, **options: Unpack[CheckpointerOptions]) -> None:
        self.run = run
        self.options = options
        self.checkpointer: Checkpointer | None = None
        self.resumed: ResumeResult | None = None
        self._pending: _Resumed | None = None
        self._last_step = 0
        self._sigterm: Any = None  # ckpt's SIGTERM handler, while it handles signals

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = _train_loader(trainer)
        plugin_scaler = getattr(trainer.precision_plugin, "scaler", None)
        ckpt = Checkpointer(
            run=self.run,
            models={"model": pl_module},
            optimizers=list(trainer.optimizers),
            schedulers=[config.scheduler for config in trainer.lr_scheduler_configs],
            data=loader,
            scaler=plugin_scaler if isinstance(plugin_scaler, Stateful) else None,
            **self.options,
        )
        self.checkpointer = ckpt
        self.resumed = ckpt.resume()
        if self.resumed.resumed:
            if trainer.ckpt_path is not None:
                raise ValueError(
                    f"run {ckpt.config.run} resumed from {self.resumed.bundle}; Lightning would "
                    f"then restore {trainer.ckpt_path} over it: leave out fit's checkpoint path"
                )
            self._restore_loop(trainer, ckpt, loader)
        self._last_step = trainer.global_step
        handler = signal.getsignal(signal.SIGTERM)
        self._sigterm = handler if ckpt.config.handle_signals else None

    def _restore_loop(
        self, trainer: pl.Trainer, ckpt: Checkpointer, loader: DataLoader[Any]
    ) -> None:
        """After ckpt's layers: the fit loop's progress and the loader's iterator."""
        fit_loop = trainer.fit_loop
        state = ckpt.counters.extras.get(LIGHTNING_FIT_LOOP)
        if not isinstance(state, dict):
            raise ValueError(
                f"run {ckpt.config.run}: its bundle holds no Lightning loop progress; it was not "
                "saved by CheckpointCallback"
            )
        fit_loop.load_state_dict(state)
        # The saved batch was the epoch's last: Lightning goes on with the next epoch, whose
        # iterator the uninterrupted run had not created yet (so it draws); otherwise the
        # epoch's iterator existed already and the restored generator holds its draw.
        next_epoch = fit_loop.epoch_loop.batch_progress.is_last_batch
        source = ckpt.objects.data
        assert source is not None
        source.begin_epoch(ckpt.counters.epoch + 1 if next_epoch else ckpt.counters.epoch)
        _recreate_iterator(trainer, loader, draws=next_epoch)
        model = trainer.lightning_module
        grads = {p: p.grad for p in model.parameters() if p.grad is not None}
        self._pending = _Resumed(grads=grads, next_epoch=next_epoch)
        # Lightning warns that a plain DataLoader cannot resume mid-epoch: ckpt's data layer does.
        warnings.filterwarnings(
            "ignore", message=_NOT_RESUMABLE, category=PossibleUserWarning, append=False
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._own_sigterm(trainer)
        pending, self._pending = self._pending, None
        if pending is None:
            return
        for parameter, grad in pending.grads.items():  # Trainer._run_stage zeroed them
            parameter.grad = grad
        if pending.next_epoch:
            _start_next_epoch(trainer)

    def _own_sigterm(self, trainer: pl.Trainer) -> None:
        """Take SIGTERM back from Lightning's handler, which it put over ckpt's after
        ``on_fit_start``: its flag would stop the loop (exit 0) before ckpt's save."""
        handler = self._sigterm
        if handler is None or threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, handler)
        trainer._signal_connector.received_sigterm = False  # one that came before is ckpt's too

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        source = self._ckpt().objects.data
        assert source is not None
        source.begin_epoch(trainer.current_epoch)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        ckpt = self._ckpt()
        source = ckpt.objects.data
        assert source is not None
        source.consumed()
        self._count(trainer, ckpt)
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        ckpt.step_done(loss if isinstance(loss, torch.Tensor) else None)  # agent.verify
        ckpt.maybe_save()  # after a stop signal, this saves, ends the attempt and exits

    def _count(self, trainer: pl.Trainer, ckpt: Checkpointer) -> None:
        """The counters of the batch just consumed, and the fit loop's progress with them."""
        counters = ckpt.counters
        stepped = trainer.global_step != self._last_step
        self._last_step = trainer.global_step
        counters.step = trainer.global_step
        counters.micro_step = 0 if stepped else counters.micro_step + 1
        counters.epoch = trainer.current_epoch
        counters.batch = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        state = trainer.fit_loop.state_dict()
        state["state_dict"].pop("combined_loader", None)  # the data layer holds the loader
        counters.extras[LIGHTNING_FIT_LOOP] = state

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning's teardown gave the signal handlers back: ckpt's close then
        # uninstalls its own last.
        ckpt, self.checkpointer = self._ckpt(), None
        try:
            ckpt.end()
        finally:
            ckpt.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is None:
            return
        try:
            if isinstance(exception, SIGTERMException):  # Lightning's stop: ckpt handles no signals
                ckpt.end("preempted")
            elif not isinstance(exception, SystemExit):  # ckpt's SystemExit: ended already
                ckpt.end("failed")
        finally:
            ckpt.close()  # gives the signals back to the handlers before ckpt's
            if self._sigterm is not None:
                # Lightning's teardown comes next and would put back the handlers it found
                # when it started, ckpt's closed ones (SIGTERM and Ctrl-C then ignored).
                trainer._signal_connector._original_handlers = {}

    def _ckpt(self) -> Checkpointer:
        if self.checkpointer is None:
            raise RuntimeError("CheckpointCallback: the Checkpointer exists from on_fit_start")
        return self.checkpointer


def _start_next_epoch(trainer: pl.Trainer) -> None:
    """Restored after an epoch's last batch, go on as the uninterrupted run did: with a new
    epoch, not a restart in the middle of one.

    Lightning would restart the next epoch as if mid-epoch: skip its start (the epoch
    progress and the ``on_train_epoch_start`` hooks) and, at its first batch (index -1 + 1),
    fast-forward a validation it takes as due, creating the validation iterator, which draws
    from the global generator. So the epoch loop's restart bookkeeping runs now, once, and
    the loops then run a fresh epoch.
    """
    fit_loop = trainer.fit_loop
    fit_loop.reset_restart_stage()
    epoch_loop = fit_loop.epoch_loop
    epoch_loop.reset()  # the restart's counting of the saved batch, as Lightning does it
    epoch_loop.reset_restart_stage()
    epoch_loop.restarting = False


def _train_loader(trainer: pl.Trainer) -> DataLoader[Any]:
    """The one train loader, built now by the fit loop (its own first step, skipped later)."""
    fit_loop = trainer.fit_loop
    fit_loop.setup_data()
    combined = fit_loop._combined_loader
    loaders = [] if combined is None else combined.flattened
    if len(loaders) != 1 or not isinstance(loaders[0], DataLoader):
        raise ValueError(
            f"CheckpointCallback resumes one train DataLoader; this fit has {len(loaders)} "
            "train loaders: pass one (with ResumableSampler, or a torchdata StatefulDataLoader)"
        )
    loader: DataLoader[Any] = loaders[0]
    return loader


def _recreate_iterator(trainer: pl.Trainer, loader: DataLoader[Any], *, draws: bool) -> None:
    """Create the fit loop's iterator again at the restored data position.

    Creating a DataLoader iterator draws its workers' base seed from ``loader.generator``, or
    the global generator when that is None. Unless ``draws`` (the next epoch's iterator), that
    draw is undone: the restored generator already holds it. (A ``StatefulDataLoader``'s own
    generator is part of its state, which its restore manages, as ``agent.data.sources`` does.)
    """
    stateful = isinstance(loader, Stateful)
    if draws and stateful:
        _finish_saved_epoch(loader)
    generator = loader.generator if loader.generator is not None else torch.default_generator
    undo = not draws and (loader.generator is None or not stateful)
    saved = generator.get_state() if undo else None
    fetcher = trainer.fit_loop._data_fetcher
    assert fetcher is not None
    iter(fetcher)
    if saved is not None:
        generator.set_state(saved)


def _finish_saved_epoch(loader: DataLoader[Any]) -> None:
    """A stateful loader saved after its epoch's last batch resumes that epoch, with nothing
    left of it (Lightning stops at the known length, before the iterator ends): end it, so
    that the next iterator starts the next epoch, as the uninterrupted run's did."""
    if next(iter(loader), None) is not None:
        raise RuntimeError(
            "the restored loader has batches left in an epoch the bundle ended: its length "
            "is not what Lightning counted"
        )
