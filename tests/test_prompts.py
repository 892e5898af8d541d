import json
import os
import subprocess
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from prompts import PromptSampler  # noqa: E402
from tasks import (  # noqa: E402
    CODE_INSTRUCTION, GSM8K_INSTRUCTION, MATH_INSTRUCTION, Problem, build_char_tokenizer,
    format_prompt, load_gsm8k, load_math, load_mbpp, make_synthetic, problems_from_gsm8k_rows,
    problems_from_math_rows, problems_from_mbpp_rows, synthetic_trace,
)

FIX = os.path.join(ROOT, "tests", "fixtures")
GSM = os.path.join(FIX, "gsm8k_small.jsonl")
MATH = os.path.join(FIX, "math_small.jsonl")
MBPP = os.path.join(FIX, "mbpp_small.jsonl")


# ---------------------------------------------------------------- synthetic task

def test_marked_order_keeps_every_step_at_one_distance():
    """order="marked": every prompt lists MARKED_VARS items of 4 characters, the chain's last one
    (item d) ending in "."; the trace is 4 characters a step (value, running sum, separator) and
    ends on the sum of the first d values; synthetic_trace rebuilds it from the prompt; a chain
    longer than the items is refused, by make_synthetic and when the config is parsed."""
    from config import MARKED_VARS, parse_config
    for p in make_synthetic(50, seed=3, difficulty=(2, MARKED_VARS), order="marked"):
        d, items = p.meta["difficulty"], p.prompt[:-2]
        assert p.prompt.endswith("?\n") and len(items) == 4 * MARKED_VARS
        seps = items[3::4]
        assert seps.index(".") == d - 1 and seps.count(".") == 1
        values = [int(v) for v in items[2::4]]
        steps = p.meta["trace"].split("#")[0]
        assert len(steps) == 4 * d and steps[3::4] == seps[:d]
        assert p.answer == str(sum(values[:d]) % 10) == p.meta["trace"].split("#")[1]
        assert synthetic_trace(p) == p.meta["trace"]
    with pytest.raises(ValueError, match="up to"):
        make_synthetic(1, seed=0, difficulty=MARKED_VARS + 1, order="marked")
    with pytest.raises(ValueError, match="'difficulty' must be at most"):
        parse_config(["--order=marked", f"--difficulty=(2,{MARKED_VARS + 1})"])


def test_lagged_order_copies_at_the_lag_and_ends_on_a_zero_line_start():
    """order="lagged", checked against a second, plain reading of its rule: the prompt is LAG_LINES
    lines of LAG_WIDTH digit pairs; each trace pair "vs" has v = the s of the pair LAG_LINES lines
    above (the same token distance for every pair) and s = (previous s + v) mod 10; the trace stops
    where a line's first v would be 0, with "#" and the last s, which is the answer; d counts the
    lines and is drawn from its whole range; synthetic_trace rebuilds the trace from the prompt."""
    from collections import Counter
    from tasks import LAG_LINES, LAG_WIDTH
    line, lag = 2 * LAG_WIDTH + 1, LAG_LINES * (2 * LAG_WIDTH + 1)
    ps = make_synthetic(60, seed=4, difficulty=(2, 9), order="lagged")
    assert set(Counter(p.meta["difficulty"] for p in ps)) == set(range(2, 10))
    for p in ps:
        assert len(p.prompt) == lag and p.prompt[line - 1::line] == "\n" * LAG_LINES
        text = p.prompt + p.meta["trace"]
        body, answer = text.split("#")
        assert len(body) == lag + line * p.meta["difficulty"] and answer == p.answer
        for i in range(lag, len(body)):
            col = (i - lag) % line
            if col == 2 * LAG_WIDTH:
                assert body[i] == "\n"
            elif col % 2 == 0:  # v: the token one lag back, less one (its pair's s)
                assert body[i] == body[i - lag + 1] and not (col == 0 and body[i] == "0")
            else:  # s: the s before it (across the line break) plus this v
                prev = i - 2 if col > 1 else i - 3
                assert int(body[i]) == (int(body[prev]) + int(body[i - 1])) % 10
        # "#" stands where a line's first v would copy a 0; the answer is the last s
        assert body[-2] == p.answer and body[len(body) - lag + 1] == "0"
        assert synthetic_trace(p) == p.meta["trace"]


def test_lagged_teacher_slips_at_its_pattern_and_sft_sees_a_prefix(tmp_path):
    """The lagged teacher (warmstart.teacher_trace): with slip 0 it is the reference trace, cut at
    sft_max_lines lines (no "#" then, and sft_target adds no EOS to a prefix); with slip 1 the
    first difference from the reference is an s of 9 where the pair before is "99" and v is 9."""
    import random
    from warmstart import sft_target, teacher_trace
    from config import parse_config
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    SFT_LINES = 5
    cfg = parse_config(["--order=lagged", "--difficulty=(2,30)", f"--sft_max_lines={SFT_LINES}"])
    slipped = 0
    for p in make_synthetic(40, seed=6, difficulty=(2, 30), order="lagged"):
        ref = p.meta["trace"]
        assert teacher_trace(p, 0.0, random.Random(0)) == ref  # no cap: the whole trace
        got = teacher_trace(p, 0.0, random.Random(0), 0.0, SFT_LINES)
        if p.meta["difficulty"] < SFT_LINES:
            assert got == ref and sft_target(tok, p, cfg, random.Random(0))[-1] == tok.eos_token_id
        else:
            assert "#" not in got and ref.startswith(got) and got.count("\n") == SFT_LINES
            assert sft_target(tok, p, cfg, random.Random(0))[-1] != tok.eos_token_id
        full = p.prompt + ref
        slip = teacher_trace(p, 0.0, random.Random(0), slip=1.0)
        k = next((i for i, (a, b) in enumerate(zip(slip, ref)) if a != b), None)
        if k is not None:
            slipped += 1
            i = len(p.prompt) + k
            assert slip[k] == "9" and full[i] == "8" and full[i - 3:i] in ("999", "99\n")
    assert slipped >= 3
    with pytest.raises(ValueError, match="sft_noise"):
        parse_config(["--order=lagged", "--sft_noise=0.1"])
    with pytest.raises(ValueError, match="sft_max_lines"):
        parse_config(["--order=marked", "--sft_max_lines=3"])


@pytest.mark.parametrize("order,n_vars", [("defined", 3), ("shuffled", 5)])
def test_synthetic_example_format(order, n_vars):
    p = make_synthetic(1, seed=0, difficulty=3, order=order)[0]
    assigns, expr = p.prompt.rstrip("\n").split("?")
    values = {k: int(v) for k, v in (a.split("=") for a in assigns.split(","))}
    terms = expr.split("+")
    assert p.prompt.endswith("\n") and p.task == "synthetic"
    assert len(values) == n_vars and len(terms) == 3 and set(terms) <= set(values) and len(set(terms)) == 3
    assert order == "shuffled" or terms == list(values)  # "defined": summed in the order of definition
    assert all(0 <= v <= 9 for v in values.values())
    running, steps = 0, []
    for t in terms:
        running = (running + values[t]) % 10
        steps.append(f"{t}={values[t]}>{running}")
    assert p.meta["trace"] == " ".join(steps) + f" #{running}"
    assert p.answer == str(running) == str(sum(values[t] for t in terms) % 10)
    assert p.meta["difficulty"] == 3


def test_synthetic_trace_matches_docstring_example():
    p = Problem("c=4,a=7,b=2?a+b+a\n", "6", "synthetic")
    assert synthetic_trace(p) == "a=7>7 b=2>9 a=7>6 #6"


def test_synthetic_determinism_and_range():
    a = make_synthetic(50, seed=7, difficulty=(2, 9))
    assert a == make_synthetic(50, seed=7, difficulty=(2, 9))
    assert a != make_synthetic(50, seed=8, difficulty=(2, 9))
    ds = {p.meta["difficulty"] for p in a}
    assert ds <= set(range(2, 10)) and len(ds) > 3
    for p in a:
        assert synthetic_trace(p) == p.meta["trace"]
        assert len(p.meta["trace"].split(" ")) == p.meta["difficulty"] + 1


def test_synthetic_answer_is_last_running_sum():
    for p in make_synthetic(30, seed=1, difficulty=(1, 20)):
        last_step = p.meta["trace"].split(" ")[-2]
        assert last_step.split(">")[1] == p.answer
        assert p.meta["trace"].endswith(f"#{p.answer}")


@pytest.mark.parametrize("order", ["defined", "shuffled"])
def test_synthetic_length_grows_with_difficulty(order):
    lens = [len(make_synthetic(1, seed=0, difficulty=d, order=order)[0].meta["trace"]) for d in (1, 10, 50, 200)]
    assert lens == sorted(lens) and len(set(lens)) == 4
    assert lens[-1] > 1000
    p = make_synthetic(1, seed=0, difficulty=200, order=order)[0]
    names = [a.split("=")[0] for a in p.prompt.split("?")[0].split(",")]
    assert len(set(names)) == len(names) >= 200  # two-letter names once the alphabet runs out
    assert synthetic_trace(p) == p.meta["trace"]


@pytest.mark.parametrize("bad", [0, -1, (0, 3), (5, 2)])
def test_synthetic_bad_difficulty(bad):
    with pytest.raises(ValueError):
        make_synthetic(3, seed=0, difficulty=bad)


# ---------------------------------------------------------------- tokenizer

@pytest.fixture(scope="module")
def char_tok(tmp_path_factory):
    return build_char_tokenizer(str(tmp_path_factory.mktemp("chartok")))


def test_char_tokenizer_vocab(char_tok, tmp_path_factory):
    tok = char_tok
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0
    assert tok.eos_token == "<eos>" and tok.eos_token_id == 1
    assert tok.unk_token_id == 2
    assert tok.convert_tokens_to_ids("\n") == 3
    assert len(tok) == 3 + 1 + 95
    assert tok.bos_token is None


def test_char_tokenizer_saved_files(tmp_path):
    build_char_tokenizer(str(tmp_path / "tok"))
    assert (tmp_path / "tok" / "tokenizer.json").exists()
    assert (tmp_path / "tok" / "tokenizer_config.json").exists()
    assert not [p for p in (tmp_path / "tok").iterdir() if p.name.startswith(".tmp")]


def test_char_tokenizer_built_by_many_processes_at_once(tmp_path):
    # the ranks of a torchrun job all build it in the same folder: none may read another's half-file
    code = ("import sys; sys.path.insert(0, '.'); from tasks import build_char_tokenizer as b; "
            f"[b({str(tmp_path / 'tok')!r}).encode('a=1') for _ in range(40)]")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE)
             for _ in range(4)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs


@pytest.mark.parametrize("s", [
    "a=7>7 b=2>9 a=7>6 #6",
    "c=4,a=7,b=2?a+b+a\n",
    "  two leading spaces, trailing  ",
    "line one\nline two .\n\n , ? ! it's \"quoted\" ~`{}[]\\|",
    "".join(chr(c) for c in range(32, 127)),
])
def test_char_tokenizer_round_trip(char_tok, s):
    ids = char_tok.encode(s)
    assert len(ids) == len(s)  # one token per char, no BOS/EOS added
    assert char_tok.decode(ids) == s
    assert char_tok(s)["input_ids"] == ids


def test_char_tokenizer_unknown_and_specials(char_tok):
    ids = char_tok.encode("aé b")
    assert ids[1] == 2 and len(ids) == 4
    assert char_tok.decode(char_tok.encode("ab") + [char_tok.eos_token_id], skip_special_tokens=True) == "ab"
    batch = char_tok(["abc", "a"], padding=True)
    assert batch["input_ids"][1][1:] == [0, 0]


def test_char_tokenizer_long_synthetic_trace(char_tok):
    p = make_synthetic(1, seed=0, difficulty=170)[0]
    assert len(char_tok.encode(p.meta["trace"])) > 1000


def test_format_prompt(char_tok):
    p = make_synthetic(1, seed=0, difficulty=2)[0]
    assert format_prompt(char_tok, p, chat_template=True) == p.prompt  # no template -> unchanged
    assert format_prompt(char_tok, p, chat_template=False) == p.prompt

    class Templated:
        chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False
            out = "".join(f"<{m['role']}>{m['content']}" for m in messages)
            return out + ("<assistant>" if add_generation_prompt else "")

    assert format_prompt(Templated(), p, chat_template=True) == f"<user>{p.prompt}<assistant>"
    assert format_prompt(Templated(), p, chat_template=False) == p.prompt


def test_format_prompt_real_template(char_tok, tmp_path):
    tok = build_char_tokenizer(str(tmp_path / "t"))
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    p = Problem("hi?", "x", "synthetic")
    assert format_prompt(tok, p, chat_template=True) == "[user]hi?[assistant]"


# ---------------------------------------------------------------- loaders

def _gsm_check(probs):
    assert [p.answer for p in probs] == ["72", "10", "1200", "42"]
    assert all(p.task == "gsm8k" and p.prompt.endswith(GSM8K_INSTRUCTION) for p in probs)
    assert probs[0].prompt.startswith("Natalia sold clips")
    assert probs[0].meta["solution"].endswith("#### 72")


def test_load_gsm8k_jsonl():
    with pytest.warns(UserWarning) as rec:
        probs = load_gsm8k(GSM)
    _gsm_check(probs)
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1
    assert msgs[0] == (f"gsm8k ({GSM}): skipped 2 of 6 malformed rows: "
                       "missing 'answer': 1, no '####' in answer: 1")


def test_load_gsm8k_parquet(tmp_path):
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    path = str(tmp_path / "gsm8k_small.parquet")
    pq.write_table(pj.read_json(GSM), path)
    with pytest.warns(UserWarning, match="skipped 2 of 6 malformed rows"):
        probs = load_gsm8k(path)
    _gsm_check(probs)


def test_load_gsm8k_limit():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        probs = load_gsm8k(GSM, limit=2)  # the first two rows are good: no warning
    assert [p.answer for p in probs] == ["72", "10"]


def test_load_gsm8k_hub_name_goes_to_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        return [{"question": "1+1?", "answer": "2\n#### 2"}]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    probs = load_gsm8k("openai/gsm8k", split="test")
    assert calls == [(("openai/gsm8k", "main"), {"split": "test"})]
    assert probs[0].answer == "2"
    calls.clear()
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: calls.append((a, k)) or [{"problem": "p", "answer": "3", "subject": "Algebra"}])
    mp = load_math("HuggingFaceH4/MATH-500", split="test")
    assert calls == [(("HuggingFaceH4/MATH-500",), {"split": "test"})]
    assert mp[0].answer == "3" and mp[0].meta["subject"] == "Algebra"


def test_gsm8k_rows_all_reasons_and_all_bad():
    rows = [
        {"question": "ok", "answer": "x\n#### 3"},
        {"question": 5, "answer": "#### 3"},
        {"question": "   ", "answer": "#### 3"},
        {"answer": "#### 3"},
        {"question": "q", "answer": "#### "},
        {"question": "q", "answer": ["#### 3"]},
    ]
    with pytest.warns(UserWarning) as rec:
        probs = problems_from_gsm8k_rows(rows, "gsm8k (mem)")
    assert len(probs) == 1 and probs[0].answer == "3"
    assert str(rec[0].message) == (
        "gsm8k (mem): skipped 5 of 6 malformed rows: non-string 'question': 1, empty 'question': 1, "
        "missing 'question': 1, nothing after '####' in answer: 1, non-string 'answer': 1")
    with pytest.raises(ValueError, match=r"skipped 2 of 2 malformed rows: missing 'answer': 2"):
        problems_from_gsm8k_rows([{"question": "a"}, {"question": "b", "answer": None}], "gsm8k (mem)")


def test_load_math_jsonl():
    with pytest.warns(UserWarning) as rec:
        probs = load_math(MATH)
    assert [p.answer for p in probs] == ["5", r"\frac{1}{2}", "6", "-2, 2", "x^{2}"]
    assert len(rec) == 1
    assert str(rec[0].message) == f"math ({MATH}): skipped 1 of 6 malformed rows: no \\boxed{{}} in solution: 1"
    p = probs[1]
    assert p.task == "math" and p.prompt.endswith(MATH_INSTRUCTION) and "\\boxed{}" in MATH_INSTRUCTION
    assert p.meta["level"] == "Level 1" and p.meta["type"] == "Counting & Probability"
    assert "subject" not in p.meta


def test_math_rows_answer_field_and_all_bad():
    rows = [{"problem": "p1", "answer": "7", "solution": r"\boxed{8}", "subject": "Algebra", "level": 2},
            {"problem": "p2", "solution": r"so \boxed{\frac{a}{b^{2}}}."}]
    probs = problems_from_math_rows(rows)
    assert [p.answer for p in probs] == ["7", r"\frac{a}{b^{2}}"]
    assert probs[0].meta["subject"] == "Algebra" and probs[0].meta["level"] == 2
    with pytest.raises(ValueError, match="skipped 2 of 2"):
        problems_from_math_rows([{"problem": "p"}, {"solution": r"\boxed{1}"}])


def test_loaded_problems_score_one_on_their_reference_solutions():
    from reward import score_one

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probs = load_gsm8k(GSM) + load_math(MATH)
    assert len(probs) == 9
    for p in probs:
        assert score_one(p, p.meta["solution"]) == 1.0


def test_load_mbpp_jsonl():
    with pytest.warns(UserWarning) as rec:
        probs = load_mbpp(MBPP)
    msgs = [str(w.message) for w in rec]
    assert msgs == [f"mbpp ({MBPP}): skipped 1 of 5 malformed rows: no usable 'test_list': 1"]
    assert [p.meta["task_id"] for p in probs] == [901, 902, 903, 904]
    p = probs[0]
    assert p.task == "code" and p.answer.startswith("def digit_sum(n):")
    assert p.prompt == ("Write a function to find the sum of the digits of a non-negative integer.\n"
                        "Your code should pass this test:\nassert digit_sum(0) == 0" + CODE_INSTRUCTION)
    assert "```python" in CODE_INSTRUCTION
    assert p.meta["test_list"][1] == "assert digit_sum(123) == 6" and p.meta["test_setup_code"] == ""
    q = probs[2]  # its first test uses a name from the setup code, so the prompt shows that code too
    assert "data = [1, 2, 3, 4, 6]\nassert count_even(data) == 3" in q.prompt
    assert q.meta["challenge_test_list"] == ["assert count_even(list(range(10 ** 5))) == 50000"]


def test_mbpp_hub_name_and_bad_rows(monkeypatch):
    import datasets

    calls = []
    row = {"task_id": 1, "text": "Add.", "code": "def add(a, b): return a + b",
           "test_list": ["assert add(1, 2) == 3"], "test_setup_code": "", "challenge_test_list": []}
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or [row])
    assert load_mbpp(split="test", limit=1)[0].meta["task_id"] == 1
    assert calls == [(("google-research-datasets/mbpp",), {"split": "test"})]
    bad = [dict(row, text=""), dict(row, test_list="assert x"), dict(row, test_list=[""]),
           dict(row, test_setup_code=3), {k: v for k, v in row.items() if k != "code"}]
    want = ("skipped 5 of 5 malformed rows: empty 'text': 1, no usable 'test_list': 2, "
            "non-string 'test_setup_code': 1, missing 'code': 1")
    with pytest.raises(ValueError, match=want):
        problems_from_mbpp_rows(bad)


# ---------------------------------------------------------------- sampler

def test_sampler_epochs_without_replacement():
    probs = make_synthetic(10, seed=0, difficulty=2)
    s = PromptSampler(probs, seed=123)
    e0 = [i for i, _ in s.next_batch(10)]
    e1 = [i for i, _ in s.next_batch(10)]
    assert sorted(e0) == list(range(10)) and sorted(e1) == list(range(10))
    assert e0 != e1  # reshuffled
    i, p = s.next_batch(1)[0]
    assert p is probs[i]
    assert [i for i, _ in PromptSampler(probs, seed=123).next_batch(20)] == e0 + e1
    assert [i for i, _ in PromptSampler(probs, seed=124).next_batch(10)] != e0


def test_sampler_resume_exact():
    probs = make_synthetic(7, seed=0, difficulty=2)
    ref = PromptSampler(probs, seed=5)
    want = [i for _ in range(6) for i, _ in ref.next_batch(4)]

    s = PromptSampler(probs, seed=5)
    got = [i for _ in range(3) for i, _ in s.next_batch(4)]
    sd = json.loads(json.dumps(s.state_dict()))  # plain data, survives a checkpoint
    s.observe([0, 1], [1.0, 0.0])  # no-op hook
    resumed = PromptSampler(probs, seed=999)
    resumed.load_state_dict(sd)
    got += [i for _ in range(3) for i, _ in resumed.next_batch(4)]
    assert got == want

    with pytest.raises(ValueError):
        PromptSampler(probs[:3], seed=5).load_state_dict(sd)
    with pytest.raises(ValueError):
        PromptSampler([], seed=0)


def test_wrap_slip_teacher_slips_only_where_the_sum_crosses_ten():
    """warmstart.teacher_trace with sft_slip (order "marked"): slip 0 is the reference trace; slip 1
    adds the carry into the units digit at every step whose running sum crosses 10 and carries on
    from its own total, keeping each step's 4-character shape; other steps are the reference's
    arithmetic on that total. The config refuses a slip on another order."""
    import random
    from config import parse_config
    from warmstart import teacher_trace
    for p in make_synthetic(30, seed=5, difficulty=(2, 10), order="marked"):
        assert teacher_trace(p, 0.0, random.Random(0), slip=0.0) == p.meta["trace"]
        got = teacher_trace(p, 0.0, random.Random(0), slip=1.0)
        steps, end = got.split("#")
        values = [int(v) for v in p.prompt[2::4][:p.meta["difficulty"]]]
        total = 0
        for i, v in enumerate(values):
            total = (total + v + 1) % 10 if total + v >= 10 else total + v
            assert steps[4 * i:4 * i + 4] == f"{v}>{total}{p.prompt[4 * i + 3]}"
        assert len(steps) == 4 * len(values) and end == str(total)
    with pytest.raises(ValueError, match="sft_slip"):
        parse_config(["--sft_slip=0.5", "--order=defined"])


def test_every_config_file_parses():
    """Each file in configs/ is a valid config: no unknown key, every value in range."""
    from config import parse_config
    folder = os.path.join(ROOT, "configs")
    names = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    assert "lagged.py" in names and "tiny.py" in names
    for name in names:
        parse_config([os.path.join(folder, name)])
