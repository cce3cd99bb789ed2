"""Figures in words for the pages: sizes, ages, ratios, timestamps. Pure, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any


def size(value: int | None) -> str:
    """1.5 GiB, 320 KiB, 12 B."""
    if value is None:
        return "—"
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(amount) < 1024 or unit == "TiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def age(moment: datetime | None, now: datetime) -> str:
    """How long ago: 40 s, 12 min, 3 h, 2 d."""
    if moment is None:
        return "—"
    seconds = max(0, int((now - moment).total_seconds()))
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds // length} {unit} ago"
    return f"{seconds} s ago"


def percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def moment(value: datetime | None) -> str:
    """A UTC timestamp to the second."""
    return "—" if value is None else f"{value:%Y-%m-%d %H:%M:%S}Z"


def seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f} s"


def duration(value: float | None) -> str:
    """An interval in the unit that reads best: 45 s, 12.5 min, 2.2 h."""
    if value is None:
        return "—"
    if value < 60:
        return f"{value:.0f} s"
    if value < 3600:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def verdict(verification: Mapping[str, Any]) -> str:
    """A resume's verdict in a sentence (an attempt's ``verification``)."""
    first, steps = verification.get("first_difference"), verification["steps_compared"]
    if first is not None:
        micro = f".{first['micro_step']}" if first["micro_step"] else ""
        text = (
            f"resume diverged at step {first['step']}{micro} (rank {first['rank']}): "
            f"{first['part']} {first['got']}, expected {first['expected']}"
        )
    elif verification["verdict"] == "verified":
        text = f"resume verified over {steps} replayed steps"
    else:
        text = "resume unverifiable: it replayed no step the attempt before it computed"
    largest = verification.get("max_relative_difference")
    if verification.get("mode") == "tolerance" and largest is not None:
        text += f" (tolerance mode, largest relative difference {largest:.3g})"
    detail = verification.get("detail")
    return f"{text}. {detail}" if detail else text


def maybe(value: object) -> str:
    return "—" if value is None else str(value)


FILTERS = {
    "size": size,
    "age": age,
    "percent": percent,
    "moment": moment,
    "seconds": seconds,
    "duration": duration,
    "maybe": maybe,
}
