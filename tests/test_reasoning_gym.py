"""reasoning-gym tasks: six generators through the cascade (the reference scores 1, a wrong answer less),
sizes and seeds, the held-out set's disjointness, the config's checks of the name and the settings, bad
rows at load and at scoring, and the one-GPU recipe built offline. One verify worker serves the module
(starting one costs about 2.5 s: sympy and reasoning-gym)."""
import dataclasses
import os
import re
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

rg = pytest.importorskip("reasoning_gym")

from config import Config, parse_config  # noqa: E402
from reward import Cascade, score_one  # noqa: E402
from tasks import (ALIGN, CHARS, RG_INSTRUCTION, RG_SPLIT, Problem,  # noqa: E402
                   aligned_prompt, build_char_tokenizer, encode_pool, format_prompt, load_problems,
                   make_reasoning_gym, sft_problems)
from warmstart import chain_sum_trace, sft_key, teacher_trace  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["chain_sum", "basic_arithmetic", "countdown", "gsm_symbolic", "number_sorting", "leg_counting"]
SMALL = {"countdown": {"min_numbers": 3, "max_numbers": 4, "min_target": 10, "max_target": 100}}


@pytest.fixture(scope="module")
def cascade():
    with Cascade(max_chars=4000, verify_timeout_s=3.0) as c:
        yield c


@pytest.fixture(scope="module")
def problems():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these items is malformed
        return {n: make_reasoning_gym(n, 2, seed=0, kwargs=SMALL.get(n)) for n in NAMES}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("name", NAMES)
def test_each_task_generates_formats_and_scores_through_the_cascade(name, problems, cascade, tok):
    ps = problems[name]
    assert [p.task for p in ps] == ["reasoning_gym"] * 2
    for p in ps:
        entry = p.meta["entry"]
        assert p.prompt == entry["question"].strip() + RG_INSTRUCTION and p.answer == entry["answer"]
        assert p.meta["rg_name"] == name and isinstance(p.meta.get("difficulty", 0), int)
        assert format_prompt(tok, p, chat_template=True) == p.prompt  # no template: the raw prompt
    p = ps[0]
    texts = [f"Working it out.\n#### {p.answer}",  # the reference: stage 3 settles it
             f"#### {p.answer}1",                   # wrong: only the library's scorer can say how wrong
             p.answer]                              # no "####": no answer, stage 2
    res = cascade.score_batch([p] * 3, texts)
    assert res.rewards[0] == 1.0 and res.rewards[1] < 1.0 and res.rewards[2] == 0.0, res.notes
    assert res.stages == ["exact", "verify", "cheap"]
    assert res.reached["exact"] == 2 and res.reached["verify"] == 1 and res.errors == 0
    assert score_one(p, texts[0]) == 1.0 and score_one(p, texts[1]) == 0.0


def test_the_library_scorer_decides_what_stage_3_cannot(problems, cascade):
    """A countdown expression that reaches the target by another spelling scores 1 in stage 4; the
    library's partial credit stays: 0.05 for an expression that misses, 0.01 for text it cannot read."""
    p = problems["countdown"][0]
    nums = p.meta["entry"]["metadata"]["numbers"]
    res = cascade.score_batch([p] * 3, [f"#### ({p.answer})", f"#### {' + '.join(map(str, nums))}",
                                        "#### banana"])
    target = p.meta["entry"]["metadata"]["target"]
    assert res.rewards[0] == 1.0 and res.stages[0] == "verify"
    assert res.rewards[1] == (1.0 if sum(nums) == target else 0.05)
    assert res.rewards[2] == 0.01 and res.summary()["reach_verify"] == 1.0


def test_chat_template_and_the_char_tokenizer_encode_every_character(problems, tok):
    """The char tokenizer has every character of these prompts (no <unk>); with a chat template the
    prompt is the user turn, as for gsm8k."""
    ps = [p for n in NAMES for p in problems[n] if n != "gsm_symbolic"]  # gsm_symbolic: see below
    cfg = Config(max_new_tokens=64, chat_template=False)
    kept, ids = encode_pool(tok, ps, cfg, ctx=2048, log=lambda s: None)
    assert len(kept) == len(ps) and all(tok.unk_token_id not in t for t in ids)
    assert [tok.decode(t) for t in ids] == [p.prompt for p in ps]
    chat = dataclasses.replace(cfg, chat_template=True)
    tok.chat_template = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}<assistant>"
    try:
        kept, ids = encode_pool(tok, ps[:2], chat, ctx=2048, log=lambda s: None)
    finally:
        tok.chat_template = None
    assert tok.decode(ids[0]) == f"<user>{ps[0].prompt}<assistant>"


def test_items_with_characters_the_char_tokenizer_lacks_are_skipped_and_named():
    with pytest.warns(UserWarning, match="characters the character tokenizer lacks") as rec:
        kept = make_reasoning_gym("gsm_symbolic", 60, seed=0, chars=CHARS)
    msg = str(rec[0].message)
    assert msg.startswith("reasoning_gym:gsm_symbolic: skipped") and ("€" in msg or "£" in msg)
    assert 0 < len(kept) < 60 and all(set(p.prompt + p.answer) <= set(CHARS) for p in kept)
    assert len(make_reasoning_gym("gsm_symbolic", 60, seed=0)) == 60  # a real tokenizer: all of them


def rg_config(**kw):
    """A config for the tiny model's path (model empty: the char tokenizer, SFT data held out too),
    built without parse_config's checks."""
    base = dict(task="reasoning_gym:chain_sum", rg_kwargs={"min_terms": 2, "max_terms": 4}, n_train=200,
                n_eval=40, sft_steps=10, sft_batch=4, seed=0)
    return Config(**{**base, **kw})


def test_sizes_and_seeds_are_deterministic():
    cfg = rg_config()
    pool, held = load_problems(cfg)
    assert (len(pool), len(held)) == (200, 40)
    again = load_problems(cfg)
    assert [(p.prompt, p.answer) for p in pool + held] == [(p.prompt, p.answer) for p in again[0] + again[1]]
    other, _ = load_problems(dataclasses.replace(cfg, seed=1))
    assert [p.prompt for p in other] != [p.prompt for p in pool]
    assert {p.meta["difficulty"] for p in pool} == {2, 3, 4}  # chain_sum: its number of terms
    assert all(p.meta["rg_kwargs"] == cfg.rg_kwargs for p in pool)


def test_held_out_shares_no_question_with_the_pool_or_the_sft_data():
    """Two one-digit terms: about 200 distinct questions, so the splits' seeds alone would collide."""
    cfg = rg_config(rg_kwargs={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                    n_train=150, n_eval=30)
    pool, held = load_problems(cfg)
    sft = sft_problems(cfg)
    seen = {p.prompt for p in pool} | {p.prompt for p in sft}
    drawn = make_reasoning_gym("chain_sum", 2 * 30 + 100, cfg.seed + RG_SPLIT, cfg.rg_kwargs)
    assert seen & {p.prompt for p in drawn}  # what the dedup removes: the draws do collide
    assert 0 < len(held) <= 30 and not seen & {p.prompt for p in held}
    assert len({p.prompt for p in held}) == len(held)  # and no question twice among them
    # a real model has no SFT data: only the pool is held out from, and the split stays as large
    pool_hf, held_hf = load_problems(dataclasses.replace(cfg, model="some/model"))
    assert not {p.prompt for p in pool_hf} & {p.prompt for p in held_hf}


@pytest.mark.parametrize("args, named", [
    (["--task=reasoning_gym:chain_summ"], "'chain_summ' (did you mean chain_sum"),
    (["--task=reasoning_gym:chain_sum", "--rg_kwargs={'max_term': 3}"],
     "'max_term' (did you mean 'max_terms'"),
    (["--task=reasoning_gym:chain_sum", "--rg_kwargs={'min_terms': 5, 'max_terms': 2}"], "max_terms must be"),
    (["--task=reasoning_gym:chain_sum", "--rg_kwargs={'size': 10}"], "may not set size"),
    (["--task=gsm8k", "--rg_kwargs={'min_terms': 2}"], "'rg_kwargs' must be empty"),
    (["--task=reasoning-gym:chain_sum"], "or reasoning_gym:<name>"),
])
def test_config_refuses_unknown_names_and_settings_at_parse(args, named):
    with pytest.raises(ValueError, match="config key '(task|rg_kwargs)'") as err:
        parse_config(args + ["--model=some/model"])
    assert named in str(err.value)


def test_config_file_and_command_line_give_rg_kwargs_as_a_dict(tmp_path):
    path = tmp_path / "c.py"
    path.write_text('model = "m"\ntask = "reasoning_gym:countdown"\n'
                    'rg_kwargs = {"min_numbers": 3, "max_numbers": 4}\n')
    assert parse_config([str(path)]).rg_kwargs == {"min_numbers": 3, "max_numbers": 4}
    cfg = parse_config([str(path), "--rg_kwargs={'max_target': 500}"])
    assert cfg.rg_kwargs == {"max_target": 500}
    with pytest.raises(ValueError, match="rg_kwargs' wants dict"):
        parse_config([str(path), "--rg_kwargs=3"])
    with pytest.raises(ValueError, match="needs model="):  # the tiny model has no teacher for it
        parse_config(["--task=reasoning_gym:countdown"])
    assert parse_config(["--task=reasoning_gym:chain_sum"]).model == ""


def test_a_row_without_an_answer_is_skipped_and_counted(monkeypatch):
    real = rg.create_dataset

    def holed(name, **kw):
        items = list(real(name, **kw))
        items[1] = {**items[1], "answer": None}
        return items

    monkeypatch.setattr(rg, "create_dataset", holed)
    with pytest.warns(UserWarning, match=r"reasoning_gym:chain_sum: skipped 1 of 4 malformed rows: "
                                         r"missing 'answer': 1"):
        ps = make_reasoning_gym("chain_sum", 4, seed=0)
    assert [p.meta["index"] for p in ps] == [0, 2, 3]
    monkeypatch.setattr(rg, "create_dataset", real)
    with pytest.raises(ValueError, match="reasoning_gym:graph_color: skipped 3 of 3"):  # no references
        make_reasoning_gym("graph_color", 3, seed=0)


def test_a_scorer_that_raises_or_hangs_scores_0_and_loses_nothing_else(problems, cascade):
    good = problems["chain_sum"][0]
    broken = Problem("q", "7", "reasoning_gym", {"rg_name": "chain_sum", "entry": {}})  # no "answer"
    cd = problems["countdown"][0]
    batch = [(good, f"#### {good.answer}"), (broken, "#### 8"), (good, "#### 123456789"),
             (cd, "#### 9**9**9**9"),  # countdown's scorer evaluates it: never returns
             (cd, f"#### ({cd.answer})")]
    res = cascade.score_batch([p for p, _ in batch], [t for _, t in batch])
    assert res.rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert res.stages == ["exact", "verify", "verify", "verify", "verify"]
    assert (res.errors, res.timeouts) == (1, 1)
    assert "verify: error: reasoning-gym chain_sum: KeyError: 'answer'" in res.notes
    assert "verify: timeout" in res.notes


def test_the_countdown_recipe_parses_and_builds_its_task_offline():
    path = os.path.join(ROOT, "configs", "countdown_qwen3.py")
    with open(path) as f:
        text = f.read()
    assert text.splitlines()[0] == "# python train.py configs/countdown_qwen3.py"
    assert "not yet run" in text
    cfg = parse_config([path, "--n_train=12", "--n_eval=6"])
    assert cfg.model.startswith("Qwen/Qwen3-") and cfg.task == "reasoning_gym:countdown"
    pool, held = load_problems(cfg)  # the problems only: the model is not loaded
    assert (len(pool), len(held)) == (12, 6) and not {p.prompt for p in pool} & {p.prompt for p in held}
    for p in pool + held:
        meta = p.meta["entry"]["metadata"]
        assert 3 <= len(meta["numbers"]) <= 4 and 10 <= meta["target"] <= 100
        assert score_one(p, f"#### {p.answer}") == 1.0


# ------------------------------------------------ configs/tiny.py, the default: the tiny model, a clean teacher


@pytest.mark.parametrize("kw", [{"min_digits": 1, "max_digits": 1, "min_terms": 1, "max_terms": 10},
                                {"min_digits": 2, "max_digits": 2, "min_terms": 2, "max_terms": 12}])
def test_the_chain_sum_teacher_is_exact(kw, cascade):
    """Every line of the teacher's trace is arithmetic that holds, its terms are the expression's in
    order, and its final answer scores 1 through the cascade: no planted error."""
    ps = make_reasoning_gym("chain_sum", 60, seed=3, kwargs=kw, prompt="expression")
    traces = [teacher_trace(p, 0.0, None) for p in ps]
    assert traces == [chain_sum_trace(p) for p in ps]
    for p, t in zip(ps, traces):
        body, _, answer = t.partition("\n#### ")
        terms = p.prompt[:-1].replace("-", " - ").replace("+", " + ").split()  # "7-3+5=" -> 7 - 3 + 5
        assert p.meta["entry"]["metadata"]["expression"].split() == terms
        first, rest = re.fullmatch(r"([+-]\d+)((?:[+-]\d+=[+-]\d+)*)", body).groups()
        total, steps = int(first), re.findall(r"([+-])(\d+)=([+-]\d+)", rest)  # "-3=+04"
        assert total == int(terms[0]) and len(steps) == len(terms) // 2
        for (op, term, new), want_op, want_term in zip(steps, terms[1::2], terms[2::2]):
            assert (op, term) == (want_op, want_term)
            assert int(new) == (total + int(term) if op == "+" else total - int(term))
            total = int(new)
        assert len(first) == 3 and all(len(new) >= 3 for *_, new in steps)  # signed, 2+ digits
        assert answer == str(total) == p.answer
    res = cascade.score_batch(ps, traces)
    assert res.rewards == [1.0] * len(ps) and set(res.stages) == {"exact"}


def test_the_default_runs_on_a_ladder_past_sft_and_past_rl():
    """configs/tiny.py (the default): SFT's range below RL's below the held-out set's, each drawn
    from its own settings; the held-out problems share no prompt with the pool or the SFT data; the
    sampler follows the growth zone; every prompt is aligned and of one length; the tiny model's
    warm start key names its task and SFT settings."""
    cfg = parse_config(["--n_train=600", "--sft_steps=40", "--n_eval=80"])
    assert cfg.task == "reasoning_gym:chain_sum" and not cfg.model and cfg.sampler == "growth"
    assert cfg.rg_prompt == "aligned" and cfg.eval_sampled and cfg.eval_k == 64
    assert cfg.sft_slip == 0 and cfg.sft_noise == 0  # a clean teacher
    pool, held = load_problems(cfg)
    sft = sft_problems(cfg)
    terms = lambda ps: {p.meta["difficulty"] for p in ps}
    assert terms(sft) == {2, 3, 4} and terms(pool) == set(range(2, 9))
    assert {9, 10, 11, 12} <= terms(held) <= set(range(2, 13))
    assert not {p.prompt for p in held} & {p.prompt for p in pool + sft}
    assert {len(p.prompt) for p in sft + pool + held} == {ALIGN * 12 + 1}
    for p in sft + pool + held:  # one-digit terms, laid out in cells
        e = p.meta["entry"]["metadata"]
        assert e["num_digits"] == 1 and p.prompt == aligned_prompt(e["expression"], 12)
    key = sft_key(cfg)
    assert key["task"] == cfg.task and key["rg_kwargs"]["max_terms"] == 4
    assert key["rg_prompt"] == "aligned"
    with pytest.raises(ValueError, match="config key 'sft_rg_kwargs': chain_sum has no setting"):
        parse_config(["--task=reasoning_gym:chain_sum", "--sft_rg_kwargs={'max_term': 4}"])
    with pytest.raises(ValueError, match="config key 'eval_rg_kwargs' must be empty"):
        parse_config(["configs/marked.py", "--eval_rg_kwargs={'max_terms': 4}"])
    with pytest.raises(ValueError, match="aligned lays out one-digit terms.*eval_rg_kwargs"):
        parse_config(["--eval_rg_kwargs={'max_digits': 2}"])
    with pytest.raises(ValueError, match="rg_prompt.*countdown's questions are not"):
        parse_config(["--task=reasoning_gym:countdown", "--rg_prompt=aligned", "--model=x"])
    assert parse_config(["--task=gsm8k"]).rg_kwargs == {}  # the file's rg keys go with its task


def test_an_aligned_trace_reads_term_k_at_one_distance_at_every_length(cascade):
    """tasks.aligned_prompt and its trace: term k's cell and the trace's step k sit ALIGN * k
    characters into prompt and trace, and every prompt has one length, so step k reads term k at
    one distance for every k and every number of terms; each step is the running total, and the
    answer scores 1 through the cascade."""
    kw = {"min_digits": 1, "max_digits": 1, "min_terms": 2, "max_terms": 12}
    ps = make_reasoning_gym("chain_sum", 80, seed=5, kwargs=kw, prompt="aligned", width=12)
    assert {len(p.prompt) for p in ps} == {ALIGN * 12 + 1} and all(p.prompt[-1] == "=" for p in ps)
    for p in ps:
        trace = teacher_trace(p, 0.0, None)
        body, _, answer = trace.partition("\n#### ")
        expr = p.meta["entry"]["metadata"]["expression"].split()
        terms = [int(expr[0])] + [int(t) if op == "+" else -int(t)
                                  for op, t in zip(expr[1::2], expr[2::2])]
        assert len(body) == ALIGN * len(terms)
        total = 0
        for k, term in enumerate(terms):
            cell, step = p.prompt[ALIGN * k:ALIGN * (k + 1)], body[ALIGN * k:ALIGN * (k + 1)]
            assert int(cell) == term and cell[0] in "+-"  # term k, signed, in cell k
            total += term
            assert step == f"{total:+0{ALIGN}d}"  # step k: the total after term k
        assert p.prompt[ALIGN * len(terms):-1].strip() == ""  # blank cells after the last term
        assert answer == str(total) == p.answer
    assert cascade.score_batch(ps, [teacher_trace(p, 0.0, None) for p in ps]).rewards == [1.0] * 80
    with pytest.raises(ValueError, match="does not fit 3 cells"):
        aligned_prompt("1 + 2 + 3 + 4", 3)


def test_a_random_answer_passes_well_under_1_in_20_on_the_far_bins():
    """The default's far bins (9 to 12 one-digit terms, past RL's 8): the likeliest answer, always
    guessed, is right under 1 time in 30."""
    for n in (9, 10, 11, 12):
        answers = [int(p.answer) for p in make_reasoning_gym(
            "chain_sum", 4000, seed=n, kwargs={"min_digits": 1, "max_digits": 1, "min_terms": n,
                                               "max_terms": n})]
        assert max(answers.count(a) for a in set(answers)) / len(answers) < 1 / 30


# ------------------------------------------- configs/splitting.py: the second long-CoT family of the sparse bench


def test_the_string_splitting_teacher_is_exact_and_local(cascade):
    """Each line of the teacher's trace is the line above it under the library's own rule (its
    _apply_rule), the first line is the prompt's counts, and the answer scores 1 through the cascade;
    a trace whose last count is off scores below 1. Breaking the rule read-off (rule numbers shifted)
    or a state (one count off) fails here."""
    from warmstart import string_splitting_trace
    kw = {"min_initial_machines": 3, "max_initial_machines": 12}
    ps = make_reasoning_gym("string_splitting", 12, seed=5, kwargs=kw, prompt="last_paragraph")
    gen = rg.create_dataset("string_splitting", size=1, seed=0, **kw)
    for p in ps:
        trace = teacher_trace(p, 0.0, None)
        assert trace == string_splitting_trace(p)
        body, _, answer = trace.partition("\n#### ")
        rows = [[int(v) for v in line.split()] for line in body.split("\n")]
        a, b, c = map(int, re.search(r"(\d+) machine A, (\d+) machine B, and (\d+) machine C", p.prompt).groups())
        assert rows[0] == [0, a, b, c, 0, 0, 0]
        for prev, now in zip(rows, rows[1:]):
            assert now[1:] == gen._apply_rule(prev[1:]) and now[1:] != prev[1:]
            rule = next(i + 1 for i, ok in enumerate([prev[1] >= 1, prev[2] >= 2, prev[3] >= 2,
                                                      prev[2] >= 1 and prev[3] >= 1,
                                                      prev[4] >= 1 and prev[5] >= 1]) if ok)
            assert now[0] == rule
        assert gen._apply_rule(rows[-1][1:]) == rows[-1][1:]  # no rule applies: the end
        assert all(len(v) >= 2 for line in body.split("\n") for v in line.split()[1:])
        assert answer == " ".join(map(str, rows[-1][1:])) == p.answer
    wrong = [t[:-1] + str((int(t[-1]) + 1) % 10) for t in (teacher_trace(p, 0.0, None) for p in ps)]
    res = cascade.score_batch(ps + ps, [teacher_trace(p, 0.0, None) for p in ps] + wrong)
    assert res.rewards[:12] == [1.0] * 12 and max(res.rewards[12:]) < 1.0


def test_a_string_splitting_prefix_has_its_first_lines_and_no_end():
    """sft_max_lines on string_splitting: the first lines of the exact trace and no "####" (so no EOS:
    warmstart.sft_target), or the whole trace where it is shorter; refused on a task without prefixes."""
    from warmstart import string_splitting_trace
    p = make_reasoning_gym("string_splitting", 1, seed=2, kwargs={"min_initial_machines": 5})[0]
    whole = string_splitting_trace(p)
    assert teacher_trace(p, 0.0, None, max_lines=2) == "\n".join(whole.split("\n")[:2]) + "\n"
    assert string_splitting_trace(p, 10_000) == whole and "####" in whole
    with pytest.raises(ValueError, match="sft_max_lines"):
        parse_config(["--task=reasoning_gym:chain_sum", "--sft_max_lines=2"])


def test_the_string_splitting_slip_drops_z_carry_and_carries_on_by_the_rules(cascade):
    """sft_slip on string_splitting: with slip 0 the teacher's own states are the library's; with
    slip 1 every step that takes Z from 09 to 10 writes 00 instead, every other line is the one
    above it under the library's rule, and the answer scores below 1; a trace whose Z never reaches
    10 is unchanged. Dropping the carry anywhere else, or not carrying on by the
    rules, fails here."""
    import random
    from warmstart import splitting_states, string_splitting_trace
    kw = {"min_initial_machines": 12, "max_initial_machines": 25}
    ps = make_reasoning_gym("string_splitting", 8, seed=3, kwargs=kw, prompt="last_paragraph")
    gen = rg.create_dataset("string_splitting", size=1, seed=0, **kw)
    slipped = 0
    for p in ps:
        states = p.meta["entry"]["metadata"]["states"]
        assert splitting_states(states[0]) == states
        trace = string_splitting_trace(p, slip=1.0, rng=random.Random(0))
        assert teacher_trace(p, 0.0, random.Random(0), slip=1.0) == trace
        body, _, answer = trace.partition("\n#### ")
        rows = [[int(v) for v in line.split()][1:] for line in body.split("\n")]
        carried = any(a[5] == 9 and b[5] == 10 for a, b in zip(states, states[1:]))
        if not carried:
            assert trace == string_splitting_trace(p)
            continue
        slipped += 1
        drops = [i for i, (a, b) in enumerate(zip(rows, rows[1:])) if a[5] == 9 and b[5] == 0]
        assert drops and rows[:drops[0] + 1] == states[:drops[0] + 1]
        for i, (prev, now) in enumerate(zip(rows, rows[1:])):  # the rules, but at each drop
            want = gen._apply_rule(prev[:])
            assert now == (want[:5] + [0] if i in drops else want)
            assert i in drops or not (prev[5] == 9 and want[5] == 10)  # slip 1: every carry
        assert gen._apply_rule(rows[-1][:]) == rows[-1] and not any(r[5] >= 10 for r in rows)
        assert answer != p.answer
        assert cascade.score_batch([p], [trace]).rewards[0] < 1.0
    assert slipped >= 4
    assert parse_config(["configs/splitting.py", "--sft_slip=0.5"]).sft_slip == 0.5
    with pytest.raises(ValueError, match="sft_slip"):
        parse_config(["--task=reasoning_gym:chain_sum", "--sft_slip=0.5"])


def test_a_curriculum_stage_is_keyed_by_its_first_stage_too(tmp_path):
    """configs/splitting.py starts from configs/splitting_copy.py's warm start, which starts from
    configs/splitting_base.py's: a change in an earlier stage (its slip, its steps) is a new key for
    every later stage, not a stale cache. Keying on the earlier stage's file name alone fails here."""
    base = open(os.path.join(ROOT, "configs", "splitting_base.py")).read()
    copy = open(os.path.join(ROOT, "configs", "splitting_copy.py")).read()
    (tmp_path / "base.py").write_text(base)
    (tmp_path / "copy.py").write_text(copy.replace("configs/splitting_base.py", str(tmp_path / "base.py")))
    last = [os.path.join(ROOT, "configs", "splitting.py"), f"--sft_init={tmp_path / 'copy.py'}"]
    before = sft_key(parse_config(last))
    assert before["sft_init"]["key"]["sft_init"]["key"]["sft_steps"] == parse_config(
        [str(tmp_path / "base.py")]).sft_steps
    (tmp_path / "base.py").write_text(base + "\nsft_steps = 7\n")
    assert sft_key(parse_config(last)) != before
    assert sft_key(parse_config(last + ["--lr=1e-3"])) == sft_key(parse_config(last))  # RL keys


def test_a_transition_no_rule_makes_is_refused():
    from warmstart import _splitting_rule
    assert _splitting_rule([3, 3, 0, 0, 0, 0], [2, 3, 0, 2, 1, 0]) == 1
    with pytest.raises(ValueError, match="no rule turns"):
        _splitting_rule([3, 3, 0, 0, 0, 0], [2, 3, 0, 2, 2, 0])


def test_last_paragraph_prompts_keep_what_varies_and_are_refused_where_there_is_one_paragraph():
    ps = make_reasoning_gym("string_splitting", 3, seed=0, prompt="last_paragraph")
    for p in ps:
        q = p.meta["entry"]["question"]
        assert p.prompt == q.strip().split("\n\n")[-1] + RG_INSTRUCTION and p.prompt.startswith("Now, you have")
        assert len(p.prompt) < len(q) / 3
    with pytest.raises(ValueError, match="one paragraph; use question"):
        parse_config(["--task=reasoning_gym:chain_sum", "--rg_prompt=last_paragraph"])


def test_the_splitting_config_is_a_long_local_chain_the_tiny_model_can_take():
    """configs/splitting.py: the tiny model's teacher writes its traces; RL's traces run about 900 to
    1,800 tokens; the SFT data reaches below RL's range; the held-out set shares no prompt with the
    pool or the SFT data; every prompt and trace fits the tiny model's context."""
    cfg = parse_config([os.path.join(ROOT, "configs", "splitting.py"), "--n_train=200", "--sft_steps=20"])
    assert cfg.task == "reasoning_gym:string_splitting" and not cfg.model
    pool, held = load_problems(cfg)
    sft = sft_problems(cfg)
    assert not {p.prompt for p in held} & {p.prompt for p in pool + sft}
    lens = [len(teacher_trace(p, 0.0, None)) for p in pool]
    assert 850 <= min(lens) and max(lens) <= cfg.max_new_tokens and 1100 <= sum(lens) / len(lens) <= 1600
    assert min(len(teacher_trace(p, 0.0, None)) for p in sft) < 600  # short chains too
    assert max(len(p.prompt) for p in pool + held + sft) <= 512  # the tiny model: 512 + max_new_tokens
