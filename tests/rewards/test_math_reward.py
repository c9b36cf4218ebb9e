import pytest

from rewards.math import math_reward


@pytest.mark.parametrize("response,truth,expected", [
    ("47*8=376,23+376=399\\boxed{399}", "399", 1.0),
    ("\\boxed{ 399 }", "399", 1.0),
    ("so \\boxed{398}", "399", 0.0),
    ("the answer is 399", "399", 0.0),  # no boxed answer
    ("\\boxed{399", "399", 0.0),  # unclosed
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last boxed answer counts
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
])
def test_math_reward_cases(response, truth, expected):
    assert math_reward("q", response, ground_truth=truth) == expected


def test_no_ground_truth_is_not_applicable():
    assert math_reward("q", "\\boxed{1}", ground_truth=None) is None


def test_require_boxed_can_be_turned_off():
    assert math_reward("q", "\\boxed{12}", ground_truth="12", require_boxed=False) == 1.0


def test_digit_credit_by_hand():
    from rewards.math import digit_credit_reward
    assert digit_credit_reward("q", "\\boxed{123}", ground_truth="123") == 1.0
    assert digit_credit_reward("q", "so \\boxed{124}", ground_truth="123") == pytest.approx(2 / 3)  # 1, 2 in place
    assert digit_credit_reward("q", "\\boxed{23}", ground_truth="123") == pytest.approx(2 / 3)  # units and tens
    assert digit_credit_reward("q", "\\boxed{5123}", ground_truth="123") == pytest.approx(3 / 4)  # a digit too many
    assert digit_credit_reward("q", "123", ground_truth="123") == 0.0  # not boxed
    assert digit_credit_reward("q", "\\boxed{x}", ground_truth="123") == 0.0
    assert digit_credit_reward("q", "\\boxed{1}", ground_truth=None) is None


def test_exact_match_reward():
    from rewards.match import exact_match_reward
    assert exact_match_reward("rev:abc=", " cba\n", ground_truth="cba") == 1.0
    assert exact_match_reward("rev:abc=", "cba\nmore text", ground_truth="cba") == 1.0  # the first line counts
    assert exact_match_reward("rev:abc=", "cba\nmore text", ground_truth="cba", first_line=False) == 0.0
    assert exact_match_reward("q", "CBA", ground_truth="cba") == 0.0
    assert exact_match_reward("q", "CBA", ground_truth="cba", ignore_case=True) == 1.0
    assert exact_match_reward("q", "cb", ground_truth="cba") == 0.0
    assert exact_match_reward("q", "cba", ground_truth=None) is None
