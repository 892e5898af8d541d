"""bench/cost.py's cost-model check (row (e) of `python -m bench rollout`) on a tiny model: the engine's measured
decode times and bench.cost.rollout_cost's prediction for the same schedule and lengths, and the rows' layout."""
import json
import os

import pytest
import torch

from bench import cost
from model import ModelConfig, Transformer
from sparsity import dense_budget, fraction_budget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512)).eval()


def test_machine_rates_are_positive():
    flops, bw = cost.machine_rates(n=64, nbytes=1 << 20, repeats=1)
    assert flops > 0 and bw > 0


def test_cost_model_check_sparse_and_dense():
    model, rates = tiny(), (1e10, 1e10)
    sparse = cost.cost_model_check(model, 256, 8, 2, fraction_budget(1 / 8), 1, rates, repeats=1)
    assert sparse["pred"]["speedup"] > 1 and sparse["pred"]["sparse_s"] < sparse["pred"]["dense_s"]
    assert min(sparse["measured"].values()) > 0 and sparse["speedup"] > 0
    assert 0 < sparse["pages"] < 1  # the sparse engine read fewer pages than dense decode
    # every page is the dense budget: the same prediction on both sides, and the engine reads every page
    dense = cost.cost_model_check(model, 256, 8, 2, dense_budget, 1, rates, repeats=1)
    assert dense["pred"]["speedup"] == 1 and dense["pages"] == 1
    # fewer new tokens, less predicted decode work
    assert dense["pred"]["dense_s"] > cost.cost_model_check(model, 256, 2, 2, dense_budget, 1, rates,
                                                             repeats=1)["pred"]["dense_s"]


def test_rows_have_seven_columns(monkeypatch):
    monkeypatch.setattr(cost, "machine_rates", lambda: (1e10, 1e10))
    real = cost.cost_model_check
    monkeypatch.setattr(cost, "cost_model_check", lambda model, L_in, L_out, N, s, dl, rates:
                        real(tiny(), 256, 4, N, s, dl, rates, repeats=1))
    rows = cost.rollout_cost_vs_measured("cpu", "python -m bench rollout --quick", quick=True)
    assert len(rows) == 4 and "PREDICTION" in rows[-1]
    for r in rows:
        cells = r.strip("|").split(" | ")
        assert len(cells) == 7 and cells[3].endswith("x") and all(c.strip() for c in cells[:4]), r


def test_pagereads_times_every_selection_against_dense():
    from bench import pagereads
    lines = pagereads.run(True, "python -m bench pagereads --quick")
    if len(lines) == 1:  # no C++ kernel here: the section says so and times nothing
        assert "did not build" in lines[0]
        return
    rows = [line.split(" | ") for line in lines if line.startswith("| 8 ") or line.startswith("| 32 ")]
    # per page size: dense, random at r = 1, then random, runs of 4 and one run at r = 1/2, 1/4, 1/8
    assert len(rows) == 2 * 11 and all(float(r[3]) > 0 and float(r[5]) > 0 for r in rows)
    assert [r[2] for r in rows[:3]] == ["dense kernel", "random", "random"]


def test_sparrow_summary_takes_a_dense_run_that_measures_no_alpha():
    from bench import sparrow
    recs = [{"step": i, "reward": 0.1 * i, "kv_read": 1.0, "gen_s": 1.0, "new_tokens": 10}
            for i in range(5)]
    recs[-1]["acc"] = 0.5
    s = sparrow.summary({"records": recs, "acc0": 0.25})
    assert s["alpha"] != s["alpha"] and s["p5"] != s["p5"]  # NaN: nothing measured
    assert s["acc"] == 0.5 and s["tokens"] == 50 and s["bins"] == {"mean": [], "p5": []}


def test_sparrow_summary_gives_each_drafters_acceptance_and_the_suffix_share():
    """Arms (j) and (k): acceptance per drafter over the steps that drafted with it, and the
    suffix drafter's share of all drafts (a sparse-only run has none)."""
    from bench import sparrow
    recs = [{"step": i, "reward": 0.5, "kv_read": 1.0, "gen_s": 1.0, "new_tokens": 10,
             "spec_drafted_suffix": d_suf, "spec_accept_suffix": a_suf,
             "spec_drafted_sparse": d_sp, "spec_accept_sparse": a_sp}
            for i, (d_suf, a_suf, d_sp, a_sp) in enumerate([(30, 0.2, 10, 0.9), (10, 0.4, 30, 0.8),
                                                            (0, 0.0, 20, 0.7)])]
    recs[-1]["acc"] = 0.5
    s = sparrow.summary({"records": recs, "acc0": 0.25})
    assert s["accept_suffix"] == pytest.approx(0.3)  # the third step drafted nothing from text
    assert s["accept_sparse"] == pytest.approx(0.8)
    assert s["suffix_share"] == pytest.approx(40 / 100)
    assert [n for n in sparrow.arms(3)][-2:] == ["(j) (h), suffix drafts",
                                                "(k) (h), sparse or suffix per row"]
    assert "--spec_draft=mix" in sparrow.arms(3)["(k) (h), sparse or suffix per row"]


def test_sparrow_predictors_rank_each_statistic_against_the_held_out_gap():
    from bench import sparrow
    assert sparrow.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert sparrow.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert sparrow.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254)  # ties: mean rank
    mk = lambda acc, p5, tv, gap0: {"acc": acc, "p5": p5, "tv": tv, "gap0": gap0}
    runs = {"(a) dense": {0: mk(0.9, 0, 0, 0), 1: mk(0.8, 0, 0, 0)},
            "(c) x": {0: mk(0.5, 0.9, 9.0, -0.5), 1: mk(0.7, 0.95, 3.0, -0.1)},
            "(d) y": {0: mk(0.85, 0.8, 0.5, -0.02), 1: mk(0.6, 0.99, 5.0, -0.3)}}
    got = {label: (rho, len(xy)) for label, rho, xy in sparrow.predictors(runs)}
    # the gaps -0.4, -0.1, -0.05, -0.2: the TV and the reward gap rank them exactly, p5 does not
    assert got["rollout TV, 95th percentile"] == (pytest.approx(-1.0), 4)
    assert got["paired reward gap at step 0"][0] == pytest.approx(1.0)
    assert abs(got["per-position p5 alpha"][0]) < 1


def test_regime_reports_the_attention_share_and_each_scorers_calibrated_table(monkeypatch):
    """`python -m bench regime --quick`: an attention share per context, and per page size and
    scorer (centroid, Quest, oracle) a calibrated table whose read fraction lies in (0, 1]."""
    from bench import regime
    monkeypatch.chdir(ROOT)  # the section reads configs/lagged.py; its quick warm start is temporary
    lines = regime.run(True, "python -m bench regime --quick")
    share = [line.split(" | ") for line in lines if line.startswith("| 128 ") or line.startswith("| 256 ")]
    assert len(share) == 2 and all(0 < float(r[2].rstrip("% |")) <= 100 for r in share)
    cal = [line.split(" | ") for line in lines if line.startswith("| 8 (") or line.startswith("| 64 (")]
    assert [r[1] for r in cal] == list(regime.SCORERS) * 2
    assert all(0 < float(r[4]) <= 1 for r in cal)


def test_sparrow_aggregates_seeds_into_mean_and_standard_deviation(tmp_path):
    from bench import sparrow
    runs = []
    for seed, (r0, acc) in enumerate([(0.2, 0.5), (0.4, 0.7), (0.3, 0.6)]):
        recs = [{"step": i, "reward": r0 + 0.1 * i, "kv_read": 0.25, "gen_s": 1.0 + seed,
                 "new_tokens": 1000, "alpha_mean": 0.9, "alpha_p5": 0.8,
                 "alpha_bins": {"mean": [0.9, 0.8], "p5": [0.85, 0.5 + 0.1 * seed]}}
                for i in range(5)]
        recs[-1]["acc"] = acc
        runs.append(sparrow.summary({"records": recs, "acc0": 0.25}))
    a = sparrow.aggregate(runs)
    assert abs(a["acc"][0] - 0.6) < 1e-9 and abs(a["acc"][1] - 0.1) < 1e-9  # sample sd
    assert abs(a["reward0"][0] - 0.3) < 1e-9 and abs(a["reward1"][0] - 0.7) < 1e-9
    assert a["bins"]["p5"] == [0.85, 0.6] and a["acc0"] == (0.25, 0.0)
    assert [t for t, _, _ in a["curve"]] == list(range(5)) and a["curve"][-1][2][0] == a["acc"][0]
    assert a["ms"][0] == 2.0 and a["speedup"][0] != a["speedup"][0]  # no dense comparison: NaN
    sparrow.plot({"(c) held": a}, str(tmp_path / "sparrow.png"), 0.86)
    assert (tmp_path / "sparrow.png").stat().st_size > 0


def test_sparrow_tabulates_the_recorded_runs_and_reruns_a_changed_one(tmp_path, monkeypatch):
    """A full sparrow bench keeps each run's record; `--jobs 0` tabulates what is recorded, and a
    record whose arguments differ from the plan's (here its lr) is not taken."""
    from bench import sparrow
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sparrow, "RUNS", str(tmp_path))
    monkeypatch.setattr(sparrow, "plot", lambda *a: None)
    real = sparrow.predictors  # the figures, not the picture: the repo's assets stay as they are
    monkeypatch.setattr(sparrow, "predictors", lambda runs, path=None: real(runs))
    args = [sparrow.CONFIG, "--plot=false", "--sft_seed=0", "--threads=1"]
    plan = sparrow.plan_runs(args, sparrow.SEEDS, str(tmp_path), "out")
    n = len(sparrow.arms(sparrow.FIXED))
    assert len(plan) == n * len(sparrow.SEEDS) and plan[0][1] == plan[n - 1][1] == 0  # by seed
    recs = [{"step": 0, "reward": 0.5, "kv_read": 1.0, "gen_s": 2.0, "new_tokens": 1000, "acc": 0.75}]
    summary = sparrow.summary({"records": recs, "acc0": 0.5})
    for name, seed, path, a in plan[:2]:  # (a) and (b) at seed 0; (b)'s at another lr
        a = [x.replace("--threads=1", "--threads=2").replace("--out_dir=out/", "--out_dir=elsewhere/")
             for x in a] + ["--lr=1e-3"] * (a != plan[0][3])
        with open(path, "w") as f:
            json.dump({"args": a, "summary": summary}, f)
    assert sparrow.recorded(plan[0][2], plan[0][3])["acc"] == 0.75  # threads and out_dir aside
    assert sparrow.recorded(plan[1][2], plan[1][3]) is None
    lines = sparrow.run(False, "python -m bench sparrow --jobs 0", jobs=0)
    rows = [line.split(" | ") for line in lines if line.startswith("| (")]
    assert [(r[0], r[1]) for r in rows] == [("| (a) dense", "1")]
    assert rows[0][6] == "0.500 ± 0.000 -> 0.750 ± 0.000"


def test_sparrow_pairs_each_run_with_the_dense_run_of_its_own_warm_start(tmp_path, monkeypatch):
    """The same config builds another warm start on another CPU: its records go to their own
    ws-<id> folder (records_for), and each run's held-out gap is taken against the dense run of
    its own warm start and seed, never another's."""
    from bench import sparrow
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sparrow, "RUNS", str(tmp_path))
    monkeypatch.setattr(sparrow, "plot", lambda *a: None)
    got, real = {}, sparrow.predictors

    def predictors(runs, path=None):  # the figures, not the picture; keeps the TV's points
        out = real(runs)
        got["pts"] = out[1][2]
        return out
    monkeypatch.setattr(sparrow, "predictors", predictors)
    assert sparrow.records_for(str(tmp_path), "aaaa") == str(tmp_path)  # a new folder: its own
    assert sparrow.records_for(str(tmp_path), "aaaa") == str(tmp_path)
    other = sparrow.records_for(str(tmp_path), "bbbb")
    assert other == str(tmp_path / "ws-bbbb") and os.path.exists(os.path.join(other, "warmstart.json"))
    args = [sparrow.CONFIG, "--plot=false", "--sft_seed=0", "--threads=1"]
    recs = lambda acc, tv: [{"step": 0, "reward": 0.5, "kv_read": 0.5, "gen_s": 2.0, "new_tokens": 1000,
                             "acc": acc, "tv_tail": tv}]
    for d, dense, sparse, tv in ((str(tmp_path), 0.9, 0.8, 1.0), (other, 0.5, 0.45, 2.0)):
        plan = sparrow.plan_runs(args, [0], d, "out")
        for (name, seed, path, a), acc in zip(plan[:3], (dense, None, sparse)):
            if acc is not None:  # (a) dense and (c) p5-held, seed 0
                with open(path, "w") as f:
                    json.dump({"args": a, "summary": sparrow.summary({"records": recs(acc, tv),
                                                                      "acc0": 0.5})}, f)
    lines = sparrow.run(False, "cmd", jobs=0)
    assert "warm start aaaa" in lines[0] and "warm start bbbb" in lines[0]
    rows = {r.split(" | ")[0][2:]: r.split(" | ") for r in lines if r.startswith("| (")}
    assert rows["(a) dense"][1] == "2" and rows["(c) p5-held"][1] == "2"
    assert rows["(c) p5-held"][7] == "-0.075 ± 0.035"  # the paired held-out gap's mean and sd
    # the gaps: 0.8 - 0.9 and 0.45 - 0.5 (pairing across warm starts would give 0.8 - 0.5)
    assert sorted(round(y, 3) for _, y in got["pts"]) == [-0.1, -0.05]


def test_sparrow_keeps_a_second_task_family_apart(tmp_path, monkeypatch):
    """`--config configs/splitting.py`: its records in their own folder, its runs' folders and plots
    tagged, its own RESULTS block; configs/lagged.py keeps its names. --config is sparrow's alone."""
    from bench import sparrow
    from bench.__main__ import main
    assert sparrow.family(sparrow.CONFIG) == "" and sparrow.family("configs/splitting.py") == "-splitting"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sparrow, "RUNS", str(tmp_path))
    monkeypatch.setattr(sparrow, "plot", lambda *a: None)
    real = sparrow.predictors
    monkeypatch.setattr(sparrow, "predictors", lambda runs, path=None: real(runs))
    lines = sparrow.run(False, "cmd", jobs=0, config="configs/splitting.py")
    assert (tmp_path / "splitting").is_dir() and "configs/splitting.py, sft_seed 0" in lines[0]
    assert "sparrow-splitting_predict.png" in "\n".join(lines)
    plan = sparrow.plan_runs(["configs/splitting.py"], [0], "recs", "out", "-splitting")
    assert plan[0][2] == "recs/arm0-seed0.json" and plan[0][3][-1] == "--out_dir=out/sparrow-splitting-arm0-seed0"
    with pytest.raises(SystemExit):
        main(["step", "--config", "configs/splitting.py"])


def test_sparrow_carries_to_scale_only_an_arm_that_trains_like_dense():
    """An arm whose rollouts all fail keeps its warm start's held-out accuracy (no group to learn
    from): within dense's spread, but not the winner; the fastest arm that also keeps dense's training
    reward is."""
    from bench import sparrow
    arm = lambda acc, reward, speed: {"acc": (acc, 0.0), "reward1": (reward, 0.0), "speedup": (speed, 0.0)}
    results = {"(a) dense": {"acc": (0.62, 0.02), "reward1": (0.40, 0.05)},
               "(c) p5-held": arm(0.66, 0.0, 1.10), "(d) TV-held": arm(0.605, 0.30, 1.05),
               "(e) TV-held": arm(0.61, 0.49, 1.02)}
    assert sparrow.winner(results) == "(e) TV-held"
    results["(d) TV-held"] = arm(0.61, 0.38, 1.05)
    assert sparrow.winner(results) == "(d) TV-held"
    results["(d) TV-held"], results["(e) TV-held"] = arm(0.50, 0.38, 1.05), arm(0.55, 0.40, 1.0)
    assert sparrow.winner(results) == "(e) TV-held"  # none within both: the most accurate that trains


def test_sparrow_dense_gain_counts_the_gain_in_its_own_sds():
    from bench import sparrow
    runs = lambda *pairs: [{"acc0": a, "acc": b} for a, b in pairs]
    line = sparrow.dense_gain(runs((0.5, 0.8), (0.6, 0.8), (0.5, 0.75)))[-1]
    # gains 0.30, 0.20, 0.25: mean 0.25, sd 0.05, 5.0 sds
    assert "+0.250 ± 0.050 over 3 run(s)" in line and "5.0 sds, at least 3" in line
    line = sparrow.dense_gain(runs((0.5, 0.8), (0.6, 0.6), (0.5, 0.75)))[-1]
    assert "under 3 of its sds" in line  # gains 0.30, 0.00, 0.25: 1.5 sds
    assert "does not move" in sparrow.dense_gain(runs((0.656, 0.625)))[-1]
    assert sparrow.dense_gain([]) == []


def test_sparrow_variants_pick_arms_by_letter():
    from bench import sparrow
    plan = sparrow.plan_runs(["configs/lagged.py"], (0, 1), "/tmp/r", "/tmp/o")
    assert {p[0][1] for p in sparrow.chosen(plan, "a,h")} == {"a", "h"}
    assert len(sparrow.chosen(plan, "(a)")) == 2 and sparrow.chosen(plan, "") == plan
    with pytest.raises(ValueError, match="no arm z"):
        sparrow.chosen(plan, "a,z")
