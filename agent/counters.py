"""The run's counters: the sixth layer, owned by the checkpointer, advanced by the loop."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ckpt.core.errors import UnrepresentableStateError


@dataclass
class Counters:
    """Where the run is. The loop advances ``step``, ``micro_step``, ``samples``, ``tokens``
    and ``extras``; ``Checkpointer.batches`` advances ``epoch`` and ``batch``.

    Attributes:
        epoch: the current epoch (0-based).
        step: optimizer steps taken.
        micro_step: micro-batches accumulated since the last optimizer step.
        batch: batches consumed in the current epoch.
        samples: samples seen (the loop's own count).
        tokens: tokens seen (the loop's own count).
        extras: anything else the loop wants back, as JSON values.
    """

    epoch: int = 0
    step: int = 0
    micro_step: int = 0
    batch: int = 0
    samples: int = 0
    tokens: int = 0
    extras: dict[str, Any] = field(default_factory=dict)

    def to_state(self) -> dict[str, Any]:
        """A JSON-ready copy; raises ``UnrepresentableStateError`` if an extra is not JSON."""
        state = asdict(self)
        for name in state.keys() - {"extras"}:
            if type(state[name]) is not int:
                raise UnrepresentableStateError(
                    f"counters/{name} must be an int, not {state[name]!r}"
                )
        if not all(isinstance(key, str) for key in self.extras):
            raise UnrepresentableStateError("counters/extras keys must be strings")
        try:
            return dict(json.loads(json.dumps(state, allow_nan=False)))
        except (TypeError, ValueError) as err:
            raise UnrepresentableStateError(f"counters/extras must be JSON values: {err}") from err

    def load_state(self, state: dict[str, Any]) -> None:
        names = {item.name for item in fields(self)}
        if set(state) != names:
            raise ValueError(f"counters state has keys {sorted(state)}, expected {sorted(names)}")
        for name in names - {"extras"}:
            if type(state[name]) is not int:
                raise ValueError(f"counters state: {name} must be an int, not {state[name]!r}")
            setattr(self, name, state[name])
        if not isinstance(state["extras"], dict):
            raise ValueError("counters state: extras must be a dict")
        self.extras = dict(state["extras"])
