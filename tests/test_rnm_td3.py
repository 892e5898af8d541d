"""examples/rnm_td3.py, the N:M sparse TD3, on a few hundred Pendulum steps: every masked layer of
all six networks keeps exactly n of every m weights (with the first layer dense, the default, and
N:M over padded inputs), pruned weights (online and target) and Adam's moments on them stay exactly
0 after the updates while the active weights train, and dense TD3 runs through the same code."""
import importlib.util
import os

import pytest
import torch

pytest.importorskip("gymnasium")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("rnm_td3", os.path.join(ROOT, "examples",
                                                                         "rnm_td3.py"))
rnm_td3 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rnm_td3)

SIX = ["actor", "critic1", "critic2", "actor_t", "critic1_t", "critic2_t"]


def short_run(sparsity, seed=0, extra=()):
    """300 steps, updates from step 100, small networks: a few seconds on one thread."""
    cfg = rnm_td3.parse_args([f"--sparsity={sparsity}", f"--seed={seed}", "--steps=300",
                              "--start_steps=100", "--hidden=32", "--batch=32",
                              "--eval_every=150", "--eval_episodes=1", "--final_evals=1", *extra])
    agent, hist = rnm_td3.train(cfg, log=lambda s: None)
    return cfg, agent, hist


@pytest.mark.parametrize("sparsity, input_layer", [("2:4", "dense"), ("1:8", "dense"),
                                                   ("2:4", "nm"), ("1:8", "nm")])
def test_masks_hold_on_all_six_networks(sparsity, input_layer):
    n, m = rnm_td3.parse_sparsity(sparsity)
    _, agent, hist = short_run(sparsity, extra=[f"--input_layer={input_layer}"])
    assert len(hist["return"]) == 2 and hist["final"] == hist["final"]  # two finite evaluations
    for name in SIX:
        masks = agent["masks"][name.removesuffix("_t")]  # a target takes its online net's mask
        layers = agent[name].layers
        if input_layer == "dense":  # the first layer: dense, unpadded (Pendulum: 3 or 4 inputs)
            assert masks[0] is None and layers[0].weight.shape[1] in (3, 4)
            assert layers[0].weight.ne(0).all()
            layers, masks = layers[1:], masks[1:]
        for layer, mask in zip(layers, masks):
            w = layer.weight
            assert w.shape[1] % m == 0, (name, w.shape)
            kept = mask.reshape(w.shape[0], -1, m).sum(-1)  # (out, in/m)
            assert (kept == n).all(), f"{name}: a group keeps other than {n} of {m}"
            assert (w[mask == 0] == 0).all(), f"{name}: a pruned weight moved"
            assert (w.ne(0).reshape(w.shape[0], -1, m).sum(-1) <= n).all()
    # Adam never saw a gradient on a pruned weight: both moments are exactly 0 there
    for opt, names in (("actor_opt", ["actor"]), ("critic_opt", ["critic1", "critic2"])):
        pairs = rnm_td3.masked_pairs(agent, names)
        assert len(pairs) == len(names) * (2 if input_layer == "dense" else 3)
        for w, mask in pairs:
            state = agent[opt].state[w]
            assert state["step"] > 0
            assert (state["exp_avg"][mask == 0] == 0).all()
            assert (state["exp_avg_sq"][mask == 0] == 0).all()
            assert state["exp_avg"][mask == 1].abs().sum() > 0  # the active weights did train


def test_active_weights_train_and_targets_follow():
    """The same seed builds the same masked networks, so a run's weights can be compared to a
    fresh build: the mask is the one chosen at init, the active entries moved, and each target
    moved too but lags its online network."""
    cfg, agent, _ = short_run("2:4", seed=1)
    torch.manual_seed(1)
    fresh = rnm_td3.build_agent(3, 1, 2.0, cfg.hidden, (2, 4), cfg.lr, cfg.input_layer)
    for name in ["actor", "critic1"]:
        w0, w = fresh[name].layers[1].weight, agent[name].layers[1].weight
        mask = agent["masks"][name][1]
        assert torch.equal(fresh["masks"][name][1], mask)  # fixed: the mask chosen at init
        assert (w - w0)[mask == 1].abs().max() > 0
        wt = agent[f"{name}_t"].layers[1].weight
        assert (wt - w0)[mask == 1].abs().max() > 0 and not torch.equal(wt, w)


def test_dense_runs_without_masks():
    _, agent, hist = short_run("dense")
    assert agent["masks"] == {"actor": None, "critic1": None, "critic2": None}
    assert agent["actor"].layers[0].weight.shape == (32, 3)  # no padding when dense
    assert len(hist["return"]) == 2 and hist["final"] == hist["final"]


def test_cost_counts_kept_slots():
    cfg = rnm_td3.parse_args(["--hidden=256", "--batch=256"])
    dense, half = rnm_td3.cost(cfg, 3, 1, None), rnm_td3.cost(cfg, 3, 1, (2, 4))
    assert dense["actor"] == 3 * 256 + 256 * 256 + 256 + 2 * 256 + 1
    # the first layer dense; half the slots of the others kept
    assert half["actor"] == 3 * 256 + (256 * 256 + 256) // 2 + 2 * 256 + 1
    # --input_layer=nm: the actor's 3 inputs are padded to 4, half the slots of every layer kept
    nm = rnm_td3.cost(rnm_td3.parse_args(["--input_layer=nm"]), 3, 1, (2, 4))
    assert nm["actor"] == (4 * 256 + 256 * 256 + 256) // 2 + 2 * 256 + 1
    assert abs(nm["flops"] / dense["flops"] - 0.5) < 0.01
    with pytest.raises(SystemExit, match="multiple of m"):
        rnm_td3.build_agent(3, 1, 2.0, 100, (1, 8), 3e-4)
