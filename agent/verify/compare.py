"""Whether the steps a resumed attempt replayed match what the attempt before it computed.

Pure: fingerprints in, a verdict out; no torch, no I/O. Each rank compares its own
fingerprints (``compare``); the ranks' answers reduce to the attempt's one verdict
(``reduce``), which says where the first difference is and which layer likely caused it.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_PARTS = 8
_PART_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_PART_CHARS = 128
MAX_DETAIL_CHARS = 500

PARAMS = "params"  # the part that digests the parameters' sample (``agent.verify.digest``)

Place = tuple[int, int]  # (step, micro step): positions order as tuples


@dataclass(frozen=True)
class Fingerprint:
    """What one rank computed at one position: the loss it reported and digests of its state."""

    step: int
    micro_step: int = 0
    loss: float | None = None  # finite, or None (none reported, or not finite: see parts)
    parts: Mapping[str, str] = field(default_factory=dict)

    @property
    def place(self) -> Place:
        return (self.step, self.micro_step)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "micro_step": self.micro_step,
            "loss": self.loss,
            "parts": dict(self.parts),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fingerprint:
        """Parse one as stored or served; ``ValueError`` saying what is wrong."""
        try:
            step, micro_step = int(data["step"]), int(data.get("micro_step", 0))
            loss = data.get("loss")
            parts = {str(name): str(value) for name, value in dict(data.get("parts", {})).items()}
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed fingerprint {data!r}: {err}") from err
        if step < 0 or micro_step < 0 or len(parts) > MAX_PARTS:
            raise ValueError(f"malformed fingerprint {data!r}")
        if loss is not None and not (isinstance(loss, int | float) and math.isfinite(loss)):
            raise ValueError(f"malformed fingerprint {data!r}: the loss must be finite")
        if not all(_PART_NAME.fullmatch(n) and len(v) <= MAX_PART_CHARS for n, v in parts.items()):
            raise ValueError(f"malformed fingerprint {data!r}: a part's name or value")
        return cls(step, micro_step, None if loss is None else float(loss), parts)


class Verdict(enum.StrEnum):
    VERIFIED = "verified"  # every replayed step equal (bit for bit, or within the tolerance)
    DIVERGED = "diverged"  # some replayed step differs: ``first_difference`` says where
    UNVERIFIABLE = "unverifiable"  # no replayed step to compare


@dataclass(frozen=True)
class Mode:
    """Exact (``tolerance`` None: every part equal, bit for bit) or within a relative tolerance
    (only the numeric parts and the loss are compared)."""

    tolerance: float | None = None

    @property
    def name(self) -> str:
        return "exact" if self.tolerance is None else "tolerance"

    @classmethod
    def parse(cls, text: str) -> Mode | None:
        """``exact``, ``tolerance:1e-6`` or ``off`` (None); ``ValueError`` for anything else."""
        kind, _, value = text.strip().lower().partition(":")
        if kind in ("exact", "off") and not value:
            return cls() if kind == "exact" else None
        try:
            tolerance = float(value) if kind == "tolerance" else math.nan
        except ValueError:
            tolerance = math.nan
        if not 0 <= tolerance < 1:
            raise ValueError(
                f"verify (CKPT_VERIFY) must be exact, off or tolerance:<relative difference "
                f"from 0 to 1, e.g. tolerance:1e-6>, got {text!r}"
            )
        return cls(tolerance)


@dataclass(frozen=True)
class Difference:
    """The first place where the replay differs: what the dead attempt computed, what this got."""

    step: int
    micro_step: int
    rank: int
    part: str
    expected: str
    got: str

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "micro_step": self.micro_step,
            "rank": self.rank,
            "part": self.part,
            "expected": self.expected,
            "got": self.got,
        }


@dataclass(frozen=True)
class RankComparison:
    """One rank's comparison of the positions it replayed."""

    rank: int
    compared: frozenset[Place]  # positions where both attempts kept a part: the loss, a sample
    first_replayed: Place | None  # the first position after the resume the dead attempt kept
    sampled: frozenset[Place] = frozenset()  # those of them compared by the parameters' sample
    difference: Difference | None = None
    loss_differs: bool = False  # at the first difference
    loss_compared: bool = True  # there: both sides reported a loss
    max_relative_difference: float | None = None


@dataclass(frozen=True)
class Verification:
    """What a resumed attempt's replay proved (the wire's ``Verification``)."""

    verdict: Verdict
    mode: str
    steps_compared: int
    from_attempt_id: int | None = None
    steps_sampled: int = 0  # of those compared, with the parameters' sample (said in ``detail``)
    first_difference: Difference | None = None
    max_relative_difference: float | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        difference = self.first_difference
        return {
            "verdict": str(self.verdict),
            "mode": self.mode,
            "steps_compared": self.steps_compared,
            "from_attempt_id": self.from_attempt_id,
            "first_difference": None if difference is None else difference.to_json(),
            "max_relative_difference": _finite(self.max_relative_difference),
            "detail": self.detail[:MAX_DETAIL_CHARS],
        }

    def __str__(self) -> str:
        """``verified over 37 replayed steps``, ``diverged at step 1204 (loss ...)``..."""
        if self.verdict is Verdict.DIVERGED and self.first_difference is not None:
            first = self.first_difference
            where = f"step {first.step}" + (f".{first.micro_step}" if first.micro_step else "")
            return (
                f"diverged at {where} on rank {first.rank}: {first.part} {first.got} where the "
                f"interrupted attempt had {first.expected}; {self.detail}"
            )
        if self.verdict is Verdict.VERIFIED:
            exactly = "bit for bit" if self.mode == "exact" else "within the tolerance"
            largest = self.max_relative_difference
            spread = "" if largest is None else f", largest relative difference {largest:.3g}"
            said = f": {self.detail}" if self.detail else ""
            return f"verified {exactly} over {self.steps_compared} replayed steps{spread}{said}"
        return f"unverifiable: {self.detail}"


def compare(
    expected: Iterable[Fingerprint], got: Mapping[Place, Fingerprint], *, rank: int, mode: Mode
) -> RankComparison:
    """Compare each expected fingerprint with the replay's at its position: the parts both
    kept there (a position where they share none compares nothing)."""
    ordered = sorted(expected, key=lambda print_: print_.place)
    first = ordered[0].place if ordered else None
    compared: set[Place] = set()
    sampled: set[Place] = set()
    largest: float | None = None if mode.tolerance is None else 0.0
    for before in ordered:
        now = got.get(before.place)
        if now is None:
            continue
        old, new = _values(before), _values(now)
        shared = [name for name in old if name in new]
        if not shared:
            continue
        compared.add(before.place)
        if PARAMS in shared:
            sampled.add(before.place)
        differing, relative = _differences(shared, old, new, mode)
        if relative is not None and largest is not None:
            largest = max(largest, relative)
        if differing:
            part = differing[0]
            return RankComparison(
                rank,
                frozenset(compared),
                first,
                frozenset(sampled),
                Difference(*before.place, rank, part, old[part], new[part]),
                loss_differs="loss" in differing,
                loss_compared="loss" in shared,
                max_relative_difference=largest,
            )
    return RankComparison(
        rank, frozenset(compared), first, frozenset(sampled), max_relative_difference=largest
    )


def reduce(
    comparisons: Sequence[RankComparison], *, mode: Mode, from_attempt_id: int | None
) -> Verification:
    """Every rank's comparison into the attempt's verdict: diverged where any rank differs
    (the first position, then the lowest rank), unverifiable where none compared anything."""
    compared = set().union(*(each.compared for each in comparisons))
    sampled = set().union(*(each.sampled for each in comparisons))
    spreads = [
        c.max_relative_difference for c in comparisons if c.max_relative_difference is not None
    ]
    verification = functools.partial(
        Verification,
        mode=mode.name,
        steps_compared=len(compared),
        from_attempt_id=from_attempt_id,
        steps_sampled=len(sampled),
        max_relative_difference=max(spreads) if spreads and compared else None,
    )
    firsts = [each.first_replayed for each in comparisons if each.first_replayed is not None]
    diverged = [each for each in comparisons if each.difference is not None]
    if diverged:
        worst = min(diverged, key=lambda each: (_place(each.difference), each.rank))
        at_first = _place(worst.difference) == min(firsts)
        return verification(
            Verdict.DIVERGED,
            first_difference=worst.difference,
            detail=likely_layer(worst, at_first=at_first),
        )
    if not compared:
        return verification(Verdict.UNVERIFIABLE, detail=_nothing_compared(kept=bool(firsts)))
    return verification(
        Verdict.VERIFIED,
        detail=f"{len(sampled)} of the {len(compared)} compared positions carried the "
        "parameters' sample",
    )


def _nothing_compared(*, kept: bool) -> str:
    """Why an unverifiable verdict compared nothing: the interrupted attempt kept nothing
    after the bundle (``kept`` false), or nothing this attempt replayed alike."""
    if not kept:
        return (
            "no replayed step to compare: the interrupted attempt kept no fingerprint after "
            "the bundle this attempt resumed from (it died right after that save)"
        )
    return (
        "no replayed position carried a part both attempts kept (a loss, or the parameters' "
        "sample, at the same position): do both report the loss alike, with the same "
        "verify_every_steps (CKPT_VERIFY_EVERY_STEPS)?"
    )


def likely_layer(comparison: RankComparison, *, at_first: bool) -> str:
    """A sentence naming the layer a divergence most likely comes from."""
    if not comparison.loss_compared:
        return (
            "the parameters differ where no loss was reported: the data, rng or optimizer "
            "layer (report the loss with step_done(loss) to tell them apart)"
        )
    if not comparison.loss_differs:
        return (
            "the loss matches but the parameters differ: likely the optimizer layer (its "
            "moments, step count, or the scheduler's or scaler's state)"
        )
    if at_first:
        return (
            "the loss differs at the first replayed step: likely the data or rng layer (a "
            "random source not captured, a data position that did not resume) or "
            "the weights"
        )
    return (
        "the loss first differs after some equal steps: likely a nondeterministic kernel, or "
        "a random source used only now and then"
    )


def _place(difference: Difference | None) -> Place:
    assert difference is not None
    return (difference.step, difference.micro_step)


def _values(print_: Fingerprint) -> dict[str, str]:
    """The fingerprint's comparable values: the loss first, then its parts by name."""
    loss = {} if print_.loss is None else {"loss": repr(print_.loss)}
    return loss | dict(sorted(print_.parts.items()))


def _differences(
    shared: Sequence[str], before: Mapping[str, str], now: Mapping[str, str], mode: Mode
) -> tuple[list[str], float | None]:
    """The names of the ``shared`` parts that differ, and in tolerance mode the largest
    relative difference of the numeric ones."""
    if mode.tolerance is None:
        return [name for name in shared if before[name] != now[name]], None
    largest, differing = 0.0, []
    for name in shared:
        relative = _relative(_number(name, before[name]), _number(name, now[name]))
        if relative is None:
            continue  # a digest: no distance to measure
        largest = max(largest, relative)
        if relative > mode.tolerance:
            differing.append(name)
    return differing, largest


def _relative(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def _number(name: str, text: str) -> float | None:
    """The loss (``repr``) or a part written by ``float.hex``; None for a digest."""
    if name != "loss" and "0x" not in text and text.lstrip("-") not in ("inf", "nan"):
        return None
    try:
        return float(text) if name == "loss" else float.fromhex(text)
    except ValueError:
        return None


def _finite(value: float | None) -> float | None:
    """None for no value or one past every float (a side that was not finite)."""
    return value if value is not None and math.isfinite(value) else None
