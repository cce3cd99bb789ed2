"""When a per-step ``maybe_save`` call saves: every N optimizer steps and/or every T seconds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Position:
    """Where in the run a save lands; positions order by (step, micro step)."""

    step: int
    micro_step: int

    def __str__(self) -> str:
        """``step 50``, or ``step 50, micro step 2`` in the middle of an accumulation."""
        return f"step {self.step}" + (f", micro step {self.micro_step}" if self.micro_step else "")


@dataclass(frozen=True)
class SavePolicy:
    every_steps: int | None = None
    every_seconds: float | None = None

    def due(self, position: Position, *, last: Position | None, seconds_since_last: float) -> bool:
        """Whether to save at ``position``, given the last save (None: none this attempt)."""
        if position == last:
            return False
        by_steps = (
            self.every_steps is not None
            and position.micro_step == 0
            and position.step > 0
            and position.step % self.every_steps == 0
            and (last is None or position.step > last.step)
        )
        by_time = (
            self.every_seconds is not None
            and seconds_since_last >= self.every_seconds
            and (last is None or position.step > last.step)  # the policy saves a step once
        )
        return by_steps or by_time
