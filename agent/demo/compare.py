"""Compare a resumed run's final state with an uninterrupted run's, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

RECORDS = ("positions", "losses", "record_lrs")  # what each attempt trained, micro-batch by one


def _tensor_differences(
    what: str, reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]
) -> list[str]:
    if reference.keys() != other.keys():
        return [f"{what}: different entries"]
    return [
        f"{what} {name} differs"
        for name in reference
        if not torch.equal(reference[name], other[name])
    ]


def differences(reference: dict[str, Any], resumed: dict[str, Any]) -> list[str]:
    """What differs between the runs (empty when bit-identical).

    ``resumed`` ran only the part after its bundle, so its per-micro-batch records must
    equal the tail of the reference's.
    """
    found = _tensor_differences("parameter/buffer", reference["model"], resumed["model"])
    found += _tensor_differences("optimizer state", reference["optimizer"], resumed["optimizer"])
    for key in ("lr", "scaler"):
        if reference[key] != resumed[key]:
            found.append(f"{key}: {reference[key]} != {resumed[key]}")
    count = len(resumed["positions"])
    if count == 0 or count > len(reference["positions"]):
        return [*found, f"the resumed run recorded {count} micro-batches"]
    if reference["positions"][-count:] != resumed["positions"]:
        found.append("the resumed run's (step, micro step) sequence differs")
    elif not torch.equal(reference["losses"][-count:], resumed["losses"]):
        found.append("the per-micro-batch loss sequence differs")
        found.append(_first_divergence(reference["losses"][-count:], resumed))
    if reference["record_lrs"][-count:] != resumed["record_lrs"]:
        found.append("the per-step learning rates differ")
    return found


def _first_divergence(expected: torch.Tensor, resumed: dict[str, Any]) -> str:
    """Where the resumed losses first leave the reference's: at the first micro-batch after
    the bundle, the resume restored something else; later, something drifted."""
    first = int((expected != resumed["losses"]).nonzero()[0, 0])
    return (
        f"first at micro-batch {first} of the resume, position {resumed['positions'][first]}: "
        f"{float(expected[first])!r} != {float(resumed['losses'][first])!r}"
    )


def save_final(state: dict[str, Any], path: Path | str) -> None:
    """Write an attempt's final state to ``path``, where the attempt before wrote its own.

    An attempt that trained nothing (the run had finished: a stop signal reached its last
    attempt on the way out, and a supervisor restarted it) keeps the records of the attempt
    before: the run is judged on its final state and on the micro-batches of the last
    attempt that trained, however many attempts there were.
    """
    if not state["positions"] and Path(path).exists():
        before = torch.load(path, weights_only=True)
        state = {**state, **{key: before[key] for key in RECORDS}}
    torch.save(state, path)
