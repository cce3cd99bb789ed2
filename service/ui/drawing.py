"""The run page's pictures as SVG text: the lineage across restarts, and the save figures.

Pure functions over plain data, no I/O: the catalog's rows come in as ``Lane`` and ``Mark``
values, the picture goes out as a string. Every text that may come from a client is escaped
here, because the page inserts the SVG as it is.

The lineage is drawn on a step axis: one lane per attempt, from the step it resumed from to
the last step it reported, with its bundles as marks; a resume edge from a bundle to each
attempt that resumed from it; the steps an ending lost shaded on the lane of the attempt that
lost them; the head marked. Bundles off the live branch (left behind by a rollback) are drawn
as abandoned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from urllib.parse import quote

from service import lineage

WIDTH = 960
LABEL_WIDTH = 96  # the lanes' names, left of the axis
RIGHT_MARGIN = 24
LANE_HEIGHT = 22
AXIS_HEIGHT = 26
MARK_RADIUS = 4.5
TICKS = 6

# How the catalog's bundle statuses are shown.
SHOWN_STATUS = {"deleted": "collected"}


@dataclass(frozen=True)
class Lane:
    """One attempt: it trained from ``start_step`` (the step it resumed from; 0 for a fresh
    start) to ``last_step`` and ended as ``ended`` (running while it has not)."""

    attempt_id: int
    epoch: int
    start_step: int
    last_step: int | None
    ended: str  # running, preempted, lost, failed, finished
    resumed_from_id: int | None = None
    steps_lost: int | None = None  # what its ending cost (lineage.steps_lost)


@dataclass(frozen=True)
class Mark:
    """One bundle: where it sits and how it is drawn."""

    id: int
    step: int
    status: str
    attempt_id: int | None
    pinned: bool = False
    live: bool = True  # on the live branch (the head and its ancestors)


@dataclass(frozen=True)
class Hidden:
    """What a window leaves out: the older lanes and their bundles."""

    lanes: int
    bundles: int


@dataclass(frozen=True)
class Picture:
    run: str
    lanes: Sequence[Lane]  # oldest first
    marks: Sequence[Mark]
    head_id: int | None = None
    hidden: Hidden | None = None


@dataclass
class _Layout:
    """Where things go: the step scale and each lane's row."""

    low: int
    high: int
    rows: dict[int, int] = field(default_factory=dict)  # attempt id -> row
    other_row: int | None = None  # the summary lane, or bundles of no drawn attempt
    num_rows: int = 0

    def x(self, step: int) -> float:
        span = max(1, self.high - self.low)
        inner = WIDTH - LABEL_WIDTH - RIGHT_MARGIN
        return round(LABEL_WIDTH + (step - self.low) / span * inner, 1)

    def y(self, row: int) -> float:
        return AXIS_HEIGHT + row * LANE_HEIGHT + LANE_HEIGHT / 2

    def row_of(self, mark: Mark) -> int | None:
        if mark.attempt_id is not None and mark.attempt_id in self.rows:
            return self.rows[mark.attempt_id]
        return self.other_row

    @property
    def height(self) -> int:
        return AXIS_HEIGHT + self.num_rows * LANE_HEIGHT + 8


def _href_prefix(run: str) -> str:
    """The path of the run's bundle pages before the bundle's id, escaped for an attribute
    (the run's name percent-encoded)."""
    return escape(f"/ui/runs/{quote(run, safe='')}/bundles/")


def layout(picture: Picture) -> _Layout:
    """The step range and the rows: the summary lane first, then the lanes, oldest first,
    then a row for bundles of no drawn lane (when there is no summary lane to hold them)."""
    steps = [m.step for m in picture.marks]
    for lane in picture.lanes:
        steps += [lane.start_step, lane.last_step if lane.last_step is not None else 0]
    low = min(steps, default=0) if picture.hidden else 0
    plan = _Layout(low=low, high=max(steps, default=1))
    if picture.hidden:
        plan.other_row = 0
    plan.rows = {
        lane.attempt_id: i + (1 if picture.hidden else 0) for i, lane in enumerate(picture.lanes)
    }
    plan.num_rows = len(plan.rows) + (1 if picture.hidden else 0)
    strays = [m for m in picture.marks if m.attempt_id not in plan.rows]
    if strays and plan.other_row is None:
        plan.other_row = plan.num_rows
        plan.num_rows += 1
    return plan


def draw_lineage(picture: Picture) -> str:
    """The lineage as ``<svg id="lineage">`` (see ``docs/dashboard.md`` for what it shows)."""
    plan = layout(picture)
    href = _href_prefix(picture.run)
    marks = {m.id: m for m in picture.marks}
    by_lane: dict[int | None, list[Mark]] = {}
    for mark in picture.marks:
        key = mark.attempt_id if mark.attempt_id in plan.rows else None
        by_lane.setdefault(key, []).append(mark)
    parts = [
        f'<svg id="lineage" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{plan.height}" viewBox="0 0 {WIDTH} {plan.height}" role="img" '
        f'aria-label="lineage of run {escape(picture.run)}">',
        _axis(plan),
        _edges(picture, plan, marks),
        _other_lane(picture, plan, by_lane.get(None, [])),
    ]
    parts += [
        _lane(href, lane, plan, by_lane.get(lane.attempt_id, []), successor)
        for lane, successor in zip(picture.lanes, [*picture.lanes[1:], None], strict=True)
    ]
    parts += [_head(picture.head_id, marks, plan), "</svg>"]
    return "".join(parts)


def _axis(plan: _Layout) -> str:
    span = max(1, plan.high - plan.low)
    every = max(1, _round_step(span / (TICKS - 1)))
    first = (plan.low + every - 1) // every * every
    ticks = []
    for step in range(first, plan.high + 1, every):
        x = plan.x(step)
        ticks.append(
            f'<line class="tick" x1="{x}" y1="{AXIS_HEIGHT - 6}" x2="{x}" y2="{plan.height - 8}"/>'
            f'<text class="tick-label" x="{x}" y="{AXIS_HEIGHT - 10}">{step}</text>'
        )
    label = f'<text class="axis-label" x="4" y="{AXIS_HEIGHT - 10}">step</text>'
    return f'<g class="axis">{label}{"".join(ticks)}</g>'


def _round_step(raw: float) -> int:
    """A tick spacing of 1, 2 or 5 times a power of ten, at least ``raw``."""
    scale = 1
    while True:
        for factor in (1, 2, 5):
            if factor * scale >= raw:
                return factor * scale
        scale *= 10


def _edges(picture: Picture, plan: _Layout, marks: dict[int, Mark]) -> str:
    """A resume edge from each bundle an attempt resumed from to the start of its lane."""
    edges = []
    for lane in picture.lanes:
        source = marks.get(lane.resumed_from_id) if lane.resumed_from_id else None
        row = plan.row_of(source) if source else None
        if source is None or row is None:
            continue
        x1, y1 = plan.x(source.step), plan.y(row)
        x2, y2 = plan.x(lane.start_step), plan.y(plan.rows[lane.attempt_id])
        middle = round((y1 + y2) / 2, 1)
        edges.append(
            f'<path class="resume-edge" data-from="bundle-{source.id}" '
            f'data-to-epoch="{lane.epoch}" d="M{x1} {y1} C{x1} {middle} {x2} {middle} {x2} {y2}">'
            f"<title>epoch {lane.epoch} resumed from bundle {source.id} "
            f"(step {source.step})</title></path>"
        )
    return f'<g class="edges">{"".join(edges)}</g>'


def _lane(href: str, lane: Lane, plan: _Layout, marks: list[Mark], successor: Lane | None) -> str:
    row = plan.rows[lane.attempt_id]
    y = plan.y(row)
    end_step = lane.last_step if lane.last_step is not None else lane.start_step
    x1, x2 = plan.x(lane.start_step), plan.x(end_step)
    shown = escape(lane.ended)
    return (
        f'<g class="lane" data-epoch="{lane.epoch}" data-ended="{shown}">'
        f'<text class="lane-label" x="4" y="{y + 4}">epoch {lane.epoch}</text>'
        f"{_lost(lane, plan, y, successor)}"
        f'<line class="track ended-{shown}" x1="{x1}" y1="{y}" x2="{x2}" y2="{y}"/>'
        f'<circle class="end ended-{shown}" cx="{x2}" cy="{y}" r="3">'
        f"<title>epoch {lane.epoch}: steps {lane.start_step} to {end_step}, {shown}</title>"
        f"</circle>{''.join(_mark(href, mark, plan.x(mark.step), y) for mark in marks)}</g>"
    )


def _lost(lane: Lane, plan: _Layout, y: float, successor: Lane | None) -> str:
    """The steps this lane's ending lost: from where its successor resumed to its last step."""
    if not lane.steps_lost or lane.last_step is None or successor is None:
        return ""
    x1, x2 = plan.x(lane.last_step - lane.steps_lost), plan.x(lane.last_step)
    top = y - LANE_HEIGHT / 2 + 2
    bound = "" if lineage.steps_lost_exact(lane.ended) else "at least "
    return (
        f'<rect class="lost" data-epoch="{lane.epoch}" data-steps="{lane.steps_lost}" '
        f'x="{x1}" y="{top}" width="{max(1.0, round(x2 - x1, 1))}" height="{LANE_HEIGHT - 4}">'
        f"<title>{bound}{lane.steps_lost} steps lost when epoch {lane.epoch} ended "
        f"({escape(lane.ended)}): epoch {successor.epoch} trained them again</title></rect>"
    )


def _mark(href: str, mark: Mark, x: float, y: float) -> str:
    """A bundle's mark, a link to its page (``href``: the escaped path before its id)."""
    status = escape(SHOWN_STATUS.get(mark.status, mark.status))  # the title's only text
    branch = "live" if mark.live else "abandoned"
    pinned = "true" if mark.pinned else "false"
    title = f"bundle {mark.id}, step {mark.step}: {status}{', pinned' if mark.pinned else ''}"
    title += "" if mark.live else ", on an abandoned branch"
    ring = f'<circle class="pin" cx="{x}" cy="{y}" r="{MARK_RADIUS + 3}"/>' if mark.pinned else ""
    return (
        f'<a class="bundle" data-key="bundle-{mark.id}" data-step="{mark.step}" '
        f'data-status="{status}" data-pinned="{pinned}" data-branch="{branch}" '
        f'href="{href}{mark.id}" tabindex="0">'
        f"<title>{title}</title>{ring}"
        f'<circle class="mark status-{status} branch-{branch}" cx="{x}" cy="{y}" '
        f'r="{MARK_RADIUS}"/></a>'
    )


def _other_lane(picture: Picture, plan: _Layout, marks: list[Mark]) -> str:
    """The summary of what the window leaves out, or the bundles of no attempt."""
    if plan.other_row is None:
        return ""
    y = plan.y(plan.other_row)
    href = _href_prefix(picture.run)
    drawn = "".join(_mark(href, mark, plan.x(mark.step), y) for mark in marks)
    if picture.hidden is None:
        label = f'<text class="lane-label" x="4" y="{y + 4}">no attempt</text>'
        return f'<g class="lane-other">{label}{drawn}</g>'
    hidden = picture.hidden
    return (
        f'<g class="lane-summary" data-count="{hidden.lanes}">'
        f'<text class="lane-label" x="4" y="{y + 4}">{hidden.lanes} older</text>'
        f'<line class="track summary" x1="{plan.x(plan.low)}" y1="{y}" x2="{plan.x(plan.low)}" '
        f'y2="{y}"/><title>{hidden.lanes} older attempts and {hidden.bundles} bundles are not '
        f"drawn</title>{drawn}</g>"
    )


def _head(head_id: int | None, marks: dict[int, Mark], plan: _Layout) -> str:
    head = marks.get(head_id) if head_id is not None else None
    row = plan.row_of(head) if head else None
    if head is None or row is None:
        return ""
    x, y = plan.x(head.step), plan.y(row)
    top = y - MARK_RADIUS - 2
    return (
        f'<g class="head" data-key="bundle-{head.id}">'
        f'<path d="M{x} {top} l-5 -8 h10 z"/>'
        f"<title>head: bundle {head.id}, step {head.step}</title></g>"
    )


@dataclass(frozen=True)
class SavePoint:
    """One bundle's save figures: the slowest rank's stall and persist seconds, the payload
    it wrote per second of persist, and the new bytes all ranks uploaded."""

    step: int
    stall_seconds: float
    persist_seconds: float
    throughput: float  # bytes per second
    new_bytes: int


SERIES = (
    ("stall", "stall s"),
    ("persist", "persist s"),
    ("throughput", "throughput B/s"),
    ("new_bytes", "new bytes"),
)
PANEL_HEIGHT = 48


def draw_saves(points: Sequence[SavePoint]) -> str:
    """The save figures over the steps: four small panels, one ``polyline`` each."""
    height = len(SERIES) * (PANEL_HEIGHT + 12)
    ordered = sorted(points, key=lambda p: p.step)
    low = ordered[0].step if ordered else 0
    span = max(1, (ordered[-1].step if ordered else 1) - low)
    inner = WIDTH - LABEL_WIDTH - RIGHT_MARGIN
    xs = [LABEL_WIDTH + (p.step - low) / span * inner for p in ordered]
    series = {
        "stall": [p.stall_seconds for p in ordered],
        "persist": [p.persist_seconds for p in ordered],
        "throughput": [p.throughput for p in ordered],
        "new_bytes": [float(p.new_bytes) for p in ordered],
    }
    panels = [
        _panel(name, label, xs, series[name], row=row) for row, (name, label) in enumerate(SERIES)
    ]
    return (
        f'<svg id="saves" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="save figures">'
        f"{''.join(panels)}</svg>"
    )


def _panel(name: str, label: str, xs: list[float], values: list[float], *, row: int) -> str:
    top = row * (PANEL_HEIGHT + 12) + 10
    peak = max(values, default=0.0) or 1.0
    bottom, scale = top + PANEL_HEIGHT, PANEL_HEIGHT / peak
    points = " ".join(
        f"{x:.1f},{bottom - value * scale:.1f}" for x, value in zip(xs, values, strict=True)
    )
    return (
        f'<g class="panel"><text class="lane-label" x="4" y="{top + 12}">{label}</text>'
        f'<text class="peak" x="4" y="{top + 28}">max {_short(peak if values else 0.0)}</text>'
        f'<line class="baseline" x1="{LABEL_WIDTH}" y1="{bottom}" '
        f'x2="{WIDTH - RIGHT_MARGIN}" y2="{bottom}"/>'
        f'<polyline class="series" data-series="{name}" points="{points}"/></g>'
    )


def _short(value: float) -> str:
    """3.2k, 41M, 0.12: a figure in a few characters."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"
