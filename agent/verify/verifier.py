"""Fingerprint the steps; after a resume, compare the replayed steps with the dead attempt's.

The loop tells the verifier where it is (``Checkpointer.maybe_save``, ``step_done``). At the
positions both attempts pick alike (``cadence``: those of every ``verify_every_steps``-th
step and of the first steps after each save and resume) it keeps the loss the loop
reports, and after an optimizer step the parameters' sample. After a resume the ranks
agree on the end of the replay window (the newest position any rank's predecessor kept);
at the first ``maybe_save`` there, or at ``end()`` before it, the ranks gather their
comparisons once and rank 0 reports the verdict.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from agent.catalog.base import Catalog
from agent.config import Config
from agent.ranks.base import MEET_SECONDS, Ranks
from agent.save.policy import Position
from agent.state.objects import TrainingObjects
from agent.summary import announce
from agent.verify.cadence import fingerprinted
from agent.verify.compare import (
    Fingerprint,
    Mode,
    Place,
    RankComparison,
    Verdict,
    Verification,
    compare,
    reduce,
)
from agent.verify.digest import ParamSample
from agent.verify.keep import Keeper, open_keeper
from agent.verify.ring import Ring
from ckpt.core.errors import CkptError, ResumeDivergedError
from ckpt.core.storage import ObjectStore

log = logging.getLogger("ckpt")


class Verifier:
    """One process's fingerprints and, after a resume, its verdict."""

    def __init__(
        self,
        *,
        run: str,
        mode: Mode | None,
        every_steps: int,
        stop: bool,
        models: Mapping[str, nn.Module],
        optimizers: Iterable[torch.optim.Optimizer],
        ranks: Ranks,
        keeper: Callable[[Ring], Keeper],
        durable: Callable[[], Position | None],
        quiet: bool,
    ) -> None:
        self._run, self._mode, self._stop, self._ranks, self._quiet = run, mode, stop, ranks, quiet
        self._durable, self._every = durable, every_steps
        self.ring = Ring()
        self._keeper = keeper(self.ring) if mode is not None else None
        self._sample = ParamSample(models if mode is not None else {})
        optimizers = list(optimizers) if mode is not None else []
        self._hooks = [each.register_step_post_hook(self._stepped) for each in optimizers]
        self._by_step = not optimizers  # without optimizers: a new step is a new state
        self._pending_step = False
        self._last_step: int | None = None
        self._anchor: int | None = None  # the step of this attempt's last save or resume
        self._idle: int | None = None  # a step found not fingerprinted (until a save)
        self._dropped: Position | None = None  # the durable position the ring forgot up to
        self._expected: list[Fingerprint] = []  # the dead attempt's fingerprints this rank replays
        self._window_end: Place | None = None  # the ranks' newest such position
        self._from_attempt: int | None = None
        self.verification: Verification | None = None

    def _stepped(self, *_: object) -> None:
        self._pending_step = True

    def record(self, position: Position, *, loss: torch.Tensor | float | None = None) -> None:
        """Fingerprint ``position`` where its step is fingerprinted (``cadence``): the loss,
        if given, and the parameters' sample when an optimizer stepped since the last
        position. Runs once or twice per micro-batch: the common case returns at once."""
        step = position.step
        if step == self._idle and not self._pending_step:
            return  # a step already found not fingerprinted
        if self._mode is None:
            return
        stepped = self._pending_step or (self._by_step and step != self._last_step)
        if stepped:
            self._pending_step, self._last_step = False, step
        if not fingerprinted(step, every=self._every, anchor=self._anchor):
            self._idle = step
            return
        self._forget_durable()
        sample = self._sample.take() if stepped else None
        if sample is not None or loss is not None:
            self.ring.record((step, position.micro_step), sample=sample, loss=loss)

    def saved(self, position: Position) -> None:
        """This attempt saves at ``position`` (every rank): the steps after it are
        fingerprinted, as the attempt that resumes from it fingerprints them."""
        self._anchor, self._idle = position.step, None

    def _forget_durable(self) -> None:
        """Drop the positions up to the newest durable bundle (no resume goes before it)."""
        durable = self._durable()
        if durable is not None and durable != self._dropped:
            self.ring.drop_through((durable.step, durable.micro_step))
            self._dropped = durable

    def at(self, position: Position) -> None:
        """The loop reached ``position`` on every rank (``maybe_save``): fingerprint it, and
        conclude the replay where its window ends.

        Raises:
            ResumeDivergedError: it diverged, with ``CKPT_VERIFY_STOP`` set.
        """
        self.record(position)
        if (
            self._window_end is not None
            and (position.step, position.micro_step) >= self._window_end
        ):
            self.conclude()

    def resumed(self, position: Position) -> None:
        """This attempt resumed its run at ``position`` (every rank): read what the dead
        attempt computed after it and agree on where the replay ends."""
        if self._keeper is None:
            return
        self.ring.clear()
        self._pending_step, self._last_step = False, position.step
        self.saved(position)  # fingerprinted after it, as the interrupted attempt did
        place = (position.step, position.micro_step)
        try:
            self._from_attempt, self._expected = self._keeper.replay(place)
        except (CkptError, ValueError) as err:
            log.warning(
                "run %s: cannot read the interrupted attempt's fingerprints: %s", self._run, err
            )
            self._from_attempt, self._expected = None, []
        ends = self._ranks.gather(
            self._expected[-1].place if self._expected else None, timeout=MEET_SECONDS
        )
        self._window_end = max((end for end in ends if end is not None), default=None)
        if self._window_end is None:  # nothing to replay: reported, not printed
            self.conclude(printed=False)

    def conclude(self, *, printed: bool = True) -> None:
        """Compare the replay so far on every rank (a meeting); rank 0 reports the verdict
        (and prints it, unless ``printed`` is false and it is not a divergence)."""
        self._window_end = None
        assert self._mode is not None and self._keeper is not None
        got = {each.place: each for each in self.ring.snapshot()}
        mine = compare(self._expected, got, rank=self._ranks.rank, mode=self._mode)
        everyone: list[tuple[RankComparison, int | None]] = self._ranks.gather(
            (mine, self._from_attempt), timeout=MEET_SECONDS
        )
        source = next((attempt for _, attempt in everyone if attempt is not None), None)
        verification = reduce(
            [each for each, _ in everyone], mode=self._mode, from_attempt_id=source
        )
        self.verification, self._expected = verification, []
        if self._ranks.rank == 0:
            self._tell(verification, printed=printed)
        if verification.verdict is Verdict.DIVERGED and self._stop:
            raise ResumeDivergedError(
                f"run {self._run}: the resume {verification} (CKPT_VERIFY_STOP stops here)"
            )

    def _tell(self, verification: Verification, *, printed: bool) -> None:
        line = f"ckpt: run {self._run}: resume {verification}"
        if verification.verdict is Verdict.DIVERGED:
            log.warning("%s", line)
        elif printed:
            announce(line, quiet=self._quiet)
        else:
            log.info("%s", line)
        try:
            assert self._keeper is not None
            self._keeper.report(verification)
        except CkptError as err:
            log.warning("run %s: could not record the resume's verdict: %s", self._run, err)

    def flush(self) -> None:
        """Keep the fingerprints recorded so far where the next attempt reads them."""
        try:
            if self._keeper is not None:
                self._keeper.flush()
        except CkptError as err:
            log.warning("run %s: could not keep the fingerprints: %s", self._run, err)

    def finish(self) -> None:
        """The attempt ends (every rank): conclude a replay cut short, keep the rest."""
        if self._window_end is not None:
            self.conclude()
        self.flush()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._keeper is not None:
            self._keeper.close()


def open_verifier(
    config: Config,
    *,
    objects: TrainingObjects,
    ranks: Ranks,
    catalog: Catalog,
    store: ObjectStore,
    durable: Callable[[], Position | None],
) -> Verifier:
    """The verifier ``config.verify`` asks for, keeping fingerprints where the catalog is
    (``durable``: the newest durable bundle's position)."""
    keeper = open_keeper(
        catalog, store=store, run=config.run, rank=ranks.rank, seconds=config.heartbeat_seconds
    )
    return Verifier(
        run=config.run,
        mode=Mode.parse(config.verify),
        every_steps=config.verify_every_steps,
        stop=config.verify_stop,
        models=objects.models,
        optimizers=objects.optimizers.values(),
        ranks=ranks,
        keeper=keeper,
        durable=durable,
        quiet=config.quiet,
    )
