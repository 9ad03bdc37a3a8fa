from fractions import Fraction

import pytest

from bidirl.reward import extract_answer, math_verify_reward, numeric_reward, parse_number, reference_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("72", 72), ("1,234", 1234), ("$5", 5), ("3.50", Fraction(7, 2)), ("-2", -2), ("18.0", 18),
        ("12.", 12), (".5", Fraction(1, 2)), ("$ 1,000.00", 1000),
    ],
)
def test_parse_number_normalises_commas_dollars_and_trailing_zeros(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "1/2", "2e3", "__import__('os')", "1 2"])
def test_parse_number_rejects_anything_that_is_not_a_plain_number(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("The total is 5 + 7 = 12.\n#### 12", 12),
        ("#### 1,200 dollars", 1200),
        ("first 3, then 4, so 7", 7),
        ("She paid $18.00 in all.", 18),
        ("#### 9\nlater text 100", 9),
        (" -4", -4),
        ("no number here", None),
        ("", None),
        # found in review: a marked answer is taken whole, or not at all
        ("#### 3/4", None), ("#### 1e6", None), ("#### 3 + 4 = 7", 7), ("#### 2 x 6 = 12", 12), ("#### 12.", 12),
        ("#### - 5", -5), ("answer: - 5", -5),
        # a hyphen is no minus sign, and commas separate thousands only
        ("from 2-3", 3), ("Answer: 10-3", 3), ("the pairs 1,2,3", 3), ("x = -5", -5), ("10,000,000 grains", 10_000_000),
    ],
)
def test_answer_is_the_number_after_hashes_else_the_last_number(completion, expected):
    assert extract_answer(completion) == expected


def test_model_text_is_never_evaluated():
    assert extract_answer("__import__('os').system('false') or 2**10") == 10


def test_reward_is_one_for_a_numerically_equal_answer_and_zero_otherwise():
    assert numeric_reward("so the answer is 18.0", "18") == 1.0
    assert numeric_reward("#### 17", "18") == 0.0
    assert numeric_reward("", "18") == 0.0


def test_format_reward_is_off_by_default_and_added_when_asked():
    assert numeric_reward("#### 17", "18") == 0.0
    assert numeric_reward("#### 17", "18", format_reward=0.1) == pytest.approx(0.1)
    assert numeric_reward("#### 18", "18", format_reward=0.1) == pytest.approx(1.1)


def test_reference_answer_reads_the_gsm8k_answer_line():
    assert reference_answer("He has 2+3=<<2+3=5>>5 apples.\n#### 5") == 5
    assert reference_answer("Total: 1,000\n#### 1,000") == 1000
    with pytest.raises(ValueError):
        reference_answer("no answer line")


def test_math_verify_accepts_equivalent_expressions():
    assert math_verify_reward("The answer is $\\frac{1}{2}$", "$0.5$") == 1.0
    assert math_verify_reward("The answer is $\\frac{1}{3}$", "$0.5$") == 0.0


def test_math_verify_times_out_as_wrong_instead_of_hanging(monkeypatch):
    import time

    import bidirl.reward as reward

    monkeypatch.setattr(reward, "_math_verify", lambda completion, reference: time.sleep(2) or True)
    assert math_verify_reward("x", "x", timeout_s=0.1) == 0.0
