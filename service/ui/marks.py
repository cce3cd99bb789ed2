"""The shapes the run page's pictures are made of, and the legend drawn with them.

A bundle's mark and an attempt's end marker are drawn here only, by ``bundle_mark`` and
``end_marker``; the lineage and the legend both call them, so the legend cannot show a mark
the picture does not draw. Each status and each ending has its own shape, not only its own
colour (``palette.py``), for readers who do not tell the colours apart, and on paper.
"""

from __future__ import annotations

import functools
from html import escape

from service.names import VERDICTS
from service.ui import palette

MARK_RADIUS = 7  # a bundle's mark: 14 px across
END_SIZE = 7  # half an end marker's side
HEAD_SIZE = 7  # half the head triangle's base
FONT = 13  # the pictures' text, in px
DETAIL_FONT = 12

# How the catalog's bundle statuses are shown.
SHOWN_STATUS = {"deleted": "collected"}
STATUSES = ("complete", "pending", "quarantined", "failed", "collected")
ENDINGS = ("running", "replaced", "preempted", "lost", "failed", "finished")


def bundle_mark(status: str, x: float, y: float, *, live: bool = True, pinned: bool = False) -> str:
    """A bundle's mark at (x, y): its status's shape (``class="mark"``), a ring when it is
    pinned, a stroke through it when it is on an abandoned branch."""
    shown = SHOWN_STATUS.get(status, status)
    colour = palette.STATUS.get(shown, palette.MUTED)
    cls = f'class="mark status-{escape(shown)}"'
    r = MARK_RADIUS
    white = f'stroke="{palette.BACKGROUND}" stroke-width="1.5"'
    if shown == "pending":  # hollow: not committed yet
        shape = (
            f'<circle {cls} cx="{x}" cy="{y}" r="{r - 1}" fill="{palette.BACKGROUND}" '
            f'stroke="{colour}" stroke-width="3"/>'
        )
    elif shown == "quarantined":  # a diamond
        shape = (
            f'<path {cls} d="M{x} {y - r - 2} l{r + 2} {r + 2} l-{r + 2} {r + 2} '
            f'l-{r + 2} -{r + 2} z" fill="{colour}" {white}/>'
        )
    elif shown == "failed":  # a hollow diamond: never committed
        shape = (
            f'<path {cls} d="M{x} {y - r} l{r} {r} l-{r} {r} l-{r} -{r} z" '
            f'fill="{palette.BACKGROUND}" stroke="{colour}" stroke-width="2.5"/>'
        )
    elif shown == "collected":  # small: its data is gone
        shape = f'<circle {cls} cx="{x}" cy="{y}" r="{r - 3}" fill="{colour}" {white}/>'
    else:
        shape = f'<circle {cls} cx="{x}" cy="{y}" r="{r}" fill="{colour}" {white}/>'
    ring = (
        f'<circle class="pin" cx="{x}" cy="{y}" r="{r + 4}" fill="none" '
        f'stroke="{palette.INK}" stroke-width="1.5"/>'
        if pinned
        else ""
    )
    struck = (
        ""
        if live
        else f'<path class="struck" d="M{x - r - 3} {y + r + 3} L{x + r + 3} {y - r - 3}" '
        f'stroke="{palette.INK}" stroke-width="2"/>'
    )
    return ring + shape + struck


def end_marker(ended: str, x: float, y: float) -> str:
    """The marker at the end of an attempt's lane: its ending's shape (``class="end"``)."""
    colour = palette.ENDED.get(ended, palette.MUTED)
    cls = f'class="end ended-{escape(ended)}"'
    s = END_SIZE
    filled = f'fill="{colour}" stroke="{colour}" stroke-width="1"'
    if ended == "running":  # an arrow on: it goes on
        return f'<path {cls} d="M{x - s + 2} {y - s} l{2 * s} {s} l-{2 * s} {s} z" {filled}/>'
    if ended == "replaced":  # an arrow into a wall: a newer attempt took over
        return (
            f'<path {cls} d="M{x - s} {y - s + 1} l{s + 1} {s - 1} l-{s + 1} {s - 1} z '
            f'M{x + 3} {y - s} h3 v{2 * s} h-3 z" {filled}/>'
        )
    if ended == "preempted":  # pause: two bars
        return (
            f'<path {cls} d="M{x - s + 1} {y - s} h4 v{2 * s} h-4 z '
            f'M{x + 2} {y - s} h4 v{2 * s} h-4 z" {filled}/>'
        )
    if ended == "lost":  # a hollow square: how it ended is unknown
        return (
            f'<rect {cls} x="{x - s + 1}" y="{y - s + 1}" width="{2 * s - 2}" '
            f'height="{2 * s - 2}" fill="{palette.BACKGROUND}" stroke="{colour}" '
            f'stroke-width="3"/>'
        )
    if ended == "failed":  # a cross
        return (
            f'<path {cls} d="M{x - s + 1} {y - s + 1} l{2 * s - 2} {2 * s - 2} '
            f'M{x + s - 1} {y - s + 1} l-{2 * s - 2} {2 * s - 2}" fill="none" '
            f'stroke="{colour}" stroke-width="3.5"/>'
        )
    return (  # finished: a filled square
        f'<rect {cls} x="{x - s}" y="{y - s}" width="{2 * s}" height="{2 * s}" {filled}/>'
    )


def verdict_mark(verdict: str, x: float, y: float) -> str:
    """A resume's verdict at (x, y) (``class="verdict"``): a check when its replayed steps
    were bit-exact; a red warning triangle when they diverged, the loudest mark drawn; a
    hollow circle with a question mark when it replayed nothing."""
    colour = palette.VERDICT.get(verdict, palette.MUTED)
    cls = f'class="verdict verdict-{escape(verdict)}"'
    if verdict == "verified":
        return (
            f'<path {cls} d="M{x - 6} {y} l4 5 l8 -10" fill="none" stroke="{colour}" '
            'stroke-width="3.5" stroke-linecap="round" stroke-linejoin="round"/>'
        )
    if verdict == "diverged":
        return (
            f'<path {cls} d="M{x} {y - 9} l9 16 h-18 z" fill="{colour}" stroke="{colour}" '
            f'stroke-width="1" stroke-linejoin="round"/>'
            f'<path d="M{x} {y - 4} v6 M{x} {y + 4} v1.5" stroke="{palette.BACKGROUND}" '
            'stroke-width="2.5"/>'
        )
    return (
        f'<circle {cls} cx="{x}" cy="{y}" r="6.5" fill="{palette.BACKGROUND}" '
        f'stroke="{colour}" stroke-width="2.5"/>'
        f'<text x="{x}" y="{y + 4}" font-size="10" font-weight="700" text-anchor="middle" '
        f'fill="{palette.INK}">?</text>'
    )


def head_marker(x: float, y: float) -> str:
    """The head's triangle, pointing down at the mark at (x, y), inside its lane."""
    tip = y - MARK_RADIUS - 3
    return (
        f'<path class="head-mark" d="M{x} {tip} l-{HEAD_SIZE} -{HEAD_SIZE + 3} h{2 * HEAD_SIZE} z" '
        f'fill="{palette.INK}"/>'
    )


def lost_band(x1: float, x2: float, y: float, *, height: float) -> str:
    """The shape of a band of steps lost, from x1 to x2 on a lane at y."""
    return (
        f'x="{x1}" y="{y - height / 2}" width="{max(2.0, round(x2 - x1, 1))}" '
        f'height="{height}" fill="{palette.LOST_FILL}" stroke="{palette.LOST_EDGE}" '
        'stroke-width="1.5" stroke-dasharray="4 2"'
    )


def resume_edge(d: str) -> str:
    """The attributes of a resume edge along the path ``d``."""
    return (
        f'd="{d}" fill="none" stroke="{palette.RESUME_EDGE}" stroke-width="1.5" '
        'stroke-dasharray="5 3"'
    )


LEGEND_ROW = 26


@functools.cache
def draw_legend(*, width: int) -> str:
    """The legend as ``<svg id="legend">``: each entry drawn by the functions that draw the
    picture, a ``g.legend-entry`` with the state it explains (``data-status``,
    ``data-ended``, ``data-verdict``, ``data-key``)."""
    bundles = [
        (f'data-status="{status}"', bundle_mark(status, 0, 0), status) for status in STATUSES
    ]
    bundles += [
        ('data-key="pinned"', bundle_mark("complete", 0, 0, pinned=True), "pinned"),
        ('data-key="abandoned"', bundle_mark("complete", 0, 0, live=False), "abandoned branch"),
        ('data-key="head"', bundle_mark("complete", 0, 0) + head_marker(0, 0), "head"),
        (
            'data-key="lost"',
            f'<rect class="lost" {lost_band(-10, 10, 0, height=16)}/>',
            "steps lost",
        ),
        (
            'data-key="resume"',
            f'<path class="resume-edge" {resume_edge("M-10 6 C-2 6 2 -6 10 -6")}/>',
            "resumed from",
        ),
    ]
    endings = [(f'data-ended="{ended}"', end_marker(ended, 0, 0), ended) for ended in ENDINGS]
    verdicts = [
        (f'data-verdict="{verdict}"', verdict_mark(verdict, 0, 0), verdict) for verdict in VERDICTS
    ]
    rows = [("bundles", bundles), ("attempts ended", endings), ("resumes", verdicts)]
    parts = []
    for row, (title, entries) in enumerate(rows):
        y = LEGEND_ROW * row + LEGEND_ROW / 2 + 4
        parts.append(
            f'<text x="0" y="{y + 4}" font-size="{FONT}" fill="{palette.MUTED}">{title}:</text>'
        )
        x = 120.0
        for attributes, shape, label in entries:
            parts.append(
                f'<g class="legend-entry" {attributes} transform="translate({x} {y})">{shape}'
                f'<text x="16" y="4" font-size="{FONT}" fill="{palette.INK}">{label}</text></g>'
            )
            x += 36 + len(label) * 7.2
    height = LEGEND_ROW * len(rows) + 6
    return (
        f'<svg id="legend" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="legend of the lineage">{"".join(parts)}</svg>'
    )
