"""The colours the run page's pictures are drawn in, and their contrast (WCAG 2.x).

Every colour a mark, line or text of a picture is drawn in is named here; the pictures set
them as SVG presentation attributes, so what the browser paints is what these say. Marks
and lines need 3:1 against the page's background, text 4.5:1 (WCAG AA, non-text and text
contrast); the few decorative fills (a grid line, a band's inside) are listed apart, each
beside a line that carries its meaning.
"""

from __future__ import annotations

BACKGROUND = "#ffffff"

INK = "#1d2330"
MUTED = "#57606a"  # secondary text: lane details, axis values

# A bundle's status.
STATUS = {
    "complete": "#1a7f37",
    "pending": "#9a6700",
    "quarantined": "#cf222e",
    "failed": "#6e7781",
    "collected": "#6e7781",
}
# How an attempt ended (running: not yet).
ENDED = {
    "running": "#0969da",
    "replaced": "#6e7781",
    "preempted": "#8250df",
    "lost": "#bc4c00",
    "failed": "#24292f",
    "finished": "#1b7c83",
}
# A resumed attempt's verdict on the steps it replayed (diverged: loud).
VERDICT = {"verified": "#1a7f37", "diverged": "#cf222e", "unverifiable": "#6e7781"}
LOST_EDGE = "#bc4c00"  # the outline of a band of steps lost
RESUME_EDGE = "#0969da"
SERIES = "#0969da"  # the save figures' lines
AXIS = "#57606a"  # tick marks, a panel's baseline

# Decorative: each sits behind or beside a line above that carries its meaning.
GRID = "#e6e9ee"
LOST_FILL = "#ffe3cc"

TEXT = {"ink": INK, "muted": MUTED}
GRAPHICS = {
    **{f"status-{name}": colour for name, colour in STATUS.items()},
    **{f"ended-{name}": colour for name, colour in ENDED.items()},
    **{f"verdict-{name}": colour for name, colour in VERDICT.items()},
    "lost-edge": LOST_EDGE,
    "resume-edge": RESUME_EDGE,
    "series": SERIES,
    "axis": AXIS,
    "ink": INK,
}


def luminance(colour: str) -> float:
    """The relative luminance of ``#rrggbb`` (WCAG 2.x)."""
    digits = colour.removeprefix("#")
    channels = [int(digits[i : i + 2], 16) / 255 for i in (0, 2, 4)]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(first: str, second: str) -> float:
    """The contrast ratio of two colours, 1 to 21."""
    darker, lighter = sorted((luminance(first), luminance(second)))
    return (lighter + 0.05) / (darker + 0.05)
