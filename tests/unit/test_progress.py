"""The progress line: what it says, when it is drawn, how often, and from how many threads."""

from __future__ import annotations

import io
import re
import threading

import pytest

from ckpt.core.progress import Progress, format_progress

LABEL = "ckpt: saving runs/r/bundles/000000000001"
MB = 1_000_000
# One draw: back to the line's start, the line, clear to its end, then "\r" or "\n".
DRAW = re.compile(r"\r([^\r\n\x1b]*)\x1b\[K([\r\n])")


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr("ckpt.core.progress.time.monotonic", clock)
    return clock


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_PROGRESS", "1")


def draws(stream: io.StringIO) -> list[tuple[str, str]]:
    """Every line drawn, with its ending; asserts nothing else was written."""
    text = stream.getvalue()
    found = DRAW.findall(text)
    assert "".join(f"\r{line}\x1b[K{end}" for line, end in found) == text
    return found


@pytest.mark.parametrize(
    ("done", "total", "seconds", "expected"),
    [
        (412_100_000, 1_023_400_000, 0.485, "  412.1/1023.4 MB   40%  0.85 GB/s"),
        (2_000 * MB, 2_000 * MB, 1.0, "  2000.0/2000.0 MB  100%  2.00 GB/s"),
        (0, 0, 0.0, "  0.0/0.0 MB  100%  0.00 GB/s"),  # nothing to move is done
        (5 * MB, 10 * MB, 0.0, "  5.0/10.0 MB   50%  0.00 GB/s"),  # no time: no rate
    ],
)
def test_format_progress(done: int, total: int, seconds: float, expected: str) -> None:
    assert format_progress(LABEL, done, total, seconds) == LABEL + expected


@pytest.mark.parametrize("setting", ["0", "off", "false", "NO"])
def test_nothing_is_drawn_when_turned_off(
    monkeypatch: pytest.MonkeyPatch, clock: Clock, setting: str
) -> None:
    monkeypatch.setenv("CKPT_PROGRESS", setting)
    stream = Terminal()  # even on a terminal
    progress = Progress(LABEL, 10 * MB, stream=stream)
    for _ in range(10):
        clock.now += 1.0
        progress.advance(MB)
    progress.close()
    assert progress.done == 10 * MB
    assert stream.getvalue() == ""


def test_by_default_only_a_terminal_gets_the_line(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    monkeypatch.delenv("CKPT_PROGRESS", raising=False)
    streams = [io.StringIO(), Terminal()]
    progresses = [Progress(LABEL, 10 * MB, stream=stream) for stream in streams]
    clock.now += 2.0
    for progress in progresses:
        progress.advance(MB)
        progress.close()
    assert streams[0].getvalue() == ""
    assert [end for _, end in draws(streams[1])] == ["\r", "\n"]


def test_nothing_is_drawn_in_the_first_second(clock: Clock, shown: None) -> None:
    stream = io.StringIO()
    progress = Progress(LABEL, 10 * MB, stream=stream)
    for elapsed in (0.0, 0.5, 0.999):
        clock.now = 1000.0 + elapsed
        progress.advance(MB)
    progress.close()  # ended within its first second: no line, so no newline either
    assert stream.getvalue() == ""
    assert progress.done == 3 * MB


def test_redraws_at_most_every_quarter_second(clock: Clock, shown: None) -> None:
    stream = io.StringIO()
    progress = Progress(LABEL, 10 * MB, stream=stream)
    expected = []
    for done, elapsed in enumerate((1.0, 1.1, 1.2, 1.25, 1.4, 1.5, 3.0), start=1):
        clock.now = 1000.0 + elapsed
        progress.advance(MB)
        if elapsed in (1.0, 1.25, 1.5, 3.0):  # a quarter second or more since the last draw
            expected.append((format_progress(LABEL, done * MB, 10 * MB, elapsed), "\r"))
    assert draws(stream) == expected


def test_close_finishes_a_drawn_line_with_a_newline(clock: Clock, shown: None) -> None:
    stream = io.StringIO()
    progress = Progress(LABEL, 10 * MB, stream=stream)
    clock.now += 1.0
    progress.advance(4 * MB)
    clock.now += 0.1  # too soon to redraw, but close() draws the final count all the same
    progress.advance(6 * MB)
    progress.close()
    assert draws(stream) == [
        (format_progress(LABEL, 4 * MB, 10 * MB, 1.0), "\r"),
        (format_progress(LABEL, 10 * MB, 10 * MB, 1.1), "\n"),
    ]


def test_advance_from_many_threads_counts_every_byte(clock: Clock, shown: None) -> None:
    stream = io.StringIO()
    threads, calls, nbytes = 8, 2_000, 7
    progress = Progress(LABEL, threads * calls * nbytes, stream=stream)
    clock.now += 5.0  # past the quiet second; the clock stands still, so one draw only
    start = threading.Barrier(threads, timeout=10)

    def work() -> None:
        start.wait()
        for _ in range(calls):
            progress.advance(nbytes)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(10)
    assert not any(worker.is_alive() for worker in workers)
    progress.close()
    assert progress.done == threads * calls * nbytes
    lines = draws(stream)
    assert [end for _, end in lines] == ["\r", "\n"]
    assert lines[-1][0] == format_progress(LABEL, progress.done, progress.total, 5.0)
