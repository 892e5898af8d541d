"""examples/hirelc.py, a two-block search for a few episodes on a tiny model made here: the cost
model orders the settings as it should, the budget split respects the budget and leans toward the
sensitive block, the Fisher sensitivities come from real gradients, the search counts real and
predicted evaluations, and the plan it writes loads as a rollout copy that refreshes in place and
generates."""
import importlib.util
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


def test_two_block_search_writes_a_plan_that_loads_as_a_rollout_copy(tmp_path, monkeypatch):
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    cfg = parse_config(["--max_new_tokens=12", "--group_size=4", f"--out_dir={tmp_path}"])
    problems, prompts = encode_pool(tok, make_synthetic(64, 0, (2, 3)), cfg, 256)
    policy = small_policy(2, tok)
    rng = random.Random(0)  # rewards with spread, so that the Fisher sees a gradient
    monkeypatch.setattr(hirelc, "score", lambda probs, texts: [float(rng.random() < 0.5)
                                                               for _ in texts])
    args, _ = hirelc.parse_args([f"--out_dir={tmp_path / 'out'}", "--budgets=0.8", "--episodes=8",
                                 "--max_real=4", "--cold_start=3", "--eval_prompts=4",
                                 "--eval_group=2", "--final_prompts=4", "--proxy_prompts=4",
                                 "--fisher_batches=1", "--fisher_prompts=4", "--min_count=1",
                                 "--threshold=0.2", "--bin_tokens=16"])
    logs = []
    monkeypatch.setattr(hirelc, "uniform_baseline", lambda ev, cost, B, log: [
        ([s] * B, cost.speed([s] * B), ev.real([s] * B)["p5"])
        for s in [("dense", "bf16"), ("2:4", "fp8")]])  # two uniform settings: seconds, not 15
    lines = hirelc.run(policy, tok, cfg, problems, prompts, args, logs.append)
    sens = [ln for ln in logs if ln.startswith("Fisher")][0]
    assert "sensitivities set to 1" not in " ".join(logs) and sens.count(".") == 2
    rows = [ln for ln in lines if ln.startswith("| 0.8 ")]
    assert len(rows) == 2 and "searched" in rows[0] and "best uniform" in rows[1]
    real, sur, proxy = (int(x) for x in rows[0].strip("| ").split(" | ")[-3:])
    assert 2 <= real <= 4 and sur + proxy > 0  # the anchors, and predictions between them
    plan = str(tmp_path / "out" / "plan.json")
    assert os.path.exists(plan) and os.path.exists(tmp_path / "out" / "uniform.json")
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
