"""The run page's save figures as SVG text: five small panels over the steps, each with its
values' range (min and max) and the steps it spans, so that a printed page reads too; hovering
a panel says what its figure is.

Pure functions over plain data, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from service.ui import palette
from service.ui.marks import DETAIL_FONT, FONT

WIDTH = 1160
LABEL_WIDTH = 150
RIGHT_MARGIN = 24
PANEL_HEIGHT = 56
PANEL_GAP = 18
STEPS_HEIGHT = 22  # the step range under the panels


@dataclass(frozen=True)
class SavePoint:
    """One bundle's save figures: the slowest rank's stall, save tax and persist seconds, the
    payload it wrote per second of persist, and the new bytes all ranks uploaded."""

    step: int
    stall_seconds: float
    tax_seconds: float | None  # None: no rank knew it
    persist_seconds: float
    throughput: float  # bytes per second
    new_bytes: int


SERIES = (  # name, label, what the figure is (the panel's tooltip)
    ("stall", "stall s", "stall: the seconds training waited in save() and the next step"),
    (
        "tax",
        "save tax s",
        "save tax: the training loop's extra time from save() until durable, the stall "
        "included (a bundle whose ranks did not know it is left out)",
    ),
    ("persist", "persist s", "persist: the seconds from the end of staging to the commit"),
    ("throughput", "throughput B/s", "throughput: payload bytes per second of persist"),
    ("new_bytes", "new bytes", "new bytes: what the ranks uploaded (the rest was stored)"),
)


def draw_saves(points: Sequence[SavePoint]) -> str:
    """The save figures over the steps: five small panels, one ``polyline`` each (through
    the bundles whose figure is known), drawn from its min (the panel's foot) to its max (its
    top), both written beside it; the step range under them."""
    height = len(SERIES) * (PANEL_HEIGHT + PANEL_GAP) + STEPS_HEIGHT
    ordered = sorted(points, key=lambda p: p.step)
    low = ordered[0].step if ordered else 0
    high = ordered[-1].step if ordered else 0
    span = max(1, high - low)
    inner = WIDTH - LABEL_WIDTH - RIGHT_MARGIN
    xs = [LABEL_WIDTH + (p.step - low) / span * inner for p in ordered]
    series: dict[str, list[float | None]] = {
        "stall": [p.stall_seconds for p in ordered],
        "tax": [p.tax_seconds for p in ordered],
        "persist": [p.persist_seconds for p in ordered],
        "throughput": [p.throughput for p in ordered],
        "new_bytes": [float(p.new_bytes) for p in ordered],
    }
    panels = [
        _panel(name, label, about, _known(xs, series[name]), row=row)
        for row, (name, label, about) in enumerate(SERIES)
    ]
    bottom = height - 6
    steps = (
        f'<g class="steps" data-low="{low}" data-high="{high}">'
        f'<text x="{LABEL_WIDTH}" y="{bottom}" font-size="{DETAIL_FONT}" '
        f'fill="{palette.MUTED}">step {low}</text>'
        f'<text x="{WIDTH - RIGHT_MARGIN}" y="{bottom}" font-size="{DETAIL_FONT}" '
        f'fill="{palette.MUTED}" text-anchor="end">step {high}</text></g>'
        if ordered
        else ""
    )
    return (
        f'<svg id="saves" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="save figures">'
        f"{''.join(panels)}{steps}</svg>"
    )


def _known(xs: list[float], values: list[float | None]) -> list[tuple[float, float]]:
    """The (x, value) of the bundles whose figure is known."""
    return [(x, value) for x, value in zip(xs, values, strict=True) if value is not None]


def _panel(name: str, label: str, about: str, known: list[tuple[float, float]], *, row: int) -> str:
    top = row * (PANEL_HEIGHT + PANEL_GAP) + 8
    low = min((value for _, value in known), default=0.0)
    high = max((value for _, value in known), default=0.0)
    span = (high - low) or 1.0
    bottom, scale = top + PANEL_HEIGHT, PANEL_HEIGHT / span
    points = " ".join(f"{x:.1f},{bottom - (value - low) * scale:.1f}" for x, value in known)
    muted = f'font-size="{DETAIL_FONT}" fill="{palette.MUTED}"'
    low_text, high_text = (_short(low), _short(high)) if known else ("—", "—")
    return (
        f'<g class="panel" data-series="{name}" data-min="{low_text}" '
        f'data-max="{high_text}" data-points="{len(known)}"><title>{escape(about)}</title>'
        f'<text x="4" y="{top + 14}" font-size="{FONT}" fill="{palette.INK}">{label}</text>'
        f'<text class="max" x="{LABEL_WIDTH - 6}" y="{top + 10}" {muted} text-anchor="end">'
        f"max {high_text}</text>"
        f'<text class="min" x="{LABEL_WIDTH - 6}" y="{bottom}" {muted} text-anchor="end">'
        f"min {low_text}</text>"
        f'<line class="baseline" x1="{LABEL_WIDTH}" y1="{bottom}" '
        f'x2="{WIDTH - RIGHT_MARGIN}" y2="{bottom}" stroke="{palette.AXIS}"/>'
        f'<polyline class="series" data-series="{name}" points="{points}" fill="none" '
        f'stroke="{palette.SERIES}" stroke-width="2"/></g>'
    )


def _short(value: float) -> str:
    """3.2k, 41M, 0.12: a figure in a few characters."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"
