"""Which steps get a fingerprint (agent.verify.cadence): few, and picked alike by the
interrupted attempt and the one that resumes from its bundle."""

from __future__ import annotations

import pytest

from agent.config import Config
from agent.verify.cadence import AFTER_ANCHOR, fingerprinted


def test_multiples_of_the_period_and_the_steps_after_a_save_are_fingerprinted() -> None:
    chosen = [step for step in range(40) if fingerprinted(step, every=16, anchor=20)]
    assert chosen == [0, 16, 20, 21, 22, 32]
    assert AFTER_ANCHOR == 2
    assert [s for s in range(5) if fingerprinted(s, every=1, anchor=None)] == [0, 1, 2, 3, 4]
    assert not fingerprinted(19, every=16, anchor=None)


def dead_attempt(*, every: int, saves: int, death: int) -> set[int]:
    """The steps an attempt fingerprints from a fresh start until it dies at ``death``,
    saving every ``saves`` steps (its anchor: the step of its last save)."""
    anchor, kept = None, set()
    for step in range(death + 1):
        if fingerprinted(step, every=every, anchor=anchor):
            kept.add(step)
        if step and step % saves == 0:
            anchor = step
            kept |= {step} if fingerprinted(step, every=every, anchor=anchor) else set()
    return kept


@pytest.mark.parametrize("every", [1, 3, 16])
@pytest.mark.parametrize(("saves", "death"), [(6, 9), (6, 6), (10, 37), (4, 5), (100, 130)])
def test_both_attempts_fingerprint_the_same_replayed_steps(
    every: int, saves: int, death: int
) -> None:
    bundle = death // saves * saves  # the newest save: the next attempt resumes from it
    dead = {step for step in dead_attempt(every=every, saves=saves, death=death) if step >= bundle}
    resumed = {s for s in range(bundle, death + 1) if fingerprinted(s, every=every, anchor=bundle)}
    assert dead == resumed
    assert {bundle + 1, bundle + 2} & set(range(death + 1)) <= resumed  # the first ones


def test_the_period_is_a_setting_of_at_least_one_step() -> None:
    assert Config.resolve({"run": "r"}, env={}).verify_every_steps == 32
    env = {"CKPT_VERIFY_EVERY_STEPS": "4"}
    assert Config.resolve({"run": "r"}, env=env).verify_every_steps == 4
    assert Config.resolve({"run": "r", "verify_every_steps": 1}, env=env).verify_every_steps == 1
    with pytest.raises(ValueError, match="CKPT_VERIFY_EVERY_STEPS"):
        Config.resolve({"run": "r", "verify_every_steps": 0}, env={})
    with pytest.raises(ValueError, match="not a number"):
        Config.resolve({"run": "r"}, env={"CKPT_VERIFY_EVERY_STEPS": "often"})
