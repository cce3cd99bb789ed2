"""Which positions get a fingerprint: those both attempts pick alike, few enough to be cheap.

Pure: steps in, a yes or no out. A fingerprint at every micro-batch costs a few microseconds
each (the loss kept, and after an optimizer step the parameters' sample, about 25 µs):
nothing on a step of a second, a few percent of a step of a millisecond (bench/
fingerprint.py). So only the positions of some steps are fingerprinted: every
``every``-th step, and the first ``AFTER_ANCHOR`` steps after each save and resume.

Both attempts pick alike, without talking: the step numbers are the run's, and the bundle
the next attempt resumes from is one the interrupted attempt saved (or resumed from)
itself, so the first steps the next attempt replays are fingerprinted by both. A divergence
a resume causes (a random source not captured, a data position that did not resume, a
damaged optimizer state) shows at the first replayed positions, in the loss or, after the
first optimizer step, in the parameters; one that starts later shows at the next
fingerprinted step.
"""

from __future__ import annotations

AFTER_ANCHOR = 2  # the steps fingerprinted after the step of each save and resume


def fingerprinted(step: int, *, every: int, anchor: int | None) -> bool:
    """Whether the positions of ``step`` get a fingerprint (the loss of each micro-batch,
    and the parameters' sample after the optimizer step that reached it): ``step`` is a
    multiple of ``every``, or at most ``AFTER_ANCHOR`` steps after ``anchor``, the step of
    this attempt's last save or resume (its own positions after the anchor included)."""
    return step % every == 0 or (anchor is not None and 0 <= step - anchor <= AFTER_ANCHOR)
