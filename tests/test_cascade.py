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
    root = Problem("q", r"\frac{\sqrt{2}}{2}", "math")
    batch = [(half, r"so \boxed{\frac{1}{2}}"),  # exact
             (half, r"so \boxed{\frac{1}{2}}"),  # dedup of the first
             (root, r"\boxed{\frac{1}{\sqrt{2}}}"),  # verify: pass
             (root, r"\boxed{\sqrt{3}/2}"),      # verify: fail
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
    assert s["dedup_saved"] == 0.1 and s["cheap_fail"] == 0.4 and s["by_value"] == 0.1 and s["truncated"] == 0
    assert s["t_reward"] >= s["t_verify"] > 0
    assert set(res.time_s) == set(STAGES)


def test_numbers_settle_by_value_and_math_verify_takes_the_rest(cascade):
    nine, gsm = Problem("q", "9", "synthetic"), Problem("q", "1200", "gsm8k")
    big = Problem("q", "1200", "math")
    batch = [(nine, "a=4>4 b=5>9 #9"),    # exact: the same string
             (nine, "a=4>4 b=5>9 #7"),    # exact by value: fail
             (nine, "a=4>4 b=5>9 #9>"),   # cheap: one digit at the very end, or no answer
             (gsm, "#### 1,200"),         # exact after normalization
             (gsm, "#### 1300"),          # exact by value: fail
             (gsm, "#### 1200.5"),        # exact by value: fail
             (gsm, "#### 2400/2"),        # exact by value: pass
             (big, r"\boxed{1.2\times10^{3}}"),  # an expression: math-verify, a pass
             (big, r"\boxed{x}")]         # math-verify, a fail
    res = score(cascade, batch)
    assert res.rewards == [1, 0, 0, 1, 0, 0, 1, 1, 0]
    assert res.stages == ["exact", "exact", "cheap"] + ["exact"] * 4 + ["verify"] * 2
    assert res.reached["exact"] == 8 and res.reached["verify"] == 2 and res.by_value == 4
    assert res.summary()["by_value"] == 4 / 9 and res.summary()["reach_verify"] == 2 / 9
    res = score(cascade, [(Problem("q", "", "synthetic"), "#5")])  # no reference: a zero, not settled by value
    assert res.rewards == [0.0] and res.stages == ["exact"] and res.by_value == 0
    with Cascade(math_verify=False) as c:  # stage 3 alone: what it cannot settle scores 0
        res = score(c, batch)
    assert res.rewards == [1, 0, 0, 1, 0, 0, 1, 0, 0] and res.reached["verify"] == 0
    assert set(res.stages) == {"exact", "cheap"}


def test_dedup_is_within_a_group_only(cascade):
    p = Problem("q", "5", "math")
    res = score(cascade, [(p, r"\boxed{5}")] * 4, group_size=2)
    assert res.stages == ["exact", "dedup", "exact", "dedup"] and res.dedup_saved == 2


def test_plain_numbers_settle_by_value_in_stage_3(cascade):
    forms = ["1/2", "0.5", r"\frac{1}{2}", ".5", r"\dfrac{2}{4}"]
    wrong = ["1/3", "0.51", "2", "-1/2", r"\frac{2}{1}", "0.499999"]
    pairs = [(Problem("q", g, "math"), rf"\boxed{{{p}}}") for g in forms for p in forms + wrong]
    res = score(cascade, pairs)
    for (prob, text), r in zip(pairs, res.rewards):
        assert r == float(text[7:-1] in forms), (prob.answer, text)
    assert set(res.stages) == {"exact"} and res.reached["verify"] == 0
    assert res.errors == 0 and res.timeouts == 0


def test_math_verify_equivalent_forms(cascade):
    forms = [r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", r"\sqrt{2}/2", r"\sqrt{\frac{1}{2}}"]
    wrong = [r"\sqrt{2}", r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}", r"-\frac{\sqrt{2}}{2}"]
    pairs = [(Problem("q", g, "math"), rf"\boxed{{{p}}}") for g in forms for p in forms + wrong]
    res = score(cascade, pairs)
    for (prob, text), r, stage in zip(pairs, res.rewards, res.stages):
        same = prob.answer in forms and text[7:-1] in forms
        assert r == float(same), (prob.answer, text)
        assert stage == ("exact" if text[7:-1] == prob.answer else "verify")
    assert res.errors == 0 and res.timeouts == 0


def test_math_verify_off_means_exact_match_decides():
    root = Problem("q", r"\frac{\sqrt{2}}{2}", "math")
    with Cascade(math_verify=False) as c:
        res = score(c, [(root, r"\boxed{\frac{1}{\sqrt{2}}}"), (root, r"\boxed{\frac{\sqrt{2}}{2}}"),
                        (Problem("q", "1/2", "math"), r"\boxed{0.5}")])
    assert res.rewards == [0.0, 1.0, 1.0] and res.stages == ["exact"] * 3 and res.reached["verify"] == 0


def test_math_verify_that_hangs_times_out_and_the_worker_comes_back():
    with Cascade(verify_timeout_s=1.0) as c:
        p = Problem("q", "1", "math")
        t0 = time.monotonic()
        res = score(c, [(p, r"\boxed{10^{10^{10^{10}}}}"), (p, r"\boxed{\sqrt{1}}")])
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


# ---------------------------------------------------------------- regressions

def test_truncated_completions_score_zero_at_the_cheap_stage(cascade):
    gsm, five = Problem("q", "14", "gsm8k"), Problem("q", "5", "gsm8k")
    texts = ["so 7 x 2 = 14\n#### 14", "so 7 x 2 = 14\n#### 14", "so 7 x 2 = 14\n#### 14", "First 3 + 4 = 7, and"]
    finish = ["length", "eos", "stop", "length"]
    res = cascade.score_batch([gsm] * 4, texts, group_size=4, finish=finish)
    assert res.rewards == [0.0, 1.0, 1.0, 0.0]  # the same text, cut or not: dedup keeps them apart
    assert res.stages == ["cheap", "exact", "dedup", "cheap"]
    assert res.truncated == 2 and res.cheap_fail == {} and res.reached["cheap"] == 3 and res.dedup_saved == 1
    assert res.summary()["truncated"] == 2  # a count, like errors and timeouts
    assert combine([res, res]).truncated == 4
    res = cascade.score_batch([gsm, five], ["First 3 + 4 = 7, then 7 x 2 = 14, and", "I am not sure. 1 2 3 4 5"],
                              finish=["length", "length"])
    assert res.rewards == [0.0, 0.0] and res.truncated == 2
    with pytest.raises(ValueError, match="finish"):
        cascade.score_batch([gsm] * 2, texts[:2], finish=["eos"])
    with pytest.raises(ValueError, match="finish"):
        cascade.score_batch([gsm] * 2, texts[:2], finish="length")


def test_truncated_judge_only_rows_never_reach_the_judge():
    calls = []
    with Cascade(math_verify=False, judge=lambda *a: calls.append(a) or 1.0) as c:
        res = c.score_batch([Problem("q", "", "chat")] * 2, ["hello", "hello there"], finish=["eos", "length"])
    assert res.rewards == [1.0, 0.0] and res.stages == ["judge", "cheap"] and len(calls) == 1


def test_gsm8k_without_its_marker_scores_zero_in_the_cascade(cascade):
    res = score(cascade, [(Problem("q", "14", "gsm8k"), "First 3 + 4 = 7, then 7 x 2 = 14, and"),
                          (Problem("q", "5", "gsm8k"), "I am not sure. 1 2 3 4 5"),
                          (Problem("q", "12", "gsm8k"), "#### 18 - 6 = 12"),
                          (Problem("q", "0.5", "gsm8k"), "#### .5"),
                          (Problem("q", "0.5", "gsm8k"), "#### 1/2"),
                          (Problem("q", "1213", "gsm8k"), "#### 12,13")])
    assert res.rewards == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert res.stages == ["cheap", "cheap", "exact", "exact", "exact", "exact"]
    assert res.cheap_fail == {"no_answer": 2}


def test_no_decimal_for_a_symbolic_answer_and_no_number_for_a_tuple(cascade):
    batch = [(Problem("q", r"\sqrt{2}", "math"), r"\boxed{1.41421356}"),
             (Problem("q", r"\frac{\sqrt{2}}{2}", "math"), r"\boxed{0.70710678}"),
             (Problem("q", r"\frac{1}{3}", "math"), r"\boxed{0.333333}"),
             (Problem("q", r"2\pi", "math"), r"\boxed{6.2831853}"),
             (Problem("q", "(1,234)", "math"), r"\boxed{(1234)}"),   # math-verify: an interval, not 1234
             (Problem("q", "1234", "math"), r"\boxed{1,234}"),
             (Problem("q", r"\sqrt{2}", "math"), r"\boxed{\frac{2}{\sqrt{2}}}")]  # exact, symbolic: a pass
    res = score(cascade, batch)
    assert res.rewards == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert res.stages == ["exact"] * 4 + ["verify", "exact", "verify"]


def test_a_hung_judge_holds_at_most_judge_workers_threads():
    release = threading.Event()

    def judge(prompt, completion, reference):
        if "hang" in completion:
            release.wait(60)
        return 0.5

    def judge_threads():  # every thread, whatever its name: the judge must not add more than its workers
        return threading.active_count()

    p = Problem("q", "", "chat")
    before = judge_threads()
    with Cascade(math_verify=False, judge=judge, judge_timeout_s=0.2, judge_workers=2) as c:
        t0 = time.monotonic()
        res = c.score_batch([p] * 20, [f"hang {k}" for k in range(20)])
        assert time.monotonic() - t0 < 3
        assert res.rewards == [0.0] * 20 and res.timeouts == 20 and res.errors == 0
        assert judge_threads() - before <= 2
        t0 = time.monotonic()
        res = c.score_batch([p] * 20, [f"hang again {k}" for k in range(20)])  # all workers stuck: at once
        assert time.monotonic() - t0 < 0.5 and res.timeouts == 20
        assert judge_threads() - before <= 2
        release.set()  # the stuck calls return: their workers serve again
        deadline = time.monotonic() + 5
        while c._judges._stuck and time.monotonic() < deadline:
            time.sleep(0.01)
        res = c.score_batch([p] * 3, ["a", "b", "c"])
        assert res.rewards == [0.5] * 3 and res.timeouts == 0
        assert judge_threads() - before <= 2


def test_a_judge_score_out_of_range_is_an_error():
    values = {"huge": 1e39, "neg": -1e7, "inf": float("inf"), "bigint": 10 ** 400, "str": "0.5", "none": None,
              "edge": 1e6, "ok": 0.25, "int": 1, "bool": True}

    def judge(prompt, completion, reference):
        return values[completion]

    with Cascade(math_verify=False, judge=judge, judge_timeout_s=5.0) as c:
        res = c.score_batch([Problem("q", "", "chat")] * len(values), list(values))
    assert res.rewards == [0.0] * 6 + [1e6, 0.25, 1.0, 1.0]
    assert all(type(r) is float for r in res.rewards)
    assert res.errors == 6 and res.timeouts == 0 and all("not a finite number" in n for n in res.notes)


def test_every_reward_is_a_finite_float(cascade, mbpp, monkeypatch):
    class Run:
        passed, status, stderr = float("nan"), "ok", ""

    monkeypatch.setattr(reward, "run_tests", lambda *a, **k: Run())
    p = mbpp[0]
    res = score(cascade, [(p, fence(p.answer)), (p, fence(p.answer)), (p, fence("x = 1"))], group_size=3)
    assert res.rewards == [0.0, 0.0, 0.0] and res.stages == ["verify", "dedup", "verify"]
    assert res.errors == 2 and "not a finite number" in res.notes[0]
