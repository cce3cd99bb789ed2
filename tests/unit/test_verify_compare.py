"""The pure comparison of a resume's replayed steps with the interrupted attempt's."""

from __future__ import annotations

import pytest

from agent.verify.compare import Fingerprint, Mode, Verdict, Verification, compare, reduce

EXACT = Mode()


def prints(*losses: float, params: str = "aa", start: int = 10) -> list[Fingerprint]:
    return [
        Fingerprint(start + index, 0, loss, {"params": params, "params_norm": (1.0).hex()})
        for index, loss in enumerate(losses)
    ]


def verdict(
    expected: list[Fingerprint], got: list[Fingerprint], mode: Mode = EXACT
) -> Verification:
    mine = compare(expected, {each.place: each for each in got}, rank=0, mode=mode)
    return reduce([mine], mode=mode, from_attempt_id=7)


def test_equal_replayed_steps_are_verified_and_only_replayed_ones_count() -> None:
    result = verdict(prints(2.5, 2.4, 2.3), prints(2.5, 2.4))
    assert (result.verdict, result.steps_compared, result.from_attempt_id) == (
        Verdict.VERIFIED,
        2,
        7,
    )
    assert str(result) == (
        "verified bit for bit over 2 replayed steps: 2 of the 2 compared positions carried "
        "the parameters' sample"
    )


def test_only_the_parts_both_sides_kept_are_compared_and_only_such_positions_count() -> None:
    # 10: the loss on one side, the sample on the other; 11: both on both; 12: the loss.
    expected = [
        Fingerprint(10, 0, 2.5),
        *prints(2.4, start=11),
        Fingerprint(12, 0, 2.3),
    ]
    got = [
        *prints(9.9, params="aa", start=10)[:1],
        *prints(2.4, start=11),
        Fingerprint(12, 0, 2.3, {"params": "zz", "params_norm": (3.0).hex()}),
    ]
    got[0] = Fingerprint(10, 0, None, got[0].parts)
    result = verdict(expected, got)
    assert (result.verdict, result.steps_compared, result.steps_sampled) == (
        Verdict.VERIFIED,
        2,
        1,
    )
    assert result.detail == "1 of the 2 compared positions carried the parameters' sample"
    assert result.to_json()["steps_compared"] == 2


def test_a_window_with_no_part_both_kept_is_unverifiable_not_verified() -> None:
    expected = [Fingerprint(10, 0, 2.5), Fingerprint(11, 0, 2.4)]
    got = [Fingerprint(10, 0, None, {"params": "aa"}), Fingerprint(11, 0, None, {})]
    result = verdict(expected, got)
    assert (result.verdict, result.steps_compared) == (Verdict.UNVERIFIABLE, 0)
    assert "no replayed position carried a part both attempts kept" in result.detail


def test_a_position_kept_by_one_side_only_is_not_compared() -> None:
    expected = prints(2.5, 2.4, 2.3)
    got = [prints(2.5)[0], prints(2.3, start=12)[0]]  # 11 is not fingerprinted here
    result = verdict(expected, got)
    assert (result.verdict, result.steps_compared, result.steps_sampled) == (
        Verdict.VERIFIED,
        2,
        2,
    )


def test_nothing_replayed_is_unverifiable_and_says_why() -> None:
    result = verdict([], prints(2.5))
    assert result.verdict is Verdict.UNVERIFIABLE and "died right after" in result.detail


def test_a_loss_differing_at_the_first_step_points_at_the_data() -> None:
    result = verdict(prints(2.5, 2.4), prints(2.5000002, 2.4))
    assert result.verdict is Verdict.DIVERGED
    first = result.first_difference
    assert first is not None and (first.step, first.part) == (10, "loss")
    assert (first.expected, first.got) == ("2.5", "2.5000002")
    assert "data or rng" in result.detail


def test_equal_losses_with_differing_parameters_point_at_the_optimizer() -> None:
    result = verdict(prints(2.5, 2.4), [*prints(2.5), *prints(2.4, params="bb", start=11)])
    first = result.first_difference
    assert first is not None and (first.step, first.part) == (11, "params")
    assert "optimizer layer" in result.detail


def test_a_later_loss_difference_points_at_nondeterminism() -> None:
    result = verdict(prints(2.5, 2.4), prints(2.5, 2.41))
    assert "nondeterministic" in result.detail


def test_the_tolerance_mode_passes_small_differences_and_reports_the_largest() -> None:
    mode = Mode.parse("tolerance:1e-3")
    assert mode is not None
    result = verdict(prints(2.5, 2.4), prints(2.5001, 2.4, params="zz"), mode)
    assert result.verdict is Verdict.VERIFIED and result.mode == "tolerance"
    assert result.max_relative_difference == pytest.approx(0.0001 / 2.5001)
    assert verdict(prints(2.5), prints(2.6), mode).verdict is Verdict.DIVERGED


def test_ranks_reduce_to_the_first_difference_then_the_lowest_rank() -> None:
    expected = prints(1.0, 2.0, 3.0)
    late = compare(expected, {p.place: p for p in prints(1.0, 2.0, 9.0)}, rank=0, mode=EXACT)
    early = compare(expected, {p.place: p for p in prints(1.0, 8.0, 3.0)}, rank=1, mode=EXACT)
    result = reduce([late, early], mode=EXACT, from_attempt_id=None)
    assert result.first_difference is not None
    assert (result.first_difference.rank, result.first_difference.step) == (1, 11)
    assert result.steps_compared == 3


@pytest.mark.parametrize("text", ["exact ", "OFF", "tolerance:0", "tolerance:1e-6"])
def test_modes_parse(text: str) -> None:
    Mode.parse(text)


@pytest.mark.parametrize("text", ["fast", "tolerance", "tolerance:2", "tolerance:x", "exact:1"])
def test_a_bad_mode_says_what_to_write(text: str) -> None:
    with pytest.raises(ValueError, match="exact, off or tolerance"):
        Mode.parse(text)


def test_a_malformed_fingerprint_is_refused() -> None:
    with pytest.raises(ValueError, match="malformed"):
        Fingerprint.from_json({"step": 1, "parts": {"Bad Name": "x"}})
    with pytest.raises(ValueError, match="finite"):
        Fingerprint.from_json({"step": 1, "loss": float("nan")})
    again = Fingerprint.from_json(prints(2.5)[0].to_json())
    assert again == prints(2.5)[0]


def test_differing_parameters_without_a_loss_to_compare_name_no_one_layer() -> None:
    expected = [Fingerprint(10, 0, None, {"params": "aa"})]
    result = verdict(expected, [Fingerprint(10, 0, None, {"params": "bb"})])
    assert result.verdict is Verdict.DIVERGED
    assert "no loss was reported" in result.detail and "likely" not in result.detail
