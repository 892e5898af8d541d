"""examples/rnm_td3.py, the N:M sparse TD3 (RNM-TD3), on a few hundred Pendulum steps: after several
mask updates every masked layer of all six networks keeps exactly n of every m weights (the first
layer too, by default), pruned weights (online and target) and Adam's moments on them are exactly 0
while the active weights train; masks change at the interval and only then; a regrown weight is
the group's inactive one with the largest gradient; dense TD3 runs through the same code; --compare
writes its table (with the line on the method's claim) under --out; MuJoCo when it is installed."""
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
OPTS = (("actor_opt", ["actor"]), ("critic_opt", ["critic1", "critic2"]))
TINY = ["--start_steps=100", "--hidden=32", "--batch=32", "--eval_every=150",
        "--eval_episodes=1", "--final_evals=1"]


def short_run(sparsity, seed=0, extra=(), steps=300):
    """300 steps, updates from step 100, small networks: a few seconds on one thread."""
    cfg = rnm_td3.parse_args([f"--sparsity={sparsity}", f"--seed={seed}", f"--steps={steps}",
                              *TINY, *extra])
    agent, hist = rnm_td3.train(cfg, log=lambda s: None)
    return cfg, agent, hist


def assert_nm_invariants(agent, n, m, dense_first):
    """Every masked layer of the six networks exactly n:m row-wise; pruned weights (online and
    target) and both Adam moments on them exactly 0; the active weights trained."""
    for name in SIX:
        masks = agent["masks"][name.removesuffix("_t")]  # a target takes its online net's mask
        layers = list(agent[name].layers)
        assert len(masks) == 3
        if dense_first:
            assert masks[0] is None and layers[0].weight.ne(0).all()
            layers, masks = layers[1:], masks[1:]
        for layer, mask in zip(layers, masks):
            w = layer.weight
            assert w.shape[1] % m == 0, (name, w.shape)
            kept = mask.reshape(w.shape[0], -1, m).sum(-1)  # (out, in/m)
            assert (kept == n).all(), f"{name}: a group keeps other than {n} of {m}"
            assert (w[mask == 0] == 0).all(), f"{name}: a pruned weight is not 0"
            assert (w.ne(0).reshape(w.shape[0], -1, m).sum(-1) <= n).all()
    for opt, names in OPTS:
        pairs = rnm_td3.masked_pairs(agent, names)
        assert len(pairs) == len(names) * (2 if dense_first else 3)
        for w, mask in pairs:
            state = agent[opt].state[w]
            assert state["step"] > 0
            assert (state["exp_avg"][mask == 0] == 0).all(), "Adam's m moves a pruned weight"
            assert (state["exp_avg_sq"][mask == 0] == 0).all(), "Adam's v on a pruned weight"
            assert state["exp_avg"][mask == 1].abs().sum() > 0  # the active weights did train


@pytest.mark.parametrize("sparsity, input_layer", [("2:4", None), ("1:8", None), ("2:4", "dense"),
                                                   ("1:8", "dense")])
def test_masks_hold_on_all_six_networks_through_mask_updates(sparsity, input_layer):
    n, m = rnm_td3.parse_sparsity(sparsity)
    extra = ["--mask_every=50"] + ([f"--input_layer={input_layer}"] if input_layer else [])
    cfg, agent, hist = short_run(sparsity, extra=extra)
    assert cfg.input_layer == (input_layer or "nm")  # N:M first layer by default
    assert len(hist["return"]) == 2 and hist["final"] == hist["final"]  # two finite evaluations
    # mask updates at 150, 200, 250 and 300 (updates start after step 100); the swap fraction
    # anneals to 0 at the last step, so the last one moves nothing
    assert [s for s, _ in hist["mask_moved"]] == [150, 200, 250, 300]
    moved = [f for _, f in hist["mask_moved"]]
    assert all(f > 0 for f in moved[:3]) and moved[3] == 0
    assert moved[0] > moved[2]  # the annealed swap fraction
    if input_layer is None:  # the first layer is padded to m: actor 3 -> m, critics 4 -> m
        assert agent["actor"].layers[0].weight.shape[1] == m
        assert agent["critic1_t"].layers[0].weight.shape[1] == m
    assert_nm_invariants(agent, n, m, dense_first=input_layer == "dense")


def td3_agent(nm=(2, 4), hidden=16, **over):
    """A Pendulum-shaped agent (3 inputs, 1 action, bound 2) and a fixed batch of 64."""
    cfg = rnm_td3.parse_args([f"--{k}={v}" for k, v in over.items()])
    torch.manual_seed(0)
    agent = rnm_td3.build_agent(3, 1, 2.0, hidden, nm, cfg.lr, cfg.input_layer)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(64, 3, generator=g), torch.rand(64, 1, generator=g) * 4 - 2,
             torch.randn(64, 1, generator=g), torch.randn(64, 3, generator=g),
             torch.zeros(64, 1))
    return cfg, agent, batch


def all_masks(agent):
    return {(name, i): mask.clone() for name in rnm_td3.NETS
            for i, mask in enumerate(agent["masks"][name]) if mask is not None}


def test_masks_change_at_the_interval_and_dropped_entries_are_zeroed():
    cfg, agent, batch = td3_agent(mask_every=4, steps=40, policy_delay=2)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 13):
        before = all_masks(agent)
        moved = rnm_td3.td3_update(agent, batch, step, cfg, gen)
        after = all_masks(agent)
        changed = {k for k in after if not torch.equal(before[k], after[k])}
        if step % 4:
            assert moved is None and not changed, f"step {step}: a mask changed between updates"
            continue
        # every layer of every online network rewired, and the count returned is what moved
        assert changed == set(after), f"step {step}: unchanged {set(after) - changed}"
        grown = sum(int((after[k] > before[k]).sum()) for k in after)
        assert moved == (grown, sum(int(a.sum()) for a in after.values())) and grown > 0
        for (name, i), new in after.items():
            old = before[(name, i)]
            dropped, regrown = (old > new), (new > old)
            assert dropped.sum() == regrown.sum()  # one out, one in: still N:M
            w = agent[name].layers[i].weight
            wt = agent[f"{name}_t"].layers[i].weight
            opt = agent["actor_opt" if name == "actor" else "critic_opt"]
            assert (w[dropped] == 0).all() and (wt[dropped] == 0).all(), (step, name, i)
            for key in ("exp_avg", "exp_avg_sq"):
                assert (opt.state[w][key][dropped] == 0).all(), (step, name, i, key)
            # regrown: from 0 with fresh moments, one Adam step, then the target by Polyak from 0
            assert (w[regrown] != 0).all()
            assert torch.allclose(wt[regrown], cfg.tau * w[regrown], rtol=1e-5, atol=0)
    assert_nm_invariants(agent, 2, 4, dense_first=False)


def test_regrow_takes_the_largest_gradient_and_drops_the_smallest_weight():
    # 2:4, two rows of two groups. In each group: the smallest active |w| drops, the inactive
    # entry with the largest |gradient| grows; the groups swap in order of that gradient.
    w = torch.tensor([[0.5, -0.1, 0.0, 0.0, 0.0, 0.2, 0.0, -0.3],
                      [0.4, 0.0, -0.6, 0.0, 0.0, 0.0, 0.7, 0.8]])
    mask = (w != 0).float()
    g = torch.tensor([[9.0, 9.0, 0.3, -0.7, -2.0, 5.0, 0.1, 5.0],  # active grads never count
                      [1.0, 0.05, 1.0, 0.01, 0.0, 0.0, 3.0, 3.0]])  # last group: nothing to gain
    half = rnm_td3.regrow_mask(w, g, mask, 4, 0.5)  # round(0.5 * 4) = 2 groups
    want = mask.clone()
    want[0, 1], want[0, 3] = 0, 1  # gain 0.7: drops -0.1 (the smaller), grows the -0.7 gradient
    want[0, 5], want[0, 4] = 0, 1  # gain 2.0: drops 0.2, grows the -2.0 gradient
    assert torch.equal(half, want), half
    every = rnm_td3.regrow_mask(w, g, mask, 4, 1.0)
    want[1, 0], want[1, 1] = 0, 1  # gain 0.05, the third group; the fourth has 0 and stays
    assert torch.equal(every, want), every
    one = mask.clone()
    one[0, 5], one[0, 4] = 0, 1  # round(0.25 * 4) = 1 group: the largest gain alone
    assert torch.equal(rnm_td3.regrow_mask(w, g, mask, 4, 0.25), one)
    assert torch.equal(rnm_td3.regrow_mask(w, g, mask, 4, 0.1), mask)  # round(0.4) = 0 groups


def test_update_masks_regrows_by_the_dense_gradient_of_the_loss():
    """In a whole network: the grad that update_masks reads is the dense one (masked_step calls it
    before masking), so a pruned entry given the largest gradient of its group is the one that
    comes back."""
    _, agent, batch = td3_agent(mask_every=0)
    layer, mask = agent["actor"].layers[1], agent["masks"]["actor"][1]
    slot = (mask == 0).reshape(-1, 4).float().argmax(-1)  # the first pruned slot of each group
    pick = torch.zeros(mask.numel() // 4, 4).scatter_(1, slot[:, None], 1.0).reshape(mask.shape)
    loss = (layer.weight * pick * 100).sum()  # d loss / dw = 100 there, 0 elsewhere in the layer
    loss = loss + agent["actor"](batch[0]).sum()  # and the network's own (smaller) gradients
    old = mask.clone()
    rnm_td3.masked_step(agent["actor_opt"], loss, rnm_td3.masked_pairs(agent, ["actor"]),
                        lambda: rnm_td3.update_masks(agent, ["actor"], agent["actor_opt"], 1.0))
    regrown = mask > old
    assert regrown.sum() == pick.sum() > 0 and torch.equal(regrown, pick.bool())


def test_fixed_mask_when_mask_every_is_0_and_targets_follow():
    """The same seed builds the same masked networks, so a run's weights can be compared to a
    fresh build: with --mask_every=0 the mask is the one chosen at init, the active entries
    moved, and each target moved too but lags its online network."""
    cfg, agent, hist = short_run("2:4", seed=1, extra=["--mask_every=0"])
    assert hist["mask_moved"] == []
    torch.manual_seed(1)
    fresh = rnm_td3.build_agent(3, 1, 2.0, cfg.hidden, (2, 4), cfg.lr, cfg.input_layer)
    for name in ["actor", "critic1"]:
        for i in range(3):
            assert torch.equal(fresh["masks"][name][i], agent["masks"][name][i])
        w0, w = fresh[name].layers[1].weight, agent[name].layers[1].weight
        mask = agent["masks"][name][1]
        assert (w - w0)[mask == 1].abs().max() > 0
        wt = agent[f"{name}_t"].layers[1].weight
        assert (wt - w0)[mask == 1].abs().max() > 0 and not torch.equal(wt, w)


def test_dense_runs_without_masks():
    _, agent, hist = short_run("dense", extra=["--mask_every=50"])
    assert agent["masks"] == {"actor": None, "critic1": None, "critic2": None}
    assert agent["actor"].layers[0].weight.shape == (32, 3)  # no padding when dense
    assert len(hist["return"]) == 2 and hist["final"] == hist["final"]
    assert hist["mask_moved"] == []


def test_cost_counts_kept_slots():
    cfg = rnm_td3.parse_args(["--hidden=256", "--batch=256", "--input_layer=dense"])
    dense, half = rnm_td3.cost(cfg, 3, 1, None), rnm_td3.cost(cfg, 3, 1, (2, 4))
    assert dense["actor"] == 3 * 256 + 256 * 256 + 256 + 2 * 256 + 1
    # the first layer dense; half the slots of the others kept
    assert half["actor"] == 3 * 256 + (256 * 256 + 256) // 2 + 2 * 256 + 1
    # the default: the actor's 3 inputs are padded to 4, half the slots of every layer kept
    nm = rnm_td3.cost(rnm_td3.parse_args([]), 3, 1, (2, 4))
    assert nm["actor"] == (4 * 256 + 256 * 256 + 256) // 2 + 2 * 256 + 1
    assert abs(nm["flops"] / dense["flops"] - 0.5) < 0.01
    with pytest.raises(SystemExit, match="multiple of m"):
        rnm_td3.build_agent(3, 1, 2.0, 100, (1, 8), 3e-4)
    with pytest.raises(SystemExit):  # the actor's mask update needs an actor step
        rnm_td3.parse_args(["--mask_every=5", "--policy_delay=2"])


def fake_results(finals):
    return {arm: [{"final": f} for f in fs] for arm, fs in finals.items()}


def test_paper_check_reads_the_gaps_against_the_noise():
    line = rnm_td3.paper_check(fake_results({
        "dense": [100, 110, 90], "2:4": [130, 140, 120],  # +30, 2 se = 16: beats
        "1:4": [101, 111, 91],  # +1: within noise
        "1:8": [50, 60, 40]}))  # -50: below beyond noise
    assert "2:4 +30 (2 se 16), beats dense: agrees" in line
    assert "1:4 +1 (2 se 16), above dense within noise: agrees in sign only" in line
    assert "1:8 -50 (2 se 16), below dense beyond noise: disagrees" in line
    line = rnm_td3.paper_check(fake_results({
        "dense": [100, 110, 90], "2:4": [95, 105, 85], "1:4": [60, 70, 50], "1:8": [95, 105, 85]}))
    assert "2:4 -5 (2 se 16), below dense within noise: does not agree" in line
    assert "1:4 -40 (2 se 16), below dense beyond noise: disagrees" in line
    assert "1:8 -5 (2 se 16), not below dense beyond noise: agrees" in line


def test_compare_writes_its_table_under_out_only(tmp_path, monkeypatch):
    def no_write(*a, **k):
        raise AssertionError("RESULTS.md written without --write-results")

    monkeypatch.setattr(rnm_td3, "write_results", no_write)
    monkeypatch.setattr(rnm_td3, "ROOT", str(tmp_path / "root"))  # assets/ would land here
    cfg = rnm_td3.parse_args(["--compare", "--steps=200", *TINY, "--seeds=1", "--mask_every=50",
                              f"--out={tmp_path}"])
    rnm_td3.compare(cfg, log=lambda s: None)
    assert not (tmp_path / "root").exists()
    text = (tmp_path / "Pendulum-v1" / "rnm_td3.md").read_text()
    assert (tmp_path / "Pendulum-v1" / "rnm_td3.png").exists()
    for arm in rnm_td3.ARMS:
        assert f"\n| {arm} | " in text
    assert "(`--input_layer=nm`)" in text and "Against the claim" in text
    assert "updated every 50 steps" in text


def test_mujoco_smoke():
    pytest.importorskip("mujoco")
    pytest.importorskip("imageio")
    _, agent, hist = short_run("2:4", steps=200, extra=["--env=Hopper-v5", "--mask_every=50"])
    assert [s for s, _ in hist["mask_moved"]] == [150, 200] and hist["mask_moved"][0][1] > 0
    assert agent["actor"].layers[0].weight.shape == (32, 12)  # 11 observations padded to 12
    assert agent["critic1"].layers[0].weight.shape == (32, 16)  # 11 + 3 padded to 16
    assert_nm_invariants(agent, 2, 4, dense_first=False)
