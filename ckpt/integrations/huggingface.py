"""Bit-exact checkpoints for the Hugging Face ``Trainer`` (``pip install 'ckpt-spot[hf]'``).

    from ckpt.integrations.huggingface import CheckpointCallback, CheckpointTrainer

    trainer = CheckpointTrainer(
        model=model, args=args, train_dataset=dataset,
        callbacks=[CheckpointCallback(run="my-run", every_steps=50)],
    )
    trainer.train()  # resumes from the run's latest bundle, or starts fresh

A callback alone cannot make the Trainer resume bit-exactly: its default sampler shuffles
with a seed drawn from the global RNG, its data loader draws a worker base seed from the
global RNG each time an iterator is created, its mid-epoch resume works out where to go
on from ``resume_from_checkpoint`` (a local of its training loop) and then skips batches,
and its loss log lives in private attributes. ``CheckpointMixin`` changes exactly those
(see its docstring); put it first in the bases of any ``Trainer`` subclass, TRL's
``SFTTrainer`` included. ``CheckpointCallback`` holds the configuration and the
``Checkpointer``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import TrainOutput

from agent.checkpointer import Checkpointer
from agent.data.sampling import ResumableSampler, mix_seed
from agent.interop.framework_keys import TRAINER_STATE_FIELDS
from agent.restore.resume import ResumeResult

__all__ = ["CheckpointCallback", "CheckpointMixin", "CheckpointTrainer"]

# What the mixin passes as the Trainer's ``resume_from_checkpoint`` for the epoch a bundle
# resumes in: the Trainer then goes on from the right micro-batch, and ``_load_rng_state``
# (overridden) knows the RNG is ckpt's to restore, not a directory's.
RESUMED_BY_CKPT = "<resumed by ckpt>"


class TrainerProgress:
    """The Trainer's own progress as a stateful object: the fields of ``TrainerState`` that
    say where the run is, and the private accumulators of its loss log (the loss summed
    since the last log, the step of that log, the total for ``train_loss``, the FLOs not yet
    added to the state). Saved with the weights."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        state = dataclasses.asdict(trainer.state)
        return {
            "state": {name: state[name] for name in TRAINER_STATE_FIELDS},
            "tr_loss": trainer._tr_loss,
            "total_loss": trainer._total_loss_scalar,
            "last_logged_step": trainer._globalstep_last_logged,
            "flos": trainer.current_flos,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        for name, value in state["state"].items():
            setattr(trainer.state, name, value)
        trainer._tr_loss.copy_(state["tr_loss"])
        trainer._total_loss_scalar = float(state["total_loss"])
        trainer._globalstep_last_logged = int(state["last_logged_step"])
        trainer.current_flos = state["flos"]


def _optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (its ``step`` calls
    the inner one's, which is where the checkpointer's step hook must sit)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


class CheckpointCallback(TrainerCallback):
    """Saves six-layer bundles of a Trainer run and resumes it from the latest one.

    Needs a Trainer with ``CheckpointMixin``. The ``Checkpointer`` is built at
    ``on_train_begin``, when the Trainer has built its optimizer and scheduler, and resumes
    there; a save is considered after each optimizer step, once the Trainer has logged and
    evaluated it (the bundle then carries that step's log); ``on_train_end`` ends the attempt.
    After SIGTERM the next step boundary saves once more if it fits the grace period and
    the process exits with 143.

    Args:
        run: the run's name (``CKPT_RUN``); every restart of the job uses the same one.
        **config: passed on to ``Checkpointer`` (``store``, ``server``, ``every_steps``,
            ``every_seconds``, ``every``, ...); ``CKPT_*`` variables work as usual.
    """

    def __init__(self, *, run: str | None = None, **config: Any) -> None:
        taken = {"models", "optimizers", "schedulers", "data", "scaler", "extras"} & config.keys()
        if taken:
            raise ValueError(
                f"CheckpointCallback takes the training objects from the Trainer; "
                f"leave out {', '.join(sorted(taken))}"
            )
        self.run = run
        self.config = config
        self.trainer: Trainer | None = None  # bound by CheckpointMixin.train
        self.checkpointer: Checkpointer | None = None
        self.resuming = False  # a bundle was restored and the loop has not reached it yet

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        trainer = self.trainer
        if trainer is None:
            raise ValueError(
                "CheckpointCallback needs a Trainer with CheckpointMixin: use CheckpointTrainer, "
                "or class MyTrainer(CheckpointMixin, SFTTrainer)"
            )
        sampler = _train_sampler(kwargs["train_dataloader"])
        scaler = getattr(trainer.accelerator, "scaler", None)
        self.close()
        self.checkpointer = Checkpointer(
            run=self.run,
            models=kwargs["model"],
            optimizers=_optimizer(kwargs["optimizer"]),
            schedulers=kwargs["lr_scheduler"],
            data=sampler,
            scaler=scaler,
            extras={"trainer": TrainerProgress(trainer)},
            **self.config,
        )
        self.resuming = self._resume(self.checkpointer).resumed

    def _resume(self, checkpointer: Checkpointer) -> ResumeResult:
        """Restore the run's latest bundle (every layer; a test may restore fewer)."""
        return checkpointer.resume()

    def after_step(self, *, epoch: int, batches: int) -> None:
        """At a step boundary (the step logged and evaluated): save if the policy says so,
        or, after SIGTERM, save and exit."""
        assert self.checkpointer is not None and self.trainer is not None
        counters = self.checkpointer.counters
        counters.step = self.trainer.state.global_step
        counters.epoch, counters.batch = epoch, batches
        # The loss summed since the last log (reset in place there): what a resume compares.
        self.checkpointer.step_done(self.trainer._tr_loss.detach().clone())
        self.checkpointer.maybe_save()

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.checkpointer is not None:
            self.checkpointer.end()
        self.close()

    def close(self, *, failed: bool = False) -> None:
        """Wait for the save in flight and release the checkpointer (idempotent)."""
        checkpointer, self.checkpointer = self.checkpointer, None
        if checkpointer is None:
            return
        try:
            if failed:
                checkpointer.end("failed")
        finally:
            checkpointer.close()


def _train_sampler(loader: DataLoader[Any]) -> ResumableSampler:
    """The loader's ``ResumableSampler``: accelerate's loader passes a batch sampler built
    over it (its own ``sampler`` is then a placeholder)."""
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    if not isinstance(sampler, ResumableSampler):
        raise ValueError(
            f"the Trainer's training sampler is a {type(sampler).__name__}; CheckpointMixin "
            "replaces it with ckpt's ResumableSampler (a map-style dataset with a length is "
            "needed: an IterableDataset cannot resume mid-epoch without loading what it skips)"
        )
    return sampler


def _own_generator(loader: DataLoader[Any]) -> None:
    """Give a prepared loader a generator of its own for its iterators' base seed.

    accelerate's ``DataLoaderShard`` iterates a ``base_dataloader`` inside it: that one's
    generator is the one drawn from, the shard's is the one ``skip_first_batches`` copies.
    """
    generator = torch.Generator()
    loader.generator = generator
    base = getattr(loader, "base_dataloader", None)
    if isinstance(base, DataLoader):
        base.generator = generator


if TYPE_CHECKING:
    _Base = Trainer
else:
    _Base = object


class CheckpointMixin(_Base):
    """What a Trainer needs changed to resume bit-exactly through ``CheckpointCallback``.

    Put it first: ``class MyTrainer(CheckpointMixin, SFTTrainer): ...``.

    - The training sampler is ckpt's ``ResumableSampler`` seeded from ``args.data_seed``
      (else ``args.seed``): each epoch's order comes from (seed, epoch) alone, where the
      Trainer's ``RandomSampler`` draws its seed from the global RNG.
    - The training loader gets a generator of its own, seeded from (seed, epoch) at each
      epoch: creating an iterator draws the workers' base seed from it instead of from the
      global RNG, which a resume restores and a second iterator would shift.
    - ``train()`` resumes from the run's bundle, never from ``resume_from_checkpoint``. The
      epochs before the bundle's are passed over (callbacks still see their
      ``on_epoch_begin``: the Trainer's loop calls it before ``_run_epoch``). In the
      bundle's epoch the Trainer goes on at the next optimizer step with
      ``state.global_step``, ``state.epoch`` and its micro step count right: it is told
      to resume there (``RESUMED_BY_CKPT``) and drops the batches consumed before by index
      (accelerate's ``SkipBatchSampler``), so no sample of them is loaded, and its RNG
      reload does nothing (``_load_rng_state``): the rng layer is already in place.
    - Evaluation loaders get a generator of their own too: an evaluation draws nothing from
      the global RNG, so the one ``eval_on_start`` runs again after a resume shifts nothing.
    - A save is considered after each step's log, evaluation and save
      (``_maybe_log_save_evaluate``): the bundle then carries that step's log entry.
    """

    def _checkpoint_callback(self) -> CheckpointCallback:
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, CheckpointCallback):
                return callback
        raise ValueError(
            "CheckpointMixin needs a CheckpointCallback: "
            "Trainer(..., callbacks=[CheckpointCallback(...)])"
        )

    def _data_seed(self) -> int:
        seed = self.args.data_seed
        return int(self.args.seed if seed is None else seed)

    def train(self, *args: Any, **kwargs: Any) -> TrainOutput:
        """``Trainer.train``, resumed from the run's latest bundle (not from a directory)."""
        if (args[0] if args else kwargs.get("resume_from_checkpoint")) not in (None, False):
            raise ValueError(
                "ckpt resumes from the run's latest bundle by itself: call train() without "
                "resume_from_checkpoint"
            )
        if self.args.ignore_data_skip:
            raise ValueError(
                "ignore_data_skip=True would start a resumed epoch over from its first batch; "
                "ckpt resumes where the bundle left off: leave it False"
            )
        callback = self._checkpoint_callback()
        callback.trainer = self
        try:
            output: TrainOutput = super().train(*args, **kwargs)
        except Exception:
            callback.close(failed=True)
            raise
        finally:
            callback.close()  # also after the SystemExit of a preemption: the signals go back
        return output

    def _get_train_sampler(self, train_dataset: Dataset[Any] | None = None) -> Sampler[Any] | None:
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.world_size > 1:
            raise ValueError(
                "CheckpointMixin supports a single training process so far "
                f"(this job has {self.args.world_size})"
            )
        if dataset is None or not hasattr(dataset, "__len__"):
            default: Sampler[Any] | None = super()._get_train_sampler(train_dataset)
            return default  # refused at on_train_begin
        strategy = self.args.train_sampling_strategy
        if strategy not in ("random", "sequential"):
            raise ValueError(
                f"train_sampling_strategy={strategy!r} cannot resume through ckpt yet; use "
                "'random' or 'sequential' (both through ResumableSampler)"
            )
        return ResumableSampler(dataset, seed=self._data_seed(), shuffle=strategy == "random")

    def get_train_dataloader(self) -> DataLoader[Any]:
        loader: DataLoader[Any] = super().get_train_dataloader()
        _own_generator(loader)  # seeded per epoch in _run_epoch
        return loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader[Any]:
        # An evaluation then draws nothing from the global RNG (an iterator's base seed
        # would), so one that runs again after a resume (eval_on_start) shifts nothing.
        loader: DataLoader[Any] = super().get_eval_dataloader(eval_dataset)
        _own_generator(loader)
        return loader

    def _run_epoch(self, *args: Any, **kwargs: Any) -> None:
        # The Trainer passes every argument by keyword (transformers 5); some are changed here.
        if args:
            raise TypeError("CheckpointMixin expects the Trainer to call _run_epoch by keyword")
        callback = self._checkpoint_callback()
        if kwargs["resume_from_checkpoint"] is not None:
            raise ValueError("ckpt resumes by itself: train() without resume_from_checkpoint")
        epoch: int = kwargs["epoch"]
        per_epoch: int = kwargs["num_update_steps_per_epoch"]
        self._epoch_shape = (epoch, int(kwargs["steps_in_epoch"]), per_epoch)
        if callback.resuming:
            if self.state.global_step >= self.state.max_steps:  # a finished run, restarted
                self.control.should_training_stop = True
                return
            resumed_epoch, updates = divmod(self.state.global_step, per_epoch)
            if epoch < resumed_epoch:
                return  # trained before the bundle
            callback.resuming = False
            if updates > 0:
                kwargs["resume_from_checkpoint"] = RESUMED_BY_CKPT
                kwargs["epochs_trained"] = epoch
                kwargs["steps_trained_in_current_epoch"] = (
                    updates * self.args.gradient_accumulation_steps
                )
        generator = kwargs["train_dataloader"].generator
        if generator is not None:
            generator.manual_seed(mix_seed(self._data_seed(), epoch, 2))
        run_epoch: Callable[..., None] = super()._run_epoch  # untyped in transformers
        run_epoch(**kwargs)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint != RESUMED_BY_CKPT:
            super()._load_rng_state(checkpoint)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)
        epoch, steps_in_epoch, per_epoch = self._epoch_shape
        updates = self.state.global_step - epoch * per_epoch
        batches = min(updates * self.args.gradient_accumulation_steps, steps_in_epoch)
        self._checkpoint_callback().after_step(epoch=epoch, batches=batches)


class CheckpointTrainer(CheckpointMixin, Trainer):
    """``transformers.Trainer`` with ``CheckpointMixin``."""
