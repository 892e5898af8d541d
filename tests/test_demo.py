"""The embedded default as a demonstration: held-out problems never trained on, accuracy per difficulty
(pass@1 and pass@k of the start, pass@1 after RL), example completions before and after, and a warm start
cached by its settings rather than by the output folder."""
import operator
import os

import torch

import config
import report
import train
from tasks import load_problems, make_synthetic, sft_problems
from test_train import TINY_RUN
from warmstart import cache_path


def test_held_out_problems_share_no_prompt_with_the_pool_or_the_sft_data():
    # short chains in the "defined" order, where prompts do collide: the filter is not idle
    cfg = config.parse_config(["configs/marked.py", "--n_train=3000", "--n_eval=200",
                               "--difficulty=(2,3)", "--sft_steps=100", "--order=defined", "--sft_difficulty=(2,3)", "--eval_difficulty=(2,3)",
                               "--sft_slip=0"])
    pool, held = load_problems(cfg)
    seen = {p.prompt for p in pool + sft_problems(cfg)}
    assert len(held) == 200 and not ({p.prompt for p in held} & seen)
    raw = make_synthetic(200, cfg.seed + 10_000, (2, 3))  # what the held-out set was before the filter
    assert {p.prompt for p in raw} & seen
    # and the default's own sets (chain_sum): held out up to 12 terms, RL pool 2-8, SFT data 2-4,
    # drawn per number of terms (eval_per_bin): 100 of each from 5 terms up (and of 3 and 4 while
    # enough are unseen); a pool of 3,000 holds nearly every 2-term sum
    cfg = config.parse_config(["--n_train=3000", "--sft_steps=100"])
    pool, held = load_problems(cfg)
    n = {d: sum(p.meta["difficulty"] == d for p in held) for d in range(2, 13)}
    assert cfg.eval_per_bin == 100 and n[2] < 10 and all(n[d] == 100 for d in range(3, 13))
    assert len({p.prompt for p in held}) == len(held)
    assert not ({p.prompt for p in held} & {p.prompt for p in pool + sft_problems(cfg)})
    # the default's pool holds every 2-term sum and with the SFT data most 3-term ones: fewer left,
    # as many kept as the draws found
    cfg = config.parse_config(["--eval_per_bin=1000"])
    pool, held = load_problems(cfg)
    n = {d: sum(p.meta["difficulty"] == d for p in held) for d in range(2, 13)}
    assert n[2] == 0 and 0 < n[3] < 1000 and all(n[d] == 1000 for d in range(5, 13)), n
    assert not ({p.prompt for p in held} & {p.prompt for p in pool + sft_problems(cfg)})


def test_a_run_reports_accuracy_per_difficulty_and_examples(tmp_path, capsys):
    out = str(tmp_path / "run")
    hist = train.main(TINY_RUN + ["--steps=2", "--eval_difficulty=(1,3)", "--eval_sampled=true",
                                  "--n_eval=12", "--plot=true", f"--out_dir={out}", "--save_every=100"])
    start = hist["start"]
    assert sorted(start["greedy"]) == [1, 2, 3] and sorted(start["pass@4"]) == [1, 2, 3]
    assert all(start["pass@4"][d] >= start["pass@1"][d] for d in (1, 2, 3))  # any of 4 >= one
    assert sorted(hist["records"][-1]["acc_by_difficulty"]) == [1, 2, 3]
    assert len(hist["examples"]) == 3 and all("before" in e and "after" in e for e in hist["examples"])
    text = capsys.readouterr().out
    assert "held-out accuracy by difficulty" in text and "before RL:" in text and "after RL:" in text
    assert os.path.exists(os.path.join(out, "run.png"))
    end = hist["end"]  # the same figures after RL
    assert sorted(end["greedy"]) == [1, 2, 3] and sorted(end["pass@4"]) == [1, 2, 3]
    lines = report.per_difficulty(hist, hist["records"][-1], 4)
    assert len(lines) == 5 + 3 and all(len(line) <= 100 for line in lines)
    assert lines[4].split() == ["n", "n@k"] + ["greedy", "pass@1", "pass@4"] * 2
    n = {d: sum(p.meta.get("difficulty") == d for p in load_problems(
        config.parse_config(TINY_RUN + ["--eval_difficulty=(1,3)", "--n_eval=12"]))[1])
        for d in (1, 2, 3)}
    assert [line.split()[:3] for line in lines[5:]] == [[str(d), str(n[d]), str(n[d])]
                                                      for d in (1, 2, 3)]


def test_the_warm_start_is_cached_by_its_settings_not_by_the_output_folder(tmp_path, capsys):
    a = TINY_RUN + ["--steps=1", f"--out_dir={tmp_path / 'a'}", "--save_every=100"]
    b = TINY_RUN + ["--steps=1", f"--out_dir={tmp_path / 'b'}", "--save_every=100", "--lr=5e-3"]
    train.main(a)
    capsys.readouterr()
    train.main(b)  # another folder, other RL settings: the same warm start
    assert "loading the cached SFT model" in capsys.readouterr().out
    ca, cb = (cache_path(config.parse_config(x)) for x in (a, b))
    assert ca == cb and os.path.isdir(ca)
    assert cache_path(config.parse_config(a + ["--sft_steps=4"])) != ca  # an SFT setting: a new one


def test_rft_is_iterated_at_the_rl_runs_verifier_calls(tmp_path, monkeypatch):
    # bench/demo.py's RFT: one round per RL step, each as many verifier calls as that step made,
    # sampled from the policy that the previous round's step left (every sample scored right here,
    # so every round trains); the SFT arms train on teacher traces up to a token budget
    from bench import demo
    from model import weight_checksum
    argv = TINY_RUN + [f"--out_dir={tmp_path / 'run'}", "--save_every=100"]
    cfg, run = demo.fresh_run(argv)
    before = [p.detach().clone() for p in run.model.parameters()]
    eng, seen = run.sparse.engine, []
    generate, score = eng.generate, run.cascade.score_batch

    def sample(*a, **k):  # what each round samples from; every row ends on EOS
        seen.append(weight_checksum(run.sparse.rollout_model))
        ro = generate(*a, **k)
        ro.finish = ["eos"] * len(ro.finish)
        return ro

    def all_right(*a, **k):
        res = score(*a, **k)
        res.rewards = [1.0] * len(res.rewards)
        return res
    monkeypatch.setattr(eng, "generate", sample)
    monkeypatch.setattr(run.cascade, "score_batch", all_right)
    kept, made = demo.rft(cfg, run, [16, 8, 8], seed=0)
    assert made == 32 and kept == 32
    assert len(set(seen)) == 3  # each round samples the policy its last step left
    cfg, run = demo.fresh_run(argv)  # the warm start again, from its cache
    assert all(torch.equal(a, b) for a, b in zip(before, run.model.parameters()))
    assert demo.more_sft(cfg, run, tokens=300, seed=0) >= 300
    assert any(not torch.equal(a, b) for a, b in zip(before, run.model.parameters()))
    assert demo.beyond(2, {1: 0.5, 2: 1.0, 3: 0.0, 4: 1.0}) == 0.5  # mean above 2


def test_the_supervised_ceiling_trains_on_every_held_out_bin_and_no_held_out_prompt(tmp_path,
                                                                                   monkeypatch):
    from bench import demo
    argv = TINY_RUN + [f"--out_dir={tmp_path / 'run'}", "--sft_difficulty=(1,1)",
                       "--eval_difficulty=(1,3)", "--n_eval=40"]
    cfg, run = demo.fresh_run(argv)
    rows = []
    monkeypatch.setattr(demo, "sft_steps", lambda cfg, run, batches: rows.extend(
        run.tok.decode(p) for b in batches for p, _ in b))
    held = {p.prompt for p in run.eval_p}
    assert demo.more_sft(cfg, run, tokens=3000, seed=0) >= 3000
    assert rows and not held & set(rows)
    assert demo.span(demo.fresh_problems(cfg, 200, 0, every_bin=False)) == (1, 1)
    assert demo.span(demo.fresh_problems(cfg, 200, 0, every_bin=True)) == (1, 3)
    every = []
    monkeypatch.setattr(demo, "fresh_problems", lambda cfg, n, seed, every_bin: every.append(
        every_bin) or [])
    demo.more_sft(cfg, run, tokens=10, seed=0, every_bin=True)
    assert every == [True]


def test_the_teachers_problems_on_the_default_are_aligned_like_its_pool():
    # the default (reasoning-gym chain_sum, aligned prompts): the SFT arms' fresh problems come from
    # the SFT range or every held-out bin, laid out at the run's width like the pool and held-out set
    from bench import demo
    cfg = config.parse_config(["--n_train=300", "--sft_steps=10", "--eval_per_bin=4"])
    pool, held = load_problems(cfg)
    sft, every = (demo.fresh_problems(cfg, 200, 0, every_bin=b) for b in (False, True))
    assert demo.span(sft) == (2, 4) and demo.span(every) == (2, 12)
    assert {len(p.prompt) for p in sft + every} == {len(p.prompt) for p in pool + held} == {49}


def test_past_sampling_sets_rls_pass_at_1_beside_the_warm_starts_pass_at_k():
    # item 5 of the demo: beyond the SFT range only, the warm start's pass@k at the largest k against
    # RL's pass@1 (not its own pass@k), counted per seed
    from bench import demo
    start = {"pass@1": {3: 0.1, 5: 0.1, 6: 0.0}, "pass@8": {3: 0.5, 5: 0.3, 6: 0.2},
             "pass@64": {3: 1.0, 5: 0.4, 6: 0.2}}
    end = {"pass@1": {3: 0.9, 5: 0.5, 6: 0.1}, "pass@8": {3: 1.0, 5: 0.9, 6: 0.3},
           "pass@64": {3: 1.0, 5: 1.0, 6: 0.5}}
    results = [(None, None, None, {"passes": (start, end)})] * 2
    lines = demo.past_sampling(results, hi=4)
    rows = [x for x in lines if x.startswith("| 5") or x.startswith("| 6") or x.startswith("| 3")]
    assert rows == ["| 5 | 0.400 ± 0.000 | 0.500 ± 0.000 | 1.000 ± 0.000 | 2 of 2 seeds |",
                    "| 6 | 0.200 ± 0.000 | 0.100 ± 0.000 | 0.500 ± 0.000 | 0 of 2 seeds |"]
    assert demo.past_sampling([(None, None, None, {"passes": ({"greedy": {}}, {})})], 4) == []


def test_the_examples_are_problems_the_warm_start_gets_wrong():
    probs = make_synthetic(12, 0, (2, 7))
    shown = {i: (f"t{i}", 1.0 if i % 3 else 0.0) for i in range(12)}  # wrong: 0, 3, 6, 9
    picks = report.examples(probs, shown)
    assert len(picks) == 3 and all(shown[i][1] == 0.0 for i in picks)
    wrong = sorted((probs[i].meta["difficulty"], i) for i in (0, 3, 6, 9))
    assert wrong[0][1] in picks and wrong[-1][1] in picks  # the easiest and the hardest of them
    assert len(report.examples(probs, {i: (t, 1.0) for i, (t, _) in shown.items()})) == 3  # none wrong


def test_long_examples_are_clipped_to_their_start_and_end():
    """report.shown prints an example on one line each, a long one as its start, " ... " and its end
    (where a long generation's answer is); a short one whole."""
    import report
    long = "12\n" * 200 + "#7"
    lines = report.shown({"examples": [{"prompt": "a=1?\n", "answer": "7", "before": long,
                                        "after": "1>1.#1"}]})
    assert lines[1] == "problem: a=1?  (answer 7)" and lines[3] == "  after RL:  1>1.#1"
    assert " ... " in lines[2] and lines[2].endswith("#7") and len(lines[2]) < 330


def test_held_out_accuracy_counts_right_answers_and_pass_at_k_samples_a_fixed_subset(tmp_path,
                                                                                   monkeypatch):
    # reasoning-gym's score_answer gives partial credit (0.67 for "-40" against -4): held-out
    # accuracy counts scores of 1 only, and pass@k samples the first eval_k_per_bin of each bin
    import heldout
    from bench import demo
    argv = TINY_RUN + [f"--out_dir={tmp_path / 'run'}", "--eval_difficulty=(1,3)", "--n_eval=12",
                       "--eval_k_per_bin=2"]
    cfg, run = demo.fresh_run(argv)
    score, seen = run.cascade.score_batch, []

    def partial(problems, texts, **k):  # right on 1 term, partial credit on the others
        res = score(problems, texts, **k)
        res.rewards = [1.0 if p.meta["difficulty"] == 1 else 0.67 for p in problems]
        seen.extend(p.meta["difficulty"] for p in problems)
        return res

    monkeypatch.setattr(run.cascade, "score_batch", partial)
    acc, by_d, _ = heldout.evaluate(cfg, run)
    n = {d: sum(p.meta["difficulty"] == d for p in run.eval_p) for d in (1, 2, 3)}
    assert by_d == {1: 1.0, 2: 0.0, 3: 0.0} and acc == n[1] / sum(n.values())
    seen.clear()
    passes = heldout.evaluate(cfg, run, k=4)
    assert passes["pass@4"] == {1: 1.0, 2: 0.0, 3: 0.0}
    assert {d: seen.count(d) for d in (1, 2, 3)} == {d: 4 * min(2, n[d]) for d in (1, 2, 3)}
    assert heldout.counts(cfg, run.eval_p) == {"greedy": n,
                                               "sampled": {d: min(2, n[d]) for d in (1, 2, 3)}}
    run.cascade.close()


def test_the_warm_start_trains_until_its_loss_with_a_cap(tmp_path, monkeypatch):
    # sft_loss: SFT stops once the mean loss of its last SFT_WINDOW steps is at or below it, at
    # most sft_steps steps; the entry records which (sft_fit.json), and the cache key names both
    import warmstart
    from tasks import build_char_tokenizer
    monkeypatch.setenv("ZEROS_CACHE", str(tmp_path / "cache"))
    tok, cpu = build_char_tokenizer(str(tmp_path / "tok")), torch.device("cpu")
    easy = config.parse_config(TINY_RUN + ["--sft_steps=200", "--sft_loss=50.0"])  # any loss
    hard = config.parse_config(TINY_RUN + ["--sft_steps=60", "--sft_loss=1e-9"])  # none
    logs = []
    warmstart.warm_start(easy, tok, cpu, logs.append)
    first = warmstart.fit(cache_path(easy))
    assert first["steps"] == warmstart.SFT_WINDOW and first["reached"] and first["loss"] <= 50
    warmstart.warm_start(hard, tok, cpu, logs.append)
    capped = warmstart.fit(cache_path(hard))
    assert capped["steps"] == 60 and not capped["reached"] and capped["loss"] > 1e-9
    assert any("still above the target 1e-09 at the cap, 60 steps" in s for s in logs)
    warmstart.warm_start(easy, tok, cpu, logs.append)  # cached: the log says what it reached
    assert "reached the target 50 at step 50" in logs[-1] and "cached" in logs[-1]
    plain = config.parse_config(TINY_RUN + ["--sft_steps=200"])
    assert "sft_loss" not in warmstart.sft_key(plain)  # a config without a target keeps its key
    assert len({cache_path(c) for c in (easy, plain, config.parse_config(
        TINY_RUN + ["--sft_steps=200", "--sft_loss=0.01"]))}) == 3


def test_the_seeds_run_in_processes_of_their_own_in_order():
    from bench import demo
    # bench demo --jobs N: each seed in a spawned process, the results in the seeds' order
    assert demo.in_processes(operator.mul, [1, 2, 3], 2, 10) == [10, 20, 30]
    assert demo.in_processes(operator.mul, [1, 2, 3], 1, 10) == [10, 20, 30]
    pids = demo.in_processes(operator.call, [os.getpid, os.getpid], 2)
    assert os.getpid() not in pids  # each ran in a process of its own, not here


def test_sft_leaves_a_core_to_a_kernel_build_under_way(tmp_path, monkeypatch):
    # a fresh machine compiles the decode kernels beside the warm start: while a build is under
    # way SFT runs on one thread (the compiler takes the other core), then on all of them again
    import warmstart
    from tasks import build_char_tokenizer
    monkeypatch.setenv("ZEROS_CACHE", str(tmp_path / "cache"))
    tok, cpu = build_char_tokenizer(str(tmp_path / "tok")), torch.device("cpu")
    cfg = config.parse_config(TINY_RUN + ["--sft_steps=6"])
    under_way, seen = [True, True, True], []
    monkeypatch.setattr(warmstart, "building", lambda: bool(under_way) and under_way.pop())
    real = warmstart.token_logprobs
    monkeypatch.setattr(warmstart, "token_logprobs", lambda *a, **k: (
        seen.append(torch.get_num_threads()), real(*a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        warmstart.warm_start(cfg, tok, cpu, lambda s: None)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1, 1, 2, 2, 2] and after == 2
