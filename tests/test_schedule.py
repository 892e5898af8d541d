"""The sparsity schedule: the table as a budget function, offline calibration and the online
controller on a synthetic mismatch model with a known minimal table, calibration on a tiny model
through the engine, and the Kinetics-style cost model."""
import random

import pytest
import torch

from model import ModelConfig, Transformer
from rollout import Engine
from bench.cost import model_shape, rollout_cost
from calibrate import Controller, Schedule, calibrate, calibrate_engine
from sparsity import dense_budget, fixed_budget, table_budget


def test_schedule_is_a_table_budget_with_state():
    s = Schedule([29, 61, 93], bin_pages=125)
    ref = table_budget([29, 61, 93], 125)
    assert ([s(n) for n in (1, 124, 125, 300, 10_000)]
            == [ref(n) for n in (1, 124, 125, 300, 10_000)])
    s.extend(5)
    assert s.table == [29, 61, 93, 93, 93] and s.budget(10_000) == 93
    t = Schedule([1], bin_pages=1, threshold=0.5)
    t.load_state_dict(s.state_dict())
    assert (t.table == s.table and t.bin_pages == 125 and t.threshold == 0.86
            and t.table is not s.table)
    with pytest.raises(ValueError, match=r"\(1, 300\)"):
        Schedule([8, 300], bin_pages=4, max_pages=256)
    with pytest.raises(KeyError, match="bin_pages"):
        t.load_state_dict({"table": [1]})


# ----------------------------------------------------------------------- a synthetic mismatch model

# p5(budget, bin) = 1 - C[bin] / budget: better with budget, worse with length
C = [1.0, 2.0, 3.3, 4.4]
TARGET = 0.86
MINIMAL = [8, 15, 24, 32]  # the smallest integer b with 1 - c / b >= 0.86, worked out by hand
# (each p5 there is >= 0.002 from the target on both
# sides: a noise of +-0.001 cannot move the minimum)


def synthetic_p5(table, c=C, noise=0.0, rng=None):
    return [1 - ci / b + (rng.uniform(-noise, noise) if noise else 0.0) for ci, b in zip(c, table)]


def test_calibrate_finds_the_minimal_table():
    calls = []

    def measure(table):
        calls.append(list(table))
        return synthetic_p5(table)
    assert calibrate(measure, 4, range(1, 100), TARGET) == MINIMAL
    # uniform tables, stops once all bins pass
    assert len(calls) == 32 and all(len(set(t)) == 1 for t in calls)
    # a coarse grid: the smallest candidate at or above each bin's minimum
    assert calibrate(lambda t: synthetic_p5(t), 4, [4, 16, 32, 64], TARGET) == [16, 16, 32, 32]
    # a bin without tokens copies the bin before it; monotone
    # lifts a bin that needs less than its predecessor
    assert (calibrate(lambda t: synthetic_p5(t)[:3] + [float("nan")], 4, range(1, 100), TARGET)
            == [8, 15, 24, 24])
    assert calibrate(lambda t: synthetic_p5(t, c=[2.0, 1.0]), 2, range(1, 100), TARGET) == [15, 15]
    assert calibrate(lambda t: synthetic_p5(t, c=[2.0, 1.0]), 2, range(1, 100), TARGET,
                     monotone=False) == [15, 8]
    with pytest.raises(ValueError, match=r"bins \(bin, best position figure\) \[\(3, 0.8167\)\]"):
        calibrate(lambda t: synthetic_p5(t), 4, [10, 24], TARGET)


def run_controller(start, steps, c=C, noise=0.001, seed=0, **kw):
    schedule = Schedule(list(start), bin_pages=4, threshold=TARGET, max_pages=200)
    ctrl = Controller(schedule, step_pages=1, patience=2, min_count=10, **kw)
    rng, history = random.Random(seed), []
    for _ in range(steps):
        ctrl.observe(synthetic_p5(schedule.table, c, noise, rng), [100] * len(c))
        history.append(list(schedule.table))
    return history, ctrl


@pytest.mark.parametrize("start", [[2, 2, 2, 2], [80, 80, 80, 80], [2, 90, 20, 60]])
def test_controller_converges_to_the_minimal_table_and_stays(start):
    history, ctrl = run_controller(start, 600)
    # from above, each bin probes one step below its minimum once (the only way to learn it is the
    # minimum), fails, goes back up and holds there: the floor remembers the failure
    settled = max(i for i, t in enumerate(history) if t != MINIMAL) + 1
    assert settled < 250, f"still moving at step {settled}: {history[settled - 1]}"
    assert all(t == MINIMAL for t in history[settled:]) and ctrl.floor == MINIMAL


def test_controller_follows_drift_and_skips_thin_bins():
    history, ctrl = run_controller([2, 2, 2, 2], 300)
    assert history[-1] == MINIMAL
    better = [c / 2 for c in C]  # the policy drifted: half the mismatch at every budget
    for _ in range(400):
        ctrl.observe(synthetic_p5(ctrl.schedule.table, better), [100] * 4)
    assert ctrl.schedule.table == [4, 8, 12, 16]  # the new minimal table (1 - c / (2 b) >= 0.86)
    for _ in range(50):
        ctrl.observe(synthetic_p5(ctrl.schedule.table, C), [100] * 4)  # and back: raised promptly
    assert ctrl.schedule.table == MINIMAL
    before = list(ctrl.schedule.table)
    # thin bins, NaN: left alone
    ctrl.observe([0.0, 0.0, float("nan"), 0.99, 0.0], [5, 5, 100, 100, 100])
    # a new bin: its own
    assert ctrl.schedule.table[:4] == before and ctrl.schedule.table[4] == MINIMAL[-1] + 1
    ctrl2 = Controller(Schedule([1], 4))
    ctrl2.load_state_dict(ctrl.state_dict())
    assert ctrl2.floor == ctrl.floor and ctrl2.target == TARGET


def test_controller_respects_the_bounds():
    schedule = Schedule([10, 10], bin_pages=4, min_pages=8, max_pages=12)
    ctrl = Controller(schedule, step_pages=3, patience=1, min_count=1)
    for _ in range(5):
        ctrl.observe([0.0, 1.0], [50, 50])
    assert schedule.table == [12, 8]


# ------------------------------------------------------------------- calibration through the engine


from test_rollout import CharTok, tiny_model  # noqa: E402  (the same tiny model and tokenizer stub)


def test_schedule_drives_the_engine_and_calibrate_engine_runs():
    m, tok = tiny_model(), CharTok()
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]
    kw = dict(max_new_tokens=24, temperature=0.0, page_size=2, dense_layers=0, keep_recent=1)
    dense = Engine(m, tok, **kw).generate(prompts, 1)
    wide = Engine(m, tok, sparse=Schedule([1000], bin_pages=4), **kw).generate(prompts, 1)
    assert torch.equal(dense.tokens, wide.tokens)  # a table past every cached length reads densely
    # no EOS: every row runs to the end, so every bin has tokens
    kw.update(temperature=1.0, eos_ids=[99])
    # per-position alpha of a random tiny model sits close to 1: a high threshold shows the tail
    s = calibrate_engine(m, tok, prompts, [1, 3, 6, 12, 40], bin_pages=4, group_size=4,
                         threshold=0.99, **kw)
    assert isinstance(s, Schedule) and len(s.table) == 5 and s.threshold == 0.99
    assert all(a <= b for a, b in zip(s.table, s.table[1:])) and set(s.table) <= {1, 3, 6, 12, 40}
    assert s.table[-1] > s.table[0]  # the tail worsens with length even in a random tiny model
    assert calibrate_engine(m, tok, prompts, [1, 40], bin_pages=4, group_size=4, threshold=0.0,
                            **kw).table == [1] * 5


# ----------------------------------------------------------------------------- the cost model


def test_model_shape_counts_the_parameters_a_token_uses():
    cfg = ModelConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64)
    # tied: the embedding is the head
    assert model_shape(cfg) == (Transformer(cfg).num_params(), 2, 2, 8)
    cfg.tie_word_embeddings = False
    # the lookup is not a matmul
    assert model_shape(cfg)[0] == Transformer(cfg).num_params() - 30 * 32
    moe = ModelConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16)
    idle = 2 * (4 - 2) * 3 * 32 * 16  # per layer, two experts do not run for a token
    assert model_shape(moe)[0] == Transformer(moe).num_params() - idle


SHAPE = dict(P=1000, n_layers=2, N=2, r=2, D=8, flops=1e6, bandwidth=1e3)


def test_cost_by_hand():
    d = rollout_cost(L_in=96, L_out=16, **SHAPE)
    weights = 2 * 1000 * 2 * 16 / 1e6
    attn = 2 * (2 * 96 + 16) * 16 * 2 * 8 / 1e6  # r (2 L_in + L_out) L_out N D / flops
    kv = (2 * 96 * 16 * 8 + 2 * 16 ** 2 * 8) / 1e3  # (2 L_in L_out D + N L_out^2 D) / bandwidth
    assert (d["dense_s"] == pytest.approx(weights + attn + kv)
            and d["sparse_s"] == pytest.approx(d["dense_s"]))
    # fixed budget 2 pages of 16 on 97..112 cached tokens:
    # 7 pages, 3 always kept, so f = 3/7 at every step
    s = rollout_cost(L_in=96, L_out=16, schedule=fixed_budget(2), dense_layers=0, **SHAPE)
    f = 3 / 7
    # shared prompt part, each row's own
    kv_s = 2 * 8 * (16 * min(1, 2 * f) * 96 + 2 * f * 16 ** 2 / 2) / 1e3
    # steps * N * pages * key elements * (bytes, FLOPs)
    meta = 16 * 2 * 7 * (8 / 2) * (2 / 1e3 + 2 / 1e6)
    assert s["dense_s"] == pytest.approx(d["dense_s"])
    assert s["sparse_s"] == pytest.approx(weights + attn * f + kv_s + meta)
    assert s["speedup"] == pytest.approx(s["dense_s"] / s["sparse_s"])


def test_cost_dense_schedule_equals_dense_and_speedup_grows_with_length():
    for L_out in (1, 100, 5000):
        d = rollout_cost(L_in=300, L_out=L_out, schedule=dense_budget, **SHAPE)
        assert d["sparse_s"] == pytest.approx(d["dense_s"], rel=1e-12) and d["meta_s"] == 0
    # Qwen3-1.7B-like: 28 layers, 8 KV heads of 128, r = 2;
    # an H200-ish device; a fixed 128-page budget
    qwen = dict(P=1.7e9, n_layers=28, N=16, r=2, D=2 * 28 * 8 * 128, flops=9.9e14, bandwidth=4.8e12)
    speed = [rollout_cost(L_in=512, L_out=L, schedule=fixed_budget(128), **qwen)["speedup"]
             for L in (2048, 4096, 8192, 16384)]
    assert speed[0] == pytest.approx(1.0, abs=0.05) and all(a < b for a, b in zip(speed, speed[1:]))
    assert speed[-1] > 2
    # Sparrow's 1.7B table
    tab = Schedule([29, 61, 93, 93, 125, 157, 189, 221, 221, 253], bin_pages=125)
    assert rollout_cost(L_in=512, L_out=32768, schedule=tab, **qwen)["speedup"] > 1.5
    with pytest.raises(ValueError, match="positive"):
        rollout_cost(L_in=0, L_out=10, **SHAPE)


def test_schedule_file_round_trip_and_page_size_check(tmp_path):
    import calibrate
    from calibrate import Schedule
    from config import Config
    cfg = Config(page_size=8)
    calibrate.save_schedule(Schedule([3, 4, 6], 8, threshold=0.9), str(tmp_path / "s.json"), cfg)
    s = calibrate.load_schedule(str(tmp_path / "s.json"), page_size=8)
    assert s.table == [3, 4, 6] and s.bin_pages == 8 and s.threshold == 0.9 and s(100) == 6
    with pytest.raises(ValueError, match="page_size=8"):
        calibrate.load_schedule(str(tmp_path / "s.json"), page_size=16)


def test_calibrate_gives_a_bin_that_loses_its_tokens_the_largest_candidate():
    nan = float("nan")
    table = {1: [0.9, 0.5], 2: [0.95, 0.6], 4: [0.97, nan]}  # bin 1 fails, then has no tokens at 4
    assert calibrate(lambda t: table[t[0]], 2, [1, 2, 4], threshold=0.86) == [1, 4]
    with pytest.raises(ValueError, match="bins"):
        # measured at the largest candidate and still failing: an error
        calibrate(lambda t: [0.9, 0.5], 2, [1, 2, 4], threshold=0.86)


def test_the_tail_quantile_sees_rare_mismatches_that_p5_does_not():
    """observe's per-bin tail is the q-quantile of alpha (kv_quantile; Sparrow's p5 by default): one
    token in 200 mismatched leaves p5 at 1 and the 0.001-quantile near the mismatch, and the
    controller then raises the bin only under the lower quantile."""
    from calibrate import observe
    alpha = torch.ones(2000)
    alpha[::200] = 0.1  # 10 of 2,000 tokens
    pages = torch.full((2000,), 3)
    p5 = observe(alpha, pages, 4)["alpha_bins"]["p5"][0]
    low = observe(alpha, pages, 4, q=0.001)["alpha_bins"]["p5"][0]
    assert p5 == 1.0 and low < 0.2
    for q, raised in ((0.05, False), (0.001, True)):
        sched = Schedule([2], 4)
        observe(alpha, pages, 4, sched, Controller(sched, target=0.86), q=q)
        assert (sched.table[0] > 2) == raised
    from config import parse_config
    with pytest.raises(ValueError, match="kv_quantile"):
        parse_config(["--kv_quantile=0"])
