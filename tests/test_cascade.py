"""The verifier cascade: which stage decides what, dedup, math-verify, the judge's faults, code in the
sandbox. One math-verify worker is shared by the module (starting one costs about a second)."""
import json
import os
import sys
import threading
import time
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import reward  # noqa: E402
from tasks import Problem, problems_from_mbpp_rows  # noqa: E402
from reward import STAGES, Cascade, RewardResult, combine  # noqa: E402

MBPP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "mbpp_small.jsonl")
FAST_SANDBOX = dict(timeout_s=3.0, cpu_s=1)


@pytest.fixture(scope="module")
def cascade():
    with Cascade(max_chars=200, verify_timeout_s=3.0, code_limits=FAST_SANDBOX) as c:
        yield c


@pytest.fixture(scope="module")
def mbpp():
    """The fixture's rows, parsed without `datasets` (slow to import; test_prompts covers load_mbpp)."""
    with open(MBPP) as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixture's malformed row
        return problems_from_mbpp_rows([json.loads(line) for line in f])


def fence(code):
    return f"Here it is:\n```python\n{code}\n```\n"


def score(c, pairs, group_size=1):
    return c.score_batch([p for p, _ in pairs], [t for _, t in pairs], group_size)


def test_stage_counts_on_a_hand_made_batch(cascade):
    half, gsm = Problem("q", r"\frac{1}{2}", "math"), Problem("q", "72", "gsm8k")
    batch = [(half, r"so \boxed{\frac{1}{2}}"),  # exact
             (half, r"so \boxed{\frac{1}{2}}"),  # dedup of the first
             (half, r"\boxed{0.5}"),             # verify: pass
             (half, r"\boxed{1/3}"),             # verify: fail
             (half, "no box at all"),            # cheap: no answer
             (half, "   "),                      # cheap: empty
             (gsm, "so 72\n#### 72.0"),          # exact after normalization
             (gsm, "#### 71"),                   # exact: two integers that differ, a clear fail
             (gsm, "#### 72 " + "x" * 200),      # cheap: over max_chars
             (gsm, None)]                        # not a string: empty
    res = score(cascade, batch, group_size=2)  # 5 groups of 2
    assert res.rewards == [1, 1, 1, 0, 0, 0, 1, 0, 0, 0]
    assert res.stages == ["exact", "dedup", "verify", "verify", "cheap", "cheap", "exact", "exact", "cheap", "cheap"]
    assert res.reached == {"dedup": 10, "cheap": 9, "exact": 5, "verify": 2, "judge": 0}
    assert res.dedup_saved == 1 and res.saved_expensive == 0 and res.by_value == 1
    assert res.cheap_fail == {"no_answer": 1, "empty": 2, "too_long": 1}
    assert res.errors == 0 and res.timeouts == 0
    assert res.cost_s[2] > 0 and res.cost_s[0] == 0.0
    s = res.summary()
    assert s["reach_exact"] == 0.5 and s["reach_verify"] == 0.2 and s["reach_judge"] == 0.0
    assert s["dedup_saved"] == 0.1 and s["cheap_fail"] == 0.4 and s["by_value"] == 0.1
    assert s["t_reward"] >= s["t_verify"] > 0
    assert set(res.time_s) == set(STAGES)


def test_integers_settle_by_value_and_math_verify_takes_the_rest(cascade):
    nine, gsm = Problem("q", "9", "synthetic"), Problem("q", "1200", "gsm8k")
    batch = [(nine, "a=4>4 b=5>9 #9"),    # exact: the same string
             (nine, "a=4>4 b=5>9 #09"),   # exact by value: pass
             (nine, "a=4>4 b=5>9 #7"),    # exact by value: fail
             (nine, "a=4>4 b=5>9 #9>"),   # not an integer: math-verify reads 9, a pass
             (nine, "a=4>4 b=5>9 #x"),    # not an integer: math-verify, a fail
             (gsm, "#### 1,200"),         # exact after normalization
             (gsm, "#### 1300"),          # exact by value: fail
             (gsm, "#### 1200.5")]        # a decimal: math-verify, a fail
    res = score(cascade, batch)
    assert res.rewards == [1, 1, 0, 1, 0, 1, 0, 0]
    assert res.stages == ["exact"] * 3 + ["verify"] * 2 + ["exact"] * 2 + ["verify"]
    assert res.reached["exact"] == 8 and res.reached["verify"] == 3 and res.by_value == 3
    assert res.summary()["by_value"] == 3 / 8 and res.summary()["reach_verify"] == 3 / 8
    res = score(cascade, [(Problem("q", "", "synthetic"), "#5")])  # no reference: a zero, not settled by value
    assert res.rewards == [0.0] and res.stages == ["exact"] and res.by_value == 0
    with Cascade(math_verify=False) as c:  # stage 3 alone: what it cannot settle scores 0
        res = score(c, batch)
    assert res.rewards == [1, 1, 0, 0, 0, 1, 0, 0] and set(res.stages) == {"exact"} and res.reached["verify"] == 0


def test_dedup_is_within_a_group_only(cascade):
    p = Problem("q", "5", "math")
    res = score(cascade, [(p, r"\boxed{5}")] * 4, group_size=2)
    assert res.stages == ["exact", "dedup", "exact", "dedup"] and res.dedup_saved == 2


def test_math_verify_equivalent_forms(cascade):
    forms = ["1/2", "0.5", r"\frac{1}{2}"]
    wrong = ["1/3", "0.51", "2", "-1/2", r"\frac{2}{1}"]
    pairs = [(Problem("q", g, "math"), rf"\boxed{{{p}}}") for g in forms for p in forms + wrong]
    res = score(cascade, pairs)
    for (prob, text), r, stage in zip(pairs, res.rewards, res.stages):
        same = prob.answer in forms and text[7:-1] in forms
        assert r == float(same), (prob.answer, text)
        assert stage == ("exact" if text[7:-1] == prob.answer else "verify")
    assert res.errors == 0 and res.timeouts == 0


def test_math_verify_off_means_exact_match_decides():
    with Cascade(math_verify=False) as c:
        res = score(c, [(Problem("q", "1/2", "math"), r"\boxed{0.5}"), (Problem("q", "1/2", "math"), r"\boxed{1/2}")])
    assert res.rewards == [0.0, 1.0] and res.stages == ["exact", "exact"] and res.reached["verify"] == 0


def test_math_verify_that_hangs_times_out_and_the_worker_comes_back():
    with Cascade(verify_timeout_s=1.0) as c:
        p = Problem("q", "1", "math")
        t0 = time.monotonic()
        res = score(c, [(p, r"\boxed{10^{10^{10^{10}}}}"), (p, r"\boxed{2/2}")])
        assert time.monotonic() - t0 < 30
    assert res.rewards == [0.0, 1.0] and res.stages == ["verify", "verify"]
    assert res.timeouts == 1 and res.errors == 0 and res.notes == ["verify: timeout"]


def test_a_raising_and_a_hanging_judge_give_zero_and_are_counted():
    release = threading.Event()

    def judge(prompt, completion, reference):
        if "raise" in completion:
            raise RuntimeError("the judge broke")
        if "hang" in completion:
            release.wait(30)
        if "exit" in completion:
            sys.exit(3)  # must not end the trainer
        if "nan" in completion:
            return float("nan")
        return 0.75

    p = Problem("Say something nice.", "", "chat")  # no verifier for this task: the judge decides
    texts = ["please raise", "please hang", "please exit", "a nan", "a good answer", "please hang too"]
    with Cascade(math_verify=False, judge=judge, judge_timeout_s=0.5, judge_workers=2) as c:
        t0 = time.monotonic()
        res = c.score_batch([p] * len(texts), texts)
        took = time.monotonic() - t0
    release.set()
    assert took < 5
    assert res.rewards == [0.0, 0.0, 0.0, 0.0, 0.75, 0.0]
    assert res.stages == ["judge"] * 6 and res.reached["judge"] == 6
    assert res.timeouts == 2 and res.errors == 3
    assert any("RuntimeError: the judge broke" in n for n in res.notes)
    assert any("not a finite number" in n for n in res.notes)
    s = res.summary()
    assert s["errors"] == 3 and s["timeouts"] == 2 and s["reach_judge"] == 1.0


def test_judge_modes_and_dedup_saves_judge_calls():
    calls = []

    def judge(prompt, completion, reference):
        calls.append(completion)
        return 0.5

    p = Problem("q", "3", "math")
    texts = [r"\boxed{3}", r"\boxed{4}", r"\boxed{4}", "nothing"]
    with Cascade(math_verify=False, judge=judge) as c:  # judge_on="rejected": a second look at the zeros
        res = c.score_batch([p] * 4, texts, group_size=4)
    assert res.rewards == [1.0, 0.5, 0.5, 0.0]
    assert res.stages == ["exact", "judge", "dedup", "cheap"]
    assert calls == [r"\boxed{4}"] and res.saved_expensive == 1
    calls.clear()
    with Cascade(math_verify=False, judge=judge, judge_on="passed") as c:  # a grade for what passed
        res = c.score_batch([p] * 4, texts, group_size=4)
    assert res.rewards == [0.5, 0.0, 0.0, 0.0] and res.stages == ["judge", "exact", "dedup", "cheap"]
    assert calls == [r"\boxed{3}"]


def test_an_extractor_that_raises_is_counted_not_fatal(cascade, monkeypatch):
    def broken(text):
        raise KeyError("boom")

    monkeypatch.setitem(reward.EXTRACTORS, "synthetic", broken)
    res = score(cascade, [(Problem("q", "6", "synthetic"), "#6"), (Problem("q", "5", "math"), r"\boxed{5}")])
    assert res.rewards == [0.0, 1.0] and res.stages == ["cheap", "exact"]
    assert res.errors == 1 and res.cheap_fail == {"error": 1} and "KeyError" in res.notes[0]


def test_code_correct_and_wrong_via_the_sandbox(cascade, mbpp):
    p = mbpp[0]  # digit_sum
    assert p.task == "code"
    batch = [(p, fence("def digit_sum(n):\n    return sum(int(d) for d in str(n))")),
             (p, fence("def digit_sum(n):\n    return len(str(n))")),            # wrong
             (p, fence("def digit_sum(n):\n    while True:\n        pass")),     # never ends
             (p, fence("def digit_sum(n) return 0")),                           # cheap: syntax
             (p, "def digit_sum(n):\n    return 0")]                            # cheap: no block
    res = score(cascade, batch)
    assert res.rewards == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert res.stages == ["verify", "verify", "verify", "cheap", "cheap"]
    assert res.reached["exact"] == 0 and res.reached["verify"] == 3
    assert res.cheap_fail == {"syntax": 1, "no_code_block": 1}
    assert res.code_status["ok"] == 1 and res.code_status["failed"] == 1
    assert res.code_status["timeout"] + res.code_status["cpu_limit"] == 1
    assert res.errors == 0  # a program that fails its tests is a zero, not a fault


def test_mbpp_reference_solutions_pass_with_their_setup_code(cascade, mbpp):
    res = score(cascade, [(p, fence(p.answer)) for p in mbpp])
    assert res.rewards == [1.0] * len(mbpp) and set(res.stages) == {"verify"}
    no_setup = Problem("q", "", "code", dict(mbpp[2].meta, test_setup_code=""))  # its tests need `data`
    assert score(cascade, [(no_setup, fence(mbpp[2].answer))]).rewards == [0.0]


def test_bad_arguments_raise_with_the_name():
    p = Problem("q", "1", "math")
    with Cascade(math_verify=False) as c:
        with pytest.raises(ValueError, match="2 problems but 1 completions"):
            c.score_batch([p, p], ["a"])
        with pytest.raises(ValueError, match="group_size"):
            c.score_batch([p] * 3, ["a"] * 3, group_size=2)
        with pytest.raises(ValueError, match="task 'chat'.*judge"):
            c.score_batch([Problem("q", "", "chat")], ["a"])
        with pytest.raises(ValueError, match="test_list"):
            c.score_batch([Problem("q", "", "code")], ["a"])
    for kwargs, name in [({"max_chars": 0}, "max_chars"), ({"verify_timeout_s": -1}, "verify_timeout_s"),
                         ({"code_workers": 0}, "code_workers"), ({"judge_on": "always"}, "judge_on")]:
        with pytest.raises(ValueError, match=name):
            Cascade(**kwargs)
    with pytest.raises(TypeError, match="judge"):
        Cascade(judge="not callable")


def test_combine_adds_up():
    a = RewardResult([1.0], ["exact"], [0.0], errors=1, notes=["x"])
    a.reached["exact"] = 1
    b = RewardResult([0.0, 0.0], ["cheap", "dedup"], [0.0, 0.0], dedup_saved=1, timeouts=2)
    b.cheap_fail["empty"] = 1
    c = combine([a, b])
    assert c.rewards == [1.0, 0.0, 0.0] and c.stages == ["exact", "cheap", "dedup"]
    assert c.reached["exact"] == 1 and c.errors == 1 and c.timeouts == 2 and c.dedup_saved == 1
    assert c.cheap_fail == {"empty": 1} and c.notes == ["x"]
    assert c.summary()["dedup_saved"] == pytest.approx(1 / 3)
