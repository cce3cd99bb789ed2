"""The run page's pictures as pure functions: the palette's contrast (WCAG AA), a shape per
state, the legend drawn with the marks' own code, steps lost on their own lane, and the
save figures' ranges. The browser checks the same on a real page (test_picture_browser)."""

from __future__ import annotations

import re
from itertools import combinations
from pathlib import Path

import pytest

from service.names import VERDICTS
from service.ui import marks, palette
from service.ui.drawing import WIDTH, Lane, Mark, Picture, draw_lineage, lost_from
from service.ui.saves import SavePoint, draw_saves

ROOT = Path(__file__).resolve().parents[2]


def test_contrast_matches_wcags_reference_values() -> None:
    assert palette.contrast("#000000", "#ffffff") == pytest.approx(21)
    assert palette.contrast("#ffffff", "#ffffff") == pytest.approx(1)
    assert palette.contrast("#777777", "#ffffff") == pytest.approx(4.48, abs=0.01)


@pytest.mark.parametrize("name", sorted(palette.GRAPHICS))
def test_every_mark_and_line_colour_has_3_to_1_against_the_page(name: str) -> None:
    assert palette.contrast(palette.GRAPHICS[name], palette.BACKGROUND) >= 3


@pytest.mark.parametrize("name", sorted(palette.TEXT))
def test_every_text_colour_has_4_5_to_1_against_the_page(name: str) -> None:
    assert palette.contrast(palette.TEXT[name], palette.BACKGROUND) >= 4.5


def colours(svg: str) -> set[str]:
    return set(re.findall(r'(?:fill|stroke)="(#[0-9a-f]{6})"', svg))


def drawn() -> str:
    lanes = [
        Lane(attempt_id=1, epoch=1, start_step=0, last_step=34, ended="preempted", steps_lost=4),
        Lane(attempt_id=2, epoch=2, start_step=30, last_step=66, ended="lost", resumed_from_id=3),
        Lane(attempt_id=3, epoch=4, start_step=30, last_step=70, ended="failed", resumed_from_id=3),
        Lane(attempt_id=4, epoch=5, start_step=70, last_step=75, ended="running"),
    ]
    statuses = ["complete", "pending", "quarantined", "failed", "deleted"]
    marks_ = [
        Mark(id=i + 1, step=10 * (i + 1), status=s, attempt_id=1, pinned=i == 0, live=i != 1)
        for i, s in enumerate(statuses)
    ]
    picture = Picture(run="r", lanes=lanes, marks=marks_, head_id=1)
    return draw_lineage(picture) + marks.draw_legend(width=WIDTH) + draw_saves([])


def test_the_pictures_use_only_the_palettes_colours() -> None:
    decorative = {palette.GRID, palette.LOST_FILL, palette.BACKGROUND}
    checked = set(palette.GRAPHICS.values()) | set(palette.TEXT.values())
    assert colours(drawn()) <= checked | decorative


def shape(svg: str) -> str:
    """A shape without its place: its element, its path's commands, its sizes and paint."""
    tag = re.match(r"<(\w+)", svg)
    path = re.search(r' d="([^"]*)"', svg)
    assert tag
    commands = "".join(re.findall(r"[MlLhvzCc]", path[1])) if path else ""
    paint = re.findall(r' (fill|stroke|stroke-width|r|width)="([^"]*)"', svg)
    return f"{tag[1]} {commands} {sorted(paint)}"


def test_each_status_ending_and_verdict_has_its_own_shape() -> None:
    bundles = [shape(marks.bundle_mark(status, 0, 0)) for status in marks.STATUSES]
    endings = [shape(marks.end_marker(ended, 0, 0)) for ended in marks.ENDINGS]
    verdicts = [shape(marks.verdict_mark(verdict, 0, 0)) for verdict in VERDICTS]
    assert len(set(bundles)) == len(bundles)
    assert len(set(endings)) == len(endings)
    assert len(set(verdicts)) == len(verdicts)
    # Not only by colour: no two differ in colour alone.
    for first, second in combinations(bundles + endings + verdicts, 2):
        assert re.sub(r"#[0-9a-f]{6}", "", first) != re.sub(r"#[0-9a-f]{6}", "", second)


def test_the_legend_holds_each_mark_as_the_picture_draws_it() -> None:
    legend = marks.draw_legend(width=WIDTH)
    for status in marks.STATUSES:
        assert f'data-status="{status}"' in legend
        assert marks.bundle_mark(status, 0, 0) in legend
    for ended in marks.ENDINGS:
        assert marks.end_marker(ended, 0, 0) in legend
    assert marks.bundle_mark("complete", 0, 0, live=False) in legend  # abandoned: struck
    assert "opacity" not in legend + drawn()  # nothing faded below its contrast


def test_lanes_are_named_by_attempt_with_the_fencing_epoch_in_their_title() -> None:
    svg = drawn()
    names = re.findall(r'<text class="lane-label"[^>]*>([^<]*)</text>', svg)
    assert names == [  # no number given: the epoch stands in
        "attempt 1 · preempted",
        "attempt 2 · lost",
        "attempt 4 · failed",
        "attempt 5 · running",
    ]
    lane = Lane(
        attempt_id=9,
        epoch=7,
        start_step=0,
        last_step=5,
        ended="finished",
        number=3,
        pod="p",
        node="n",
    )
    svg = draw_lineage(Picture(run="r", lanes=[lane], marks=[]))
    assert "attempt 3 · finished" in svg and "epoch 7</text>" not in svg
    assert "attempt 3 (fencing epoch 7): pod p on node n" in svg


def test_steps_lost_begin_no_earlier_than_the_lane_nor_its_last_complete_bundle() -> None:
    # Resumed at 40, saved 50, stopped at 66; a rollback sent its successor back to 30.
    lane = Lane(
        attempt_id=3, epoch=3, start_step=40, last_step=66, ended="preempted", steps_lost=36
    )
    saved = [Mark(id=6, step=50, status="complete", attempt_id=3)]
    assert lost_from(lane, saved) == 50
    assert lost_from(lane, []) == 40
    assert lost_from(lane, [Mark(id=7, step=60, status="pending", attempt_id=3)]) == 40
    plain = Lane(attempt_id=1, epoch=1, start_step=0, last_step=34, ended="preempted", steps_lost=4)
    assert lost_from(plain, [Mark(id=3, step=30, status="complete", attempt_id=1)]) == 30
    assert (
        lost_from(Lane(attempt_id=1, epoch=1, start_step=0, last_step=34, ended="finished"), [])
        is None
    )


def test_a_band_after_a_rollback_says_how_far_back_its_successor_resumed() -> None:
    lanes = [
        Lane(attempt_id=3, epoch=3, start_step=40, last_step=66, ended="preempted", steps_lost=36),
        Lane(attempt_id=4, epoch=5, start_step=30, last_step=60, ended="finished", number=4),
    ]
    saved = [Mark(id=6, step=50, status="complete", attempt_id=3)]
    svg = draw_lineage(Picture(run="r", lanes=lanes, marks=saved))
    assert 'data-steps="16" data-from="50" data-to="66"' in svg
    assert "16 steps lost when attempt 3 ended (preempted): steps 50 to 66, trained again" in svg
    assert "attempt 4; its successor resumed 20 steps further back</title>" in svg


def point(step: int, *, stall: float, tax: float | None, persist: float, rate: float) -> SavePoint:
    return SavePoint(
        step=step,
        stall_seconds=stall,
        tax_seconds=tax,
        persist_seconds=persist,
        throughput=rate,
        new_bytes=step % 7,
    )


def test_the_save_figures_show_their_range_and_steps() -> None:
    points = [
        point(10, stall=0.25, tax=None, persist=2.0, rate=3e6),
        point(50, stall=0.3, tax=1.75, persist=1.5, rate=2e6),
        point(90, stall=0.5, tax=0.75, persist=1.0, rate=1e6),
    ]
    svg = draw_saves(points)
    assert 'data-series="stall" data-min="0.25" data-max="0.5" data-points="3"' in svg
    # The tax through the bundles that know it only, beside the stall, with its meaning.
    assert 'data-series="tax" data-min="0.75" data-max="1.75" data-points="2"' in svg
    assert svg.index('data-series="stall"') < svg.index('data-series="tax"')
    assert ">save tax s</text>" in svg
    assert "<title>save tax: the training loop&#x27;s extra time from save() until durable" in svg
    tax_line = re.search(r'<polyline class="series" data-series="tax" points="([^"]*)"', svg)
    assert tax_line and len(tax_line[1].split()) == 2
    assert ">min 1M</text>" in svg and ">max 3M</text>" in svg
    assert ">step 10</text>" in svg and ">step 90</text>" in svg


def test_a_tax_no_rank_knew_draws_an_empty_panel() -> None:
    svg = draw_saves([point(10, stall=0.25, tax=None, persist=2.0, rate=3e6)])
    assert 'data-series="tax" data-min="—" data-max="—" data-points="0"' in svg
    assert '<polyline class="series" data-series="tax" points=""' in svg


def test_the_docs_legend_is_the_dashboards() -> None:
    """docs/img/legend.svg is the legend the dashboard draws (regenerate it with
    ``python -c 'from service.ui.marks import draw_legend; print(draw_legend(width=1160))'``)."""
    docs = (ROOT / "docs" / "img" / "legend.svg").read_text()
    assert docs.strip() == marks.draw_legend(width=WIDTH)
