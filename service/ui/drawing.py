"""The run page's lineage across restarts as SVG text.

Pure functions over plain data, no I/O: the catalog's rows come in as ``Lane`` and ``Mark``
values, the picture goes out as a string. Every text that may come from a client is escaped
here, because the page inserts the SVG as it is. The shapes are ``marks.py``'s (the legend
is drawn with them), the colours ``palette.py``'s.

The lineage is drawn on a step axis: one lane per attempt, named by its number in the run
("attempt 3", not its fencing epoch, which a rollback also advances), its ending, pod and
node; the lane runs from the step it resumed from to the last step it reported, with its
bundles as marks; a resume edge from a bundle to each attempt that resumed from it; the
steps an ending lost shaded on the lane of the attempt that lost them, from its last
resumable point (its newest complete bundle, or where it started) to where it stopped; the
head marked on its lane. Bundles off the live branch (left behind by a rollback) are struck.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from urllib.parse import quote

from service import lineage
from service.ui import palette
from service.ui.marks import (
    DETAIL_FONT,
    FONT,
    SHOWN_STATUS,
    bundle_mark,
    end_marker,
    head_marker,
    lost_band,
    resume_edge,
    verdict_mark,
)

WIDTH = 1160  # the page's width at 1280 px, less its margins
LABEL_WIDTH = 190  # the lanes' names, left of the axis
RIGHT_MARGIN = 36  # room for the end markers
END_GAP = 15  # from a lane's last step to its end marker, clear of a bundle's mark there
LANE_HEIGHT = 44
AXIS_HEIGHT = 30
TICKS = 8
DETAIL_CHARS = 28  # of a lane's pod and node, beyond which they are cut (whole in its title)


@dataclass(frozen=True)
class Lane:
    """One attempt, the ``number``-th of its run: it trained from ``start_step`` (the step it
    resumed from; 0 for a fresh start) to ``last_step`` and ended as ``ended`` (running while
    it has not; replaced when a newer attempt registered before it reported its end)."""

    attempt_id: int
    epoch: int  # its fencing epoch
    start_step: int
    last_step: int | None
    ended: str  # running, replaced, preempted, lost, failed, finished
    resumed_from_id: int | None = None
    steps_lost: int | None = None  # what its ending cost (lineage.steps_lost)
    number: int = 0  # 1 for the run's first attempt; 0: its epoch
    pod: str | None = None
    node: str | None = None
    verdict: str | None = None  # its resume's: verified, diverged, unverifiable (None: none)
    verdict_detail: str = ""  # that verdict in a sentence

    @property
    def ordinal(self) -> int:
        return self.number or self.epoch


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
            f'<line class="grid" x1="{x}" y1="{AXIS_HEIGHT}" x2="{x}" y2="{plan.height - 8}" '
            f'stroke="{palette.GRID}"/>'
            f'<line class="tick" x1="{x}" y1="{AXIS_HEIGHT - 6}" x2="{x}" y2="{AXIS_HEIGHT}" '
            f'stroke="{palette.AXIS}"/>'
            f'<text class="tick-label" x="{x}" y="{AXIS_HEIGHT - 10}" font-size="{DETAIL_FONT}" '
            f'fill="{palette.MUTED}" text-anchor="middle">{step}</text>'
        )
    label = (
        f'<text class="axis-label" x="4" y="{AXIS_HEIGHT - 10}" font-size="{DETAIL_FONT}" '
        f'fill="{palette.MUTED}">step</text>'
    )
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
        d = f"M{x1} {y1} C{x1} {middle} {x2} {middle} {x2} {y2}"
        edges.append(
            f'<path class="resume-edge" data-from="bundle-{source.id}" '
            f'data-to-epoch="{lane.epoch}" data-to-attempt="{lane.ordinal}" {resume_edge(d)}>'
            f"<title>attempt {lane.ordinal} resumed from bundle {source.id} "
            f"(step {source.step})</title></path>"
        )
    return f'<g class="edges">{"".join(edges)}</g>'


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


def _lane(href: str, lane: Lane, plan: _Layout, marks: list[Mark], successor: Lane | None) -> str:
    row = plan.rows[lane.attempt_id]
    y = plan.y(row)
    end_step = lane.last_step if lane.last_step is not None else lane.start_step
    x1, x2 = plan.x(lane.start_step), plan.x(end_step)
    tail = round(x2 + END_GAP, 1)  # its end marker
    shown = escape(lane.ended)
    where = " · ".join(part for part in (lane.pod, lane.node) if part) or "no pod reported"
    about = (
        f"attempt {lane.ordinal} (fencing epoch {lane.epoch}): pod {lane.pod or '—'} on node "
        f"{lane.node or '—'}, steps {lane.start_step} to {end_step}, {lane.ended}"
    )
    if lane.verdict_detail:
        about += f"; {lane.verdict_detail}"
    colour = palette.ENDED.get(lane.ended, palette.MUTED)
    verdict = f' data-verdict="{escape(lane.verdict)}"' if lane.verdict else ""
    return (
        f'<g class="lane" data-epoch="{lane.epoch}" data-attempt="{lane.ordinal}" '
        f'data-ended="{shown}"{verdict}><title>{escape(about)}</title>'
        f"{_verdict(lane, y)}"
        f'<text class="lane-label" x="4" y="{y - 3}" font-size="{FONT}" font-weight="600" '
        f'fill="{palette.INK}">attempt {lane.ordinal} · {shown}</text>'
        f'<text class="lane-detail" x="4" y="{y + 13}" font-size="{DETAIL_FONT}" '
        f'fill="{palette.MUTED}">{escape(_cut(where, DETAIL_CHARS))}</text>'
        f"{_lost(lane, plan, y, successor, marks)}"
        f'<line class="track ended-{shown}" x1="{x1}" y1="{y}" x2="{x2}" y2="{y}" '
        f'stroke="{colour}" stroke-width="4"/>'
        f'<line class="tail" x1="{x2}" y1="{y}" x2="{tail}" y2="{y}" '
        f'stroke="{colour}" stroke-width="2"/>'
        f"{end_marker(lane.ended, tail, y)}"
        f"{''.join(_mark(href, mark, plan.x(mark.step), y) for mark in marks)}</g>"
    )


def _verdict(lane: Lane, y: float) -> str:
    """The lane's resume verdict, at the right of its label, the sentence its title."""
    if lane.verdict is None:
        return ""
    return (
        f'<g class="lane-verdict" data-verdict="{escape(lane.verdict)}">'
        f"<title>{escape(lane.verdict_detail)}</title>"
        f"{verdict_mark(lane.verdict, LABEL_WIDTH - 16, y - 8)}</g>"
    )


def lost_from(lane: Lane, marks: Sequence[Mark]) -> int | None:
    """Where the steps ``lane``'s ending lost begin: its last resumable point (its newest
    complete bundle up to its last step, else the step it started from), or where its
    successor resumed when that is later; None when it lost none."""
    if not lane.steps_lost or lane.last_step is None:
        return None
    last = lane.last_step
    saved = [m.step for m in marks if m.status == "complete" and m.step <= last]
    start = max([lane.start_step, last - lane.steps_lost, *saved])
    return start if start < last else None


def _lost(
    lane: Lane, plan: _Layout, y: float, successor: Lane | None, marks: Sequence[Mark]
) -> str:
    """The steps this lane's ending lost, on its own lane (never before it started)."""
    start = lost_from(lane, marks)
    if start is None or lane.last_step is None or successor is None:
        return ""
    steps = lane.last_step - start
    bound = "" if lineage.steps_lost_exact(lane.ended) else "at least "
    # A rollback can send the successor back before what this attempt's ending lost: the
    # attempt's steps lost (lineage.steps_lost, as the table and the API count them) then
    # hold those steps too; they are on the abandoned branch, not in this band.
    earlier = (lane.steps_lost or 0) - steps
    further = f"; its successor resumed {earlier} steps further back" if earlier > 0 else ""
    return (
        f'<rect class="lost" data-epoch="{lane.epoch}" data-attempt="{lane.ordinal}" '
        f'data-steps="{steps}" data-from="{start}" data-to="{lane.last_step}" '
        f"{lost_band(plan.x(start), plan.x(lane.last_step), y, height=LANE_HEIGHT - 16)}>"
        f"<title>{bound}{steps} steps lost when attempt {lane.ordinal} ended "
        f"({escape(lane.ended)}): steps {start} to {lane.last_step}, trained again by "
        f"attempt {successor.ordinal}{further}</title></rect>"
    )


def _mark(href: str, mark: Mark, x: float, y: float) -> str:
    """A bundle's mark, a link to its page (``href``: the escaped path before its id)."""
    status = escape(SHOWN_STATUS.get(mark.status, mark.status))  # the title's only text
    branch = "live" if mark.live else "abandoned"
    pinned = "true" if mark.pinned else "false"
    title = f"bundle {mark.id}, step {mark.step}: {status}{', pinned' if mark.pinned else ''}"
    title += "" if mark.live else ", on an abandoned branch"
    return (
        f'<a class="bundle" data-key="bundle-{mark.id}" data-step="{mark.step}" '
        f'data-status="{status}" data-pinned="{pinned}" data-branch="{branch}" '
        f'href="{href}{mark.id}" tabindex="0">'
        f"<title>{title}</title>"
        f"{bundle_mark(mark.status, x, y, live=mark.live, pinned=mark.pinned)}</a>"
    )


def _other_lane(picture: Picture, plan: _Layout, marks: list[Mark]) -> str:
    """The summary of what the window leaves out, or the bundles of no attempt."""
    if plan.other_row is None:
        return ""
    y = plan.y(plan.other_row)
    href = _href_prefix(picture.run)
    drawn = "".join(_mark(href, mark, plan.x(mark.step), y) for mark in marks)
    text = f'x="4" y="{y + 4}" font-size="{FONT}" fill="{palette.INK}"'
    if picture.hidden is None:
        label = f'<text class="lane-label" {text}>no attempt</text>'
        return f'<g class="lane-other">{label}{drawn}</g>'
    hidden = picture.hidden
    return (
        f'<g class="lane-summary" data-count="{hidden.lanes}">'
        f'<text class="lane-label" {text}>{hidden.lanes} older attempts</text>'
        f"<title>{hidden.lanes} older attempts and {hidden.bundles} bundles are not "
        f"drawn</title>{drawn}</g>"
    )


def _head(head_id: int | None, marks: dict[int, Mark], plan: _Layout) -> str:
    head = marks.get(head_id) if head_id is not None else None
    row = plan.row_of(head) if head else None
    if head is None or row is None:
        return ""
    x, y = plan.x(head.step), plan.y(row)
    return (
        f'<g class="head" data-key="bundle-{head.id}">{head_marker(x, y)}'
        f"<title>head: bundle {head.id}, step {head.step}</title></g>"
    )
