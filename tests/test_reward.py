import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reward import cheap_verdict, normalize_answer, score, score_one  # noqa: E402
from tasks import (  # noqa: E402
    Problem, extract_answer, extract_boxed, extract_hash_answer, extract_synthetic, last_number, make_synthetic,
)


@pytest.mark.parametrize("text, want", [
    ("so 48 + 24 = 72\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("#### 1,234.", "1234"),
    ("#### $1,200.", "1200"),
    ("#### -5", "-5"),
    ("#### 2.5", "2.5"),
    ("first #### 3 then\n#### 7", "7"),
    ("#### 18\nsome trailing chatter", "18"),
    ("no marker, the answer is 12", None),
    ("####   ", None),
    ("#### seven", "seven"),
])
def test_extract_hash_answer(text, want):
    assert extract_hash_answer(text) == want


@pytest.mark.parametrize("text, want", [
    (r"so $x = \boxed{5}$", "5"),
    (r"\boxed{\frac{a}{b^{2}}}", r"\frac{a}{b^{2}}"),
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"\fbox{42}", "42"),
    (r"\boxed{1} and finally \fbox{\sqrt{2}}", r"\sqrt{2}"),
    (r"set $\boxed{\{1, 2\}}$", r"\{1, 2\}"),
    (r"\boxed{\left\{ x \right.}", r"\left\{ x \right."),
    (r"so the answer is \boxed 7$.", "7"),
    (r"\boxed{3} then a truncated \boxed{\frac{1}{", "3"),
    ("no box here, the answer is 12", None),
    (r"\boxed{", None),
    (None, None),
])
def test_extract_boxed(text, want):
    assert extract_boxed(text) == want


@pytest.mark.parametrize("text, want", [
    ("a=7>7 b=2>9 a=7>6 #6", "6"),
    ("a=7>7 #7\n", "7"),
    ("#3 then later #5 done", "5"),
    ("# 4", "4"),
    ("a=7>7 b=2>9", None),
    ("a=7>7 #", None),
    ("", None),
])
def test_extract_synthetic(text, want):
    assert extract_synthetic(text) == want


def test_last_number():
    assert last_number("3 apples and 1,200 pears.") == "1200"
    assert last_number("nothing") is None


@pytest.mark.parametrize("raw, want", [
    (" 5 ", "5"),
    ("$5$", "5"),
    ("1,234", "1234"),
    ("1,234,567", "1234567"),
    ("(1,2)", "(1,2)"),
    ("5.", "5"),
    ("5.0", "5"),
    ("5.00", "5"),
    ("-3.000", "-3"),
    ("2.50", "2.50"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"\frac{1}{2}", r"\frac{1}{2}"),
    (None, ""),
])
def test_normalize_answer(raw, want):
    assert normalize_answer(raw) == want


@pytest.mark.parametrize("pred,gold,want", [
    ("72", "72", True), ("072", "72", True), ("-0", "0", True), ("5.0", "5", True), ("1,200", "1200", True),
    ("71", "72", False), ("-72", "72", False), ("", "3", False), ("3", "", False), (None, "3", False),
    (r"\frac{1}{2}", r"\frac{1}{2}", True),  # equal strings settle anything
    ("0.5", r"\frac{1}{2}", None), ("0.3333333", "0.333333", None), ("9>", "9", None), ("4+5", "9", None),
    ("1" + "0" * 5000, "0" + "1" + "0" * 5000, True),  # longer than int() takes
])
def test_cheap_verdict(pred, gold, want):
    assert cheap_verdict(pred, gold) is want


def test_score_synthetic_right_and_wrong():
    p = make_synthetic(1, seed=3, difficulty=5)[0]
    assert score_one(p, p.meta["trace"]) == 1.0
    wrong = (int(p.answer) + 1) % 10
    assert score_one(p, p.meta["trace"].rsplit("#", 1)[0] + f"#{wrong}") == 0.0
    assert score_one(p, "no answer at all") == 0.0
    assert score_one(p, p.meta["trace"].rsplit("#", 1)[0] + f"#0{p.answer}") == 1.0  # equal as integers
    assert score_one(p, p.meta["trace"] + ">") == 0.0  # only math-verify (in the Cascade) reads "9>"


def test_score_gsm8k():
    p = Problem("q", "1200", "gsm8k")
    assert score_one(p, "25 * 48 = 1,200\n#### 1,200") == 1.0
    assert score_one(p, "#### 1200.00") == 1.0
    assert score_one(p, "I think it is 1200.") == 1.0  # fallback: last number in the text
    assert score_one(p, "#### 1200 is wrong, it is 1300") == 1.0  # "####" wins over the last number
    assert score_one(p, "#### 1300") == 0.0
    assert score_one(p, "no idea") == 0.0


def test_score_math():
    p = Problem("q", r"\frac{1}{2}", "math")
    assert score_one(p, r"so the probability is $\boxed{\frac{1}{2}}$.") == 1.0
    assert score_one(p, r"$\boxed{\frac{1}{3}}$") == 0.0
    assert score_one(p, r"\boxed{\frac{1}{3}} no wait \boxed{\frac {1}{2}}") == 1.0
    assert score_one(p, "the answer is 1/2") == 0.0  # no box
    assert score_one(Problem("q", "5", "math"), r"\boxed{5.0}") == 1.0


def test_score_batch_and_errors():
    ps = [Problem("q", "6", "synthetic"), Problem("q", "72", "gsm8k"), Problem("q", "3", "math")]
    assert score(ps, ["x #6", "#### 71", r"\boxed{3}"]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError):
        score(ps, ["x #6"])
    with pytest.raises(ValueError):
        score_one(Problem("q", "1", "code"), "1")
    assert extract_answer("gsm8k", "it is 4") == "4"
    assert score_one(Problem("q", "", "gsm8k"), "") == 0.0
    assert score_one(Problem("q", "1", "gsm8k"), None) == 0.0
