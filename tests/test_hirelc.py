"""examples/hirelc.py on a known landscape and on a tiny model made here: the cost model orders the
settings as it should and the budget split respects the budget; the random baseline spends exactly
the search's number of real evaluations and its choice meets a threshold that turns candidates
down; every method has its own cache; the held-out re-measurement uses prompts that no search saw;
the table says its speeds come from the cost model; and the plan written loads as a rollout copy
that refreshes in place, generates, and runs in the loop under TIS."""
import importlib.util
import itertools
import os
import random
import types

import pytest
import torch

from config import parse_config
from copies import describe_copy, make_rollout_copy, refresh_rollout_copy
from model import ModelConfig, Transformer
from rollout import Engine
from tasks import build_char_tokenizer, encode_pool, make_synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("hirelc", os.path.join(ROOT, "examples",
                                                                        "hirelc.py"))
hirelc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hirelc)


def test_cost_model_orders_settings_and_split_respects_the_budget():
    shapes = [[(64, 32), (32, 64)]] * 2
    cost = hirelc.CostModel(shapes, (30, 32), rows=128)
    speed = {s: cost.speed([s] * 2) for s in [("dense", "bf16"), ("dense", "fp8"),
                                              ("2:4", "bf16"), ("2:4", "fp8"), ("1:4", "int8")]}
    assert speed[("dense", "bf16")] == pytest.approx(1.0)
    assert 1 < speed[("dense", "fp8")] < speed[("2:4", "fp8")] < speed[("1:4", "int8")]
    assert 1 < speed[("2:4", "bf16")] < speed[("2:4", "fp8")]
    total = 0.5 * sum(cost.dense_blocks)
    for tilt in hirelc.TILTS:
        share = hirelc.split_budget(total, cost.dense_blocks, [3.0, 0.5], tilt)
        assert sum(share) == pytest.approx(total) and all(
            s <= d * (1 + 1e-9) for s, d in zip(share, cost.dense_blocks))
        assert share[0] >= share[1] and (tilt > 0) == (share[0] > share[1])


def test_bad_options_are_refused():
    for bad in (["--seeds=0,0"], ["--seeds=a"], ["--budgets=0"], ["--eval_prompts=0"]):
        with pytest.raises(SystemExit):
            hirelc.parse_args(bad)
    assert hirelc.parse_args([])[0].seeds == [0, 1, 2]


# a known landscape: the p5 a block's setting costs, times the block's sensitivity
from tests.test_methods import SENS, landscape_p5  # noqa: E402


class Landscape:
    """hirelc.Evaluator's interface over the landscape; every real measurement goes in `ledger`
    as (the evaluator, the setting)."""

    def __init__(self, name, ledger):
        self.name, self.ledger, self.cache, self.n_real, self.n_proxy = name, ledger, {}, 0, 0

    def real(self, setting):
        key = tuple(setting)
        if key not in self.cache:
            self.n_real += 1
            self.ledger.append((self, key))
            p5 = landscape_p5(setting)
            self.cache[key] = dict(p5_bins=[p5, p5 + 0.01], p5=p5, mean=1 - (1 - p5) / 3)
        return self.cache[key]

    def proxy(self, setting):
        self.n_proxy += 1
        return ((1 - landscape_p5(setting)) / 2) ** 2


def landscape_cost():
    return hirelc.CostModel([[(128, 64), (64, 128)]] * 3, (30, 64), rows=128)


def compare(seed, budgets, thr, ledger):
    args, _ = hirelc.parse_args(["--episodes=40", "--max_real=10", f"--threshold={thr}",
                                 f"--budgets={budgets}", f"--seeds={seed}"])
    return hirelc.compare(lambda name: Landscape(name, ledger), SENS, landscape_cost(), args,
                          lambda s: None)


def test_random_baseline_spends_the_search_count_and_meets_a_threshold_that_binds():
    cost, budget, thr = landscape_cost(), 0.6, 0.7
    every = [list(s) for s in itertools.product(hirelc.OPTIONS, repeat=3)]
    fits = [s for s in every if cost.within(s, budget)]
    assert 0.2 < sum(landscape_p5(s) >= thr for s in fits) / len(fits) < 0.6  # the threshold binds
    for seed in (0, 1, 2):
        out = compare(seed, budget, thr, [])
        search, rnd = out[budget, "searched"], out[budget, "random"]
        ev = rnd["evaluator"]
        # exactly the search's count (which is under --max_real here), of distinct settings
        assert rnd["real"] == ev.n_real == len(ev.cache) == search["real"] < 10
        assert all(cost.within(list(k), budget) for k in ev.cache)  # drawn within the budget
        assert any(r["p5"] < thr for r in ev.cache.values())  # candidates were turned down
        fastest = max(ev.cache, key=lambda k: cost.speed(list(k)))
        assert ev.cache[fastest]["p5"] < thr  # the threshold decides, not speed alone
        best = rnd["setting"]
        assert best is not None and landscape_p5(best) >= thr and cost.within(best, budget)
        assert rnd["p5"] == landscape_p5(best)
        assert cost.speed(best) == max(cost.speed(list(k)) for k, r in ev.cache.items()
                                       if r["p5"] >= thr)


def test_each_method_counts_and_caches_only_its_own_evaluations():
    ledger = []
    out = compare(0, "0.6,0.45", 0.7, ledger)
    evs = {key: r["evaluator"] for key, r in out.items()}
    uni = evs[0.6, "best uniform"]
    assert uni is evs[0.45, "best uniform"]  # one uniform sweep serves every budget
    others = [e for k, e in evs.items() if k[1] != "best uniform"]
    assert len({id(e) for e in others + [uni]}) == len(others) + 1  # a fresh cache per search
    assert set(uni.cache) == {tuple([o] * 3) for o in hirelc.OPTIONS}
    for key, r in out.items():
        own = [k for e, k in ledger if e is r["evaluator"]]
        assert r["real"] == len(own) == len(set(own)) == len(r["evaluator"].cache)
        assert set(own) == set(r["evaluator"].cache)  # nothing in it that another measured
    # every measurement is charged to one method, and no method's count holds another's
    assert len(ledger) == sum(r["real"] for k, r in out.items() if k[1] != "best uniform") + len(
        hirelc.OPTIONS)


def small_policy(n_layer, tok):
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                num_hidden_layers=n_layer, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, max_position_embeddings=256))
    with torch.no_grad():  # peaked distributions, as a trained model's: the mismatch shows
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.25)
    return m.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """run() on a two-block model, two seeds, one budget, with a spy on every Evaluator and on the
    prompts that Fisher may sample."""
    tmp_path = tmp_path_factory.mktemp("hirelc")
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    cfg = parse_config(["--max_new_tokens=12", "--group_size=4", f"--out_dir={tmp_path}"])
    problems, prompts = encode_pool(tok, make_synthetic(64, 0, (2, 3)), cfg, 256)
    assert len(set(map(tuple, prompts))) == len(prompts)  # disjoint means disjoint in content
    policy, rng, made, fisher, logs = small_policy(2, tok), random.Random(0), [], [], []

    class Spy(hirelc.Evaluator):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    def spy_fisher(policy, tok, prompts, *rest):
        fisher.extend(prompts)
        return real_fisher(policy, tok, prompts, *rest)

    real_fisher = hirelc.fisher_sensitivity
    args, _ = hirelc.parse_args([f"--out_dir={tmp_path / 'out'}", "--budgets=0.8", "--episodes=8",
                                 "--max_real=4", "--cold_start=3", "--eval_prompts=4",
                                 "--eval_group=2", "--final_prompts=4", "--proxy_prompts=4",
                                 "--fisher_batches=1", "--fisher_prompts=4", "--min_count=1",
                                 "--threshold=0.2", "--bin_tokens=16", "--seeds=0,1"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hirelc, "Evaluator", Spy)
        mp.setattr(hirelc, "fisher_sensitivity", spy_fisher)
        # rewards with spread, so that the Fisher sees a gradient
        mp.setattr(hirelc, "score", lambda probs, texts: [float(rng.random() < 0.5)
                                                          for _ in texts])
        mp.setattr(hirelc, "uniform_sweep", lambda ev, cost, log: [  # two settings, not 15
            ev.real([o] * 2) for o in [("dense", "bf16"), ("2:4", "fp8")]])
        lines = hirelc.run(policy, tok, cfg, problems, prompts, args, logs.append)
    return types.SimpleNamespace(lines=lines, made=made, fisher=fisher, logs=logs, policy=policy,
                                 tok=tok, prompts=prompts, out=tmp_path / "out", args=args)


def tables(lines):
    """-> [(header cells, [row cells])] for each markdown table in lines."""
    out = []
    for ln in lines:
        if not ln.startswith("|"):
            continue
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if cells[0] == "budget":
            out.append((cells, []))
        elif cells[0] != "---":
            out[-1][1].append(cells)
    return out


def test_held_out_prompts_are_disjoint_from_every_search_and_measure_every_plan(tiny_run):
    held = [e for e in tiny_run.made if e.name == "held-out"]
    searching = [e for e in tiny_run.made if e.name != "held-out"]
    assert len(held) == 2 and {e.name for e in searching} == {"search", "random", "uniform"}
    held_p = {tuple(p) for e in held for p in e.prompts}
    seen = {tuple(p) for e in searching for p in e.prompts} | set(map(tuple, tiny_run.fisher))
    assert len(held_p) == tiny_run.args.final_prompts and seen
    assert not held_p & seen  # no method's search (real evaluations, proxy, Fisher) saw them
    (_, summary), (cols, per) = tables(tiny_run.lines)
    assert len(per) == 6  # three methods x two seeds at one budget
    for row in per:
        r = dict(zip(cols, row))
        setting = r["setting per block (pattern/precision)"]
        assert not setting.startswith("none")  # a threshold of 0.2: every method finds a plan
        key = tuple(tuple(x.split("/")) for x in setting.split())
        got = held[int(r["seed"])].cache[key]  # the plan was measured on the held-out prompts
        assert r["p5 alpha, held-out"] == f"{got['p5']:.3f}"
        name = dict(searched="search", random="random").get(r["copy"], "uniform")
        own = [e for e in searching if e.seed == int(r["seed"]) and e.name == name]
        assert len(own) == 1 and r["p5 alpha, search prompts"] == f"{own[0].cache[key]['p5']:.3f}"


def test_run_gives_each_method_its_own_evaluator_and_count(tiny_run):
    for seed in (0, 1):
        names = sorted(e.name for e in tiny_run.made if e.seed == seed)
        assert names == ["random", "search", "uniform"]  # one budget: one of each per seed
    (_, _), (cols, per) = tables(tiny_run.lines)
    real = {(r[1], r[2]): int(r[-1]) for r in per}
    for seed in ("0", "1"):
        search = [e for e in tiny_run.made if e.name == "search" and e.seed == int(seed)][0]
        assert real["searched", seed] == real["random", seed] == search.n_real >= 2
        assert real["best uniform", seed] == 2  # its own sweep, not the search's measurements


def test_the_table_gives_mean_and_sd_and_labels_every_speed_as_the_cost_models(tiny_run):
    found = tables(tiny_run.lines)
    assert len(found) == 2 and "cost model" in tiny_run.lines[0]
    for cols, rows in found:
        speed = [c for c in cols if "speed" in c]
        assert speed and all("cost model" in c for c in speed)
        assert all(r[cols.index(speed[0])].endswith("x") for r in rows if r[3] != "none met"
                   " the threshold within the budget")
    cols, summary = found[0]
    searched = dict(zip(cols, [r for r in summary if r[1] == "searched"][0]))
    assert searched["plans (seeds)"] == "2/2" and "±" in searched["p5 alpha, held-out"]


def test_two_block_search_writes_a_plan_that_loads_as_a_rollout_copy(tiny_run):
    logs, policy, tok, prompts = tiny_run.logs, tiny_run.policy, tiny_run.tok, tiny_run.prompts
    sens = [ln for ln in logs if "Fisher sensitivity" in ln][0]
    assert "sensitivities set to 1" not in " ".join(logs) and sens.count(".") == 2
    (cols, summary), (_, per) = tables(tiny_run.lines)
    assert all(2 <= int(r[-1]) <= 4 for r in per if r[1] == "searched")  # the anchors, and more
    searched = dict(zip(cols, [r for r in summary if r[1] == "searched"][0]))
    assert float(searched["surrogate preds"].split()[0]) + float(  # predictions between them
        searched["proxy preds"].split()[0]) > 0
    out = tiny_run.out
    for stem in ("plan", "random", "uniform"):
        assert os.path.exists(out / f"{stem}.json") and os.path.exists(out / f"{stem}-0.8-s1.json")
    plan = str(out / "plan.json")
    copy = make_rollout_copy(policy, plan)
    assert copy.rollout_form == plan and "MiB" in describe_copy(copy)
    cfg_plan = parse_config([f"--rollout_copy={plan}", "--is_correction=tis"])  # train.py's check
    assert cfg_plan.rollout_copy == plan
    before = {k: v.clone() for k, v in copy.state_dict().items()}
    trained = small_policy(2, tok)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    refresh_rollout_copy(copy, trained)
    assert any(not torch.equal(before[k], v) for k, v in copy.state_dict().items())
    ro = Engine(copy, tok, max_new_tokens=6, temperature=1.0).generate(prompts[:2], 2, seed=0)
    assert torch.isfinite(ro.logp[ro.mask]).all()


@pytest.mark.parametrize("mask", ["magnitude", "wanda"])
def test_a_plan_runs_in_the_loop_under_tis(tmp_path, monkeypatch, mask):
    """train.py with rollout_copy=PLAN (and an N:M block whose masks are magnitude or Wanda's,
    calibrated on the task's prompts): the copy differs from the policy and TIS truncates."""
    import train
    from fake_reward import use_parity_reward
    from test_train import TINY_RUN
    use_parity_reward(monkeypatch.setattr)
    plan = tmp_path / "plan.json"
    hirelc.write_plan(str(plan), ["model.layers.0"], [("2:4", "int8")])
    recs = train.main(TINY_RUN + ["--steps=2", f"--rollout_copy={plan}", "--is_correction=tis",
                                  f"--rollout_copy_mask={mask}", "--is_cap=1.0",
                                  f"--out_dir={tmp_path / 'run'}", "--save_every=100"])["records"]
    trained = [r for r in recs if r["tokens"] > 0]
    assert trained and all(r["alpha_mean"] < 1.0 for r in trained)
    assert any(r["is_cut"] > 0 for r in trained)
