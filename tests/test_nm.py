"""N:M masks (sparsity.py) and RoI (roi.py): every mask keeps exactly n of every m weights over
many shapes, bad shapes are named, Wanda ranks by |W| * ||X||, SR-STE masks the forward and passes
a dense gradient with its decay on pruned weights only, fixed masks survive AdamW with weight
decay, RoI's gradients reach its logits and its final mask is valid, and `roi.py apply` / `learn`
round-trip through save_pretrained / from_pretrained."""
import json
import math
import os
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import roi
from model import ModelConfig, Transformer
from sparsity import (SRSTE, MaskedParams, NMLinear, apply_nm, input_norms, nm_linears, nm_mask,
                      wanda_scores)
from tasks import build_char_tokenizer

PAIRS = [(1, 4), (2, 4), (2, 8), (4, 8), (1, 2), (3, 4), (1, 8), (4, 4)]


def tiny_model(seed=0, vocab=30, moe=False):
    torch.manual_seed(seed)
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) if moe else {}
    return Transformer(ModelConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   intermediate_size=64, **extra))


def assert_nm(mask, n, m):
    assert mask.dtype == torch.bool
    assert (mask.reshape(mask.shape[0], -1, m).sum(-1) == n).all()


def assert_model_nm(model, masks, n, m):
    lin = nm_linears(model)
    assert set(masks) == set(lin) and masks
    for k, mask in masks.items():
        assert_nm(mask, n, m)
        assert not lin[k].weight[~mask].any(), k


# ----------------------------------------------------------------------------- masks and scores


def test_every_mask_keeps_exactly_n_of_every_m_over_random_shapes():
    rng = random.Random(0)
    for trial in range(300):
        n, m = PAIRS[trial % len(PAIRS)]
        w = torch.randn(rng.randint(1, 9), m * rng.randint(1, 9))
        if trial % 3 == 0:  # many ties: only the count is promised
            w = w.round()
        scores = torch.rand_like(w) if trial % 2 else None
        mask = nm_mask(w, n, m, scores)
        assert_nm(mask, n, m)
        s = (w.abs() if scores is None else scores).reshape(w.shape[0], -1, m)
        g = mask.reshape(s.shape)
        # every kept score is at least every dropped one of its group
        assert (s.masked_fill(~g, float("inf")).amin(-1)
                >= s.masked_fill(g, float("-inf")).amax(-1)).all()
        logits = torch.randn(w.shape[0], w.shape[1] // m, m)
        soft = roi.relaxed_topk(logits, n, tau=rng.uniform(0.05, 1), lam=rng.uniform(0.01, 1))
        assert torch.allclose(soft.sum(-1), torch.full_like(soft[..., 0], float(n)), atol=1e-4)
        assert (soft >= 0).all()  # (an entry may pass 1 when two logits tie: it is relaxed)


@pytest.mark.parametrize("n,m", [(1, 4), (2, 4), (2, 8), (4, 8)])
def test_model_masks_are_nm_for_every_method(n, m):
    model = tiny_model()
    masks = apply_nm(model, n, m)
    assert_model_nm(model, masks, n, m)
    assert not any(s in k for k in masks for s in ("lm_head", "embed", "gate."))
    model = tiny_model(moe=True)  # the MoE router stays dense, the experts are pruned
    masks = apply_nm(model, n, m)
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in masks
    assert "model.layers.0.mlp.gate.weight" not in masks
    sr = SRSTE(tiny_model(), n, m)
    assert_model_nm(sr.model, sr.remove(), n, m)
    r = roi.RoI(tiny_model(), n, m)
    assert_model_nm(r.model, r.remove(), n, m)


def test_m_that_does_not_divide_the_inputs_is_named():
    with pytest.raises(ValueError, match=r"shape \(3, 10\) has 10 inputs, not a multiple of m=4"):
        nm_mask(torch.randn(3, 10), 2, 4)
    with pytest.raises(ValueError, match="0 < n <= m"):
        nm_mask(torch.randn(3, 8), 5, 4)
    net = nn.Sequential(nn.Linear(8, 10), nn.Linear(10, 4))
    for make in (lambda: apply_nm(net, 2, 4), lambda: SRSTE(net, 2, 4),
                 lambda: roi.RoI(net, 2, 4)):
        with pytest.raises(ValueError, match=r"layer 1: .*\(4, 10\) has 10 inputs"):
            make()


def test_wanda_ranks_by_weight_times_input_norm():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 6))
    scale = torch.tensor([10.0, 0.1, 1.0, 5.0, 0.01, 3.0, 7.0, 0.5])
    x = torch.randn(3, 5, 8) * scale  # (B, T, in): channels of very different size
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[1, 3:] = False  # padding: left out of the norms
    x_pad = x.clone()
    x_pad[1, 3:] = 1e6
    norms = input_norms(net, [(x_pad, valid)])["0.weight"]
    assert torch.allclose(norms, x[valid].norm(dim=0), rtol=1e-5)
    scores = wanda_scores(net, [(x_pad, valid)])["0.weight"]
    w = net[0].weight.detach().clone()
    assert torch.allclose(scores, w.abs() * norms)
    ref = (w.abs() * norms).reshape(6, 2, 4).topk(2, -1).indices
    got = apply_nm(net, 2, 4, scores={"0.weight": scores})["0.weight"].reshape(6, 2, 4)
    assert torch.equal(got, torch.zeros_like(got).scatter_(-1, ref, True))
    assert not torch.equal(got.reshape(6, 8), nm_mask(w, 2, 4))  # not magnitude's choice here
    with pytest.raises(KeyError, match="no scores"):
        apply_nm(nn.Sequential(nn.Linear(8, 4)), 2, 4, scores={})


# ----------------------------------------------------------------------------- SR-STE


def test_srste_masks_the_forward_keeps_the_bias_and_passes_a_dense_gradient():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    nn.init.normal_(lin.bias)
    x = torch.randn(5, 8)
    grads = {}
    for decay in (0.0, 0.1):
        layer = NMLinear(lin, 2, 4, decay)
        lin.weight.grad = None
        y = layer(x)
        assert torch.allclose(y, F.linear(x, lin.weight * layer.mask, lin.bias))
        assert layer.bias is lin.bias and lin.bias.abs().min() > 0  # the bias is kept
        y.pow(2).sum().backward()
        grads[decay] = lin.weight.grad.clone()
    mask, w = layer.mask, lin.weight.detach()
    # straight-through: W gets the gradient of the masked weight W * mask, every entry of it
    wm = (w * mask).requires_grad_()
    F.linear(x, wm, lin.bias).pow(2).sum().backward()
    assert torch.allclose(grads[0.0], wm.grad)
    assert (grads[0.0][~mask] != 0).all()  # pruned weights get a gradient too
    # the decay acts on the pruned weights only
    assert torch.allclose(grads[0.1] - grads[0.0], 0.1 * w * ~mask, atol=1e-6)


def test_srste_remasks_every_k_steps_and_bakes_on_remove():
    model = tiny_model()
    sr = SRSTE(model, 2, 4, every=3)
    layer = sr.layers["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(model.model.layers[0].mlp.up_proj, NMLinear)
    assert "model.layers.0.mlp.up_proj.weight" in model.state_dict()  # names unchanged
    before = layer.mask.clone()
    with torch.no_grad():
        layer.weight.copy_(torch.where(before, 1e-3, 1.0) * torch.randn_like(layer.weight).sign())
    sr.step()
    sr.step()
    assert torch.equal(layer.mask, before)  # not yet
    sr.step()
    assert torch.equal(layer.mask, ~before)  # the large ones now
    masks = sr.remove()
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    assert_model_nm(model, masks, 2, 4)


# ----------------------------------------------------------------------------- fixed masks


def test_fixed_masks_hold_through_adamw_with_weight_decay():
    torch.manual_seed(0)
    model = tiny_model()
    mp = MaskedParams(model, apply_nm(model, 2, 4))
    start = {k: p.detach().clone() for k, p in mp.params.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    ids = torch.randint(0, 30, (4, 12))
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(model(ids)[:, :-1].reshape(-1, 30), ids[:, 1:].reshape(-1)).backward()
        mp.mask_grads()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mp.mask_weights()
    assert mp.leaked() == 0
    for k, p in mp.params.items():
        mask = mp.masks[k]
        assert (p[~mask] == 0).all() and (opt.state[p]["exp_avg"][~mask] == 0).all()
        assert not torch.equal(p[mask], start[k][mask])  # the active weights trained
    again = MaskedParams.from_model(model, 2, 4)
    assert all(torch.equal(again.masks[k], mp.masks[k]) for k in mp.masks)
    with pytest.raises(ValueError, match="not 2:4 sparse"):
        MaskedParams.from_model(tiny_model(), 2, 4)
    with pytest.raises(KeyError, match="no parameters"):
        MaskedParams(model, {"nope.weight": torch.ones(2, dtype=torch.bool)})


# ----------------------------------------------------------------------------- RoI


def test_roi_schedules_run_from_the_defaults_to_their_ends():
    assert roi.anneal(0, 100, 1.0, 0.05) == 1.0
    assert roi.anneal(75, 100, 1.0, 0.002) == pytest.approx(0.002)
    assert roi.anneal(99, 100, 1.0, 0.05) == pytest.approx(0.05)
    assert roi.anneal(30, 100, 1.0, 0.05) == pytest.approx(0.05 ** 0.4)
    # at the schedules' ends the soft mask is (nearly always) the hard top-n, with noise or not
    # (below tau = 1 an entry far ahead of the rest can be taken in two rounds: it is a relaxation)
    for n, m in [(1, 4), (2, 4), (2, 8), (4, 8)]:
        logits = torch.randn(200, m)
        hard = torch.zeros_like(logits).scatter_(-1, logits.topk(n, -1).indices, 1.0)
        for noise in (False, True):
            soft = roi.relaxed_topk(logits, n, 0.05, 0.002, noise=noise)
            assert ((soft - hard).abs().amax(-1) < 1e-2).float().mean() > 0.85


def test_roi_gradients_reach_the_logits_and_the_final_mask_is_valid():
    model = tiny_model()
    w0 = {k: p.detach().clone() for k, p in model.state_dict().items()}
    r = roi.RoI(model, 2, 4)
    opt = torch.optim.Adam(r.parameters(), lr=0.1)
    ids = torch.randint(0, 30, (4, 12))
    tmask = torch.ones(4, 12, dtype=torch.bool)
    tmask[:, -1] = False
    with torch.no_grad(), r.dense():
        teacher, _ = roi.completion_logits(model, ids, tmask)
    assert torch.allclose(teacher, roi.completion_logits(w0_model(w0), ids, tmask)[0], atol=1e-5)
    model.train()
    r.set_schedule(0.5, 0.5)
    roi.kd_loss(roi.completion_logits(model, ids, tmask)[0], teacher).backward()
    for layer in r.layers.values():
        g = layer.logits.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    # the weights are frozen
    assert all(p.grad is None for k, p in model.named_parameters() if not k.endswith("logits"))
    opt.step()
    masks = r.remove()
    assert_model_nm(model, masks, 2, 4)
    assert all(p.requires_grad for p in model.parameters())
    for k, mask in masks.items():  # the kept weights are the original ones
        assert torch.equal(model.state_dict()[k][mask], w0[k][mask])


def w0_model(sd):
    m = tiny_model()
    m.load_state_dict(sd)
    return m


# ----------------------------------------------------------------------------- the CLI


@pytest.fixture
def saved_model(tmp_path):
    tok = build_char_tokenizer(str(tmp_path / "base"))
    model = tiny_model(vocab=len(tok))
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(str(tmp_path / "base"))
    return str(tmp_path / "base"), model


def test_roi_apply_round_trips_through_save_pretrained(saved_model, tmp_path):
    base, model = saved_model
    out = str(tmp_path / "wanda")
    roi.main(["apply", base, "--nm=2:4", "--scores=wanda", f"--out={out}", "--eval=4"])
    got = Transformer.from_pretrained(out)
    info = json.load(open(os.path.join(out, "nm.json")))
    assert (info["n"], info["m"], info["method"]) == (2, 4, "wanda")
    mp = MaskedParams.from_model(got, 2, 4)  # what the loop would read back
    assert_model_nm(got, mp.masks, 2, 4)
    for k, v in model.state_dict().items():  # the kept weights as they were, the rest dense
        assert torch.equal(got.state_dict()[k], v * mp.masks[k] if k in mp.masks else v), k
    assert os.path.exists(os.path.join(out, "tokenizer.json"))


def test_roi_learn_round_trips_through_save_pretrained(saved_model, tmp_path):
    base, model = saved_model
    out = str(tmp_path / "learned")
    roi.main(["learn", base, "--nm=2:4", "--steps=3", "--batch=4", f"--out={out}", "--eval=0"])
    got = Transformer.from_pretrained(out)
    mp = MaskedParams.from_model(got, 2, 4)  # what the loop would read back
    assert_model_nm(got, mp.masks, 2, 4)
    kept = {k: v for k, v in got.state_dict().items() if k not in mp.masks}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in kept.items())  # frozen
    for k, mask in mp.masks.items():
        assert torch.equal(got.state_dict()[k][mask], model.state_dict()[k][mask])
    with pytest.raises(SystemExit):
        roi.main(["learn", base, "--nm=4:2", f"--out={out}"])


def test_training_and_calibration_problems_are_never_held_out():
    cfg = roi.parse_config(["--n_eval=200"])
    held = {p.prompt for p in roi.load_problems(cfg)[1]}
    for offset in (roi.TRAIN_SEED, roi.CALIB_SEED):
        drawn = roi.synthetic_problems(cfg, 500, offset, held)
        assert len(drawn) == 500 and not held & {p.prompt for p in drawn}


def test_compare_table_gives_mean_and_sd_over_seeds_and_the_gap_to_the_same_seeds_dense():
    """roi.py compare's table: one row per (sparsity, method, steps), the NLL and accuracy as mean
    ± sd over the seeds, and the accuracy gap to dense taken seed by seed."""
    rows = [dict(seed=s, nm="dense", method="dense", steps=0, ppl=1.0, acc=a, secs=0.0)
            for s, a in ((0, 1.0), (1, 0.9))]
    rows += [dict(seed=s, nm="2:4", method="roi", steps=30, ppl=math.exp(x), acc=a, secs=10.0)
             for s, x, a in ((0, 0.01, 0.9), (1, 0.03, 0.9))]
    lines = roi.results_table(rows).splitlines()
    assert len(lines) == 4
    cells = [c.strip() for c in lines[3].split("|")[1:-1]]
    assert cells[:4] == ["2:4", "roi", "30", "2"]
    assert cells[4] == "0.0200 ± 0.0141"  # NLL mean, sample sd of 0.01 and 0.03
    assert cells[5] == "0.900 ± 0.000" and cells[6] == "-0.050 ± 0.071"  # gaps -0.1 and 0.0
    assert roi.parse_ints("30,150") == [30, 150]
    with pytest.raises(Exception, match="ints"):
        roi.parse_ints("30,x")


def test_compare_leaves_out_a_seed_whose_dense_model_did_not_learn():
    """A seed whose warm start failed (dense held-out accuracy below roi.MIN_DENSE_ACC) is named in
    the head and left out of the table: its masks tie a broken model."""
    rows = [dict(seed=s, nm="dense", method="dense", steps=0, ppl=1.0, acc=a, secs=0.0)
            for s, a in ((0, 1.0), (3, 0.14))]
    rows += [dict(seed=s, nm="2:4", method="roi", steps=30, ppl=1.01, acc=a, secs=1.0)
             for s, a in ((0, 0.9), (3, 0.12))]
    head, table = roi.compare_table(rows, "python roi.py compare")
    assert "Seeds 0 (" in head and "Left out: seed 3 (dense held-out accuracy 0.140)" in head
    assert all(c.strip() != "2" for c in table.splitlines()[3].split("|"))  # one seed counted
    assert "| 2:4 | roi | 30 | 1 |" in table
