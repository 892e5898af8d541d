"""bench/cost.py's cost-model check (row (e) of `python -m bench rollout`) on a tiny model: the engine's measured
decode times and bench.cost.rollout_cost's prediction for the same schedule and lengths, and the rows' layout."""
import torch

from bench import cost
from model import ModelConfig, Transformer
from sparsity import dense_budget, fraction_budget


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
