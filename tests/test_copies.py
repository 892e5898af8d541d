"""The rollout copy (copies.py) and N:M masks (sparsity.py): masks keep the n largest of every m
inputs, fp8 weights stay within e4m3's rounding, both FP8Linear paths compute the same thing,
refresh tracks the policy in place, and each form's log-prob mismatch against the policy is finite
and ordered (same < bf16 < fp8 < 2:4)."""
import dataclasses
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from model import ModelConfig, Transformer
from rollout import Engine
from sparsity import apply_nm, nm_linears, nm_mask, wanda_scores
from copies import (COPY_SKIP, FP8_MAX, FP8Linear, Int8Linear, describe_copy, make_rollout_copy,
                    parse_form, quantize, quantize_fp8, refresh_rollout_copy, rollout_model_for)
from sync import Receiver, Sender
from test_rollout import PROMPTS, CharTok


def sharp_model(seed=0, moe=False, std=0.3):
    """A tiny model with weights large enough that its next-token distributions are peaked, as a
    trained model's are (at the default init every log-prob is about -log V and every form looks
    harmless)."""
    torch.manual_seed(seed)
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) if moe else {}
    m = Transformer(ModelConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                intermediate_size=64, **extra)).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return m


def fp8_round(x):  # per-token fp8 rounding of activations, as FP8Linear does it
    s = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s

# ----------------------------------------------------------------------------- N:M masks


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8)])
def test_nm_mask_keeps_the_n_largest_of_every_m(n, m):
    w = torch.randn(6, 32)
    g, kept = w.abs().view(6, -1, m), nm_mask(w, n, m).view(6, -1, m)
    assert (kept.sum(-1) == n).all()
    lo = g.masked_fill(~kept, float("inf")).amin(-1)  # smallest kept |w| per group
    hi = g.masked_fill(kept, float("-inf")).amax(-1)  # largest dropped |w| per group
    assert (lo >= hi).all()
    xnorm = torch.rand(32) * 10  # Wanda: |W| * ||X||, here with made-up input norms
    wanda = nm_mask(w, n, m, scores=w.abs() * xnorm).view(6, -1, m)
    ref = (w.abs() * xnorm).view(6, -1, m).topk(n, -1).indices
    assert torch.equal(wanda, torch.zeros_like(wanda).scatter_(-1, ref, True))


def test_nm_mask_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"\(3, 10\).*m=4"):
        nm_mask(torch.randn(3, 10), 2, 4)
    with pytest.raises(ValueError, match="2-D"):
        nm_mask(torch.randn(8), 2, 4)
    with pytest.raises(ValueError, match="0 < n <= m"):
        nm_mask(torch.randn(3, 8), 5, 4)
    with pytest.raises(ValueError, match="scores of shape"):
        nm_mask(torch.randn(3, 8), 2, 4, scores=torch.rand(8))
    with pytest.raises(ValueError, match="layer 1"):
        apply_nm(nn.Sequential(nn.Linear(8, 10), nn.Linear(10, 4)), 2, 4)


def test_apply_nm_zeros_exactly_the_masked_weights():
    m = sharp_model(moe=True)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    masks = apply_nm(m, 2, 4)
    assert {"model.layers.0.mlp.experts.0.gate_proj.weight",
            "model.layers.0.self_attn.q_proj.weight"} <= set(masks)
    # head and router stay dense
    assert not any("lm_head" in k or k.endswith("mlp.gate.weight") for k in masks)
    for k, v in m.state_dict().items():
        if k in masks:
            assert torch.equal(v, before[k] * masks[k]) and (v[masks[k]] != 0).all()
            assert masks[k].float().mean() == 0.5
        else:
            assert torch.equal(v, before[k]), k

# ----------------------------------------------------------------------------- fp8


def test_fp8_weights_within_e4m3_rounding():
    w = torch.randn(16, 64) * torch.logspace(-3, 1, 16)[:, None]  # rows of very different scales
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (16,)
    deq = q.float() * s[:, None]
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the
    # value; below 2^-6 (subnormals) it is 2^-10 absolute
    bound = torch.maximum(w.abs() * 2**-4, s[:, None] * 2**-10) * (1 + 1e-6)
    assert ((deq - w).abs() <= bound).all()
    assert torch.allclose(deq.abs().amax(1), w.abs().amax(1), rtol=1e-6)  # each row's amax is exact


def test_fp8_linear_matches_linear_and_scaled_mm_path():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    f = FP8Linear.from_linear(lin)
    x = torch.randn(2, 5, 64)
    # the dequantised weight on fp8-rounded inputs
    ref = F.linear(fp8_round(x), f.dequantized(), lin.bias)
    assert torch.allclose(f(x), ref, atol=1e-5, rtol=1e-5)
    assert f(x).shape == (2, 5, 48)
    # the copy runs in bf16: torch._scaled_mm (the CPU has a reference one) against simulation
    xb = x.bfloat16()
    f.bias = nn.Parameter(lin.bias.detach().bfloat16())
    f.scaled_mm = True
    real = f(xb)
    f.scaled_mm = False
    sim = f(xb)
    assert real.dtype == sim.dtype == torch.bfloat16
    assert torch.allclose(real.float(), sim.float(), atol=2e-2, rtol=1e-2)


def test_fp8_copy_logits_close_and_refresh_tracks_policy():
    policy = sharp_model(std=0.1)
    copy = make_rollout_copy(policy, "fp8")
    fp8 = {k: v for k, v in copy.named_modules() if isinstance(v, FP8Linear)}
    # 7 Linear per block, head kept
    assert len(fp8) == 2 * 7 and not isinstance(copy.lm_head, FP8Linear)
    # the engine takes its KV-cache dtype from the head
    assert copy.lm_head.weight.dtype == torch.bfloat16
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # ties survive the copy
    idx = torch.randint(2, 30, (2, 16))
    with torch.no_grad():
        diff, top = (copy(idx) - policy(idx)).abs().max().item(), policy(idx).abs().max().item()
    print(f"fp8 copy: max |logit diff| {diff:.4f} against logits up to {top:.2f}")
    # measured about 0.1 * top: e4m3's 2^-4 rounding on weights and inputs, 2 layers
    assert diff < 0.2 * top
    ptrs = {k: v.data_ptr() for k, v in copy.state_dict().items()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    refresh_rollout_copy(copy, policy)
    assert {k: v.data_ptr() for k, v in copy.state_dict().items()} == ptrs  # in place: same tensors
    for k, mod in fp8.items():
        q, s = quantize_fp8(policy.get_submodule(k).weight)
        assert (torch.equal(mod.weight.view(torch.uint8), q.view(torch.uint8))
                and torch.equal(mod.weight_scale, s))
    assert torch.equal(copy.model.norm.weight, policy.model.norm.weight.bfloat16())
    with torch.no_grad():
        assert (copy(idx) - policy(idx)).abs().max().item() < 0.2 * policy(idx).abs().max().item()


def test_refresh_equals_bf16_sync_and_nm_masks_follow_weights():
    policy = sharp_model()
    a, b = make_rollout_copy(policy, "bf16"), make_rollout_copy(policy, "bf16")
    sender, receiver = Sender(policy, dtype=torch.bfloat16), Receiver(b)
    receiver.apply(sender.make_update())
    nm = make_rollout_copy(policy, "nm2:4")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    refresh_rollout_copy(a, policy, "bf16")
    receiver.apply(sender.make_update())  # a delta
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    refresh_rollout_copy(nm, policy.state_dict())  # a dict of tensors works as the source too
    w, got = policy.model.layers[1].mlp.up_proj.weight, nm.model.layers[1].mlp.up_proj.weight
    assert torch.equal(got, w * nm_mask(w, 2, 4))
    assert torch.equal(nm.lm_head.weight, policy.lm_head.weight)


def test_forms_are_checked():
    assert (parse_form("2:4")[3] == parse_form("nm")[3] == "nm2:4"
            and parse_form("nm1:8")[1:3] == (1, 8))
    for bad in ("fp16", "nm4:2", "nm0:4", "int8"):
        with pytest.raises(ValueError, match="rollout copy form"):
            parse_form(bad)
    policy = sharp_model()
    copy = make_rollout_copy(policy, "bf16")
    with pytest.raises(ValueError, match="made as 'bf16'"):
        refresh_rollout_copy(copy, policy, "fp8")
    with pytest.raises(KeyError, match="lm_head"):
        refresh_rollout_copy(copy, {k: v for k, v in policy.state_dict().items()
                                    if k != "lm_head.weight"})

# -------------------------------------------------------------------------- mismatch and generation


def test_mismatch_is_ordered_and_every_form_generates():
    policy, tok = sharp_model(), CharTok()
    torch.manual_seed(1)
    idx = torch.randint(2, 30, (8, 24))
    with torch.no_grad():
        lp = policy(idx).log_softmax(-1)
        tgt = torch.distributions.Categorical(logits=lp).sample()  # tokens the policy would sample
        ref = lp.gather(-1, tgt[..., None])[..., 0]
    gap = {}
    for form in ("same", "bf16", "fp8", "nm2:4"):
        copy = make_rollout_copy(policy, form)
        assert (copy is policy) == (form == "same")
        assert not any(p.requires_grad for p in copy.parameters()) or form == "same"
        with torch.no_grad():
            # log p_rollout - log p_train
            d = copy(idx).log_softmax(-1).gather(-1, tgt[..., None])[..., 0] - ref
        assert torch.isfinite(d).all()
        ratio = (-d).exp()  # p_train / p_rollout, what TIS truncates
        gap[form] = d.abs().mean().item()
        print(f"{describe_copy(copy)} | mean |dlogp| {gap[form]:.4f}, max {d.abs().max():.4f}, "
              f"p5 of min(1, ratio) {ratio.clamp(max=1).quantile(0.05):.3f}")
        ro = (Engine(copy, tok, max_new_tokens=8, temperature=1.0)
              .generate(PROMPTS, group_size=2, seed=0))
        assert torch.isfinite(ro.logp[ro.mask]).all() and (ro.logp[ro.mask] <= 0).all()
        assert ro.tokens[ro.mask].max() < 30
    assert gap["same"] == 0 and 0 < gap["bf16"] < gap["fp8"] < gap["nm2:4"]


def test_fp8_moe_copy_generates_and_reports_its_own_logprobs():
    """The engine's log-probs for a copy are the copy's own (what TIS divides by), not the policy's.
    They are not bit-equal to the copy's teacher-forced ones: paged decode and a full forward round
    differently in bf16, and fp8 rounding of the inputs turns those small differences into steps."""
    policy, tok = sharp_model(moe=True, std=0.1), CharTok()
    copy = make_rollout_copy(policy, "fp8")
    assert "fp8 W8A8 (simulated)" in describe_copy(copy)
    ro = (Engine(copy, tok, max_new_tokens=8, temperature=1.0)
          .generate(PROMPTS, group_size=2, seed=3))
    to_copy = to_policy = 0.0
    for i in range(len(ro)):
        n, p = int(ro.mask[i].sum()), torch.tensor(PROMPTS[i // 2])
        ids, tgt = torch.cat([p, ro.tokens[i, :n]])[None], ro.tokens[i, :n, None]
        with torch.no_grad():
            lp_copy, lp_policy = (m(ids)[0, len(p) - 1:-1].log_softmax(-1).gather(-1, tgt)[:, 0]
                                  for m in (copy, policy))
        to_copy = max(to_copy, (ro.logp[i, :n] - lp_copy).abs().max().item())
        to_policy = max(to_policy, (ro.logp[i, :n] - lp_policy).abs().max().item())
    print(f"fp8 MoE engine log-probs: max gap {to_copy:.4f} to the copy's forward, {to_policy:.4f} "
          f"to the policy's")
    assert to_copy < 0.1 and to_copy < to_policy / 2

# ------------------------------------------------------- where an N:M copy's masks come from


def pruned(copy):
    """{weight name: weight} of the copy's N:M layers."""
    sd = copy.state_dict()
    return {k: sd[k] for k in copy.rollout_nm}


def calib():
    torch.manual_seed(5)
    return [torch.randint(2, 30, (4, 12)) for _ in range(2)]


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (2, 8)])
def test_every_mask_source_keeps_exactly_n_of_m_and_wanda_differs(n, m, tmp_path):
    policy = sharp_model(moe=True)
    with torch.no_grad():  # Wanda's scores only differ from magnitude where the input norms do
        policy.model.layers[0].input_layernorm.weight.uniform_(0.2, 3.0)
        policy.model.layers[1].post_attention_layernorm.weight.uniform_(0.2, 3.0)
    fixed = {k: nm_mask(torch.randn_like(mod.weight), n, m)
             for k, mod in nm_linears(policy, COPY_SKIP).items()}
    torch.save(dict(n=n, m=m, method="random", masks=fixed), tmp_path / "masks.pt")
    got = {}
    for source in ("magnitude", "wanda", str(tmp_path)):
        copy = make_rollout_copy(policy, f"nm{n}:{m}", source, calib() if source == "wanda"
                                 else None)
        assert len(copy.rollout_nm) == len(fixed) > 0
        for k, w in pruned(copy).items():
            assert ((w != 0).view(w.shape[0], -1, m).sum(-1) == n).all(), (source, k)
        got[source] = {k: w != 0 for k, w in pruned(copy).items()}
        assert f"masked {n}:{m} ({source} masks" in describe_copy(copy)
    assert all(torch.equal(got[str(tmp_path)][k], fixed[k]) for k in fixed)
    scores = wanda_scores(policy, calib(), COPY_SKIP)  # computed independently of the copy
    for k in fixed:
        assert torch.equal(got["wanda"][k], nm_mask(policy.state_dict()[k], n, m, scores[k]))
    assert any(not torch.equal(got["wanda"][k], got["magnitude"][k]) for k in fixed)


def test_fixed_masks_survive_refresh_and_scored_ones_follow_the_weights(tmp_path):
    policy = sharp_model()
    fixed = {k: nm_mask(torch.randn_like(mod.weight), 2, 4)
             for k, mod in nm_linears(policy, COPY_SKIP).items()}
    torch.save(dict(n=2, m=4, method="random", masks=fixed), tmp_path / "m.pt")
    copies = {s: make_rollout_copy(policy, "nm2:4", s, calib() if s == "wanda" else None)
              for s in ("magnitude", "wanda", str(tmp_path / "m.pt"))}
    before = {s: {k: w.clone() for k, w in pruned(c).items()} for s, c in copies.items()}
    ptrs = {s: {k: w.data_ptr() for k, w in pruned(c).items()} for s, c in copies.items()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    for s, c in copies.items():
        refresh_rollout_copy(c, policy)
        after = pruned(c)
        assert all(ptrs[s][k] == after[k].data_ptr() for k in after)  # in place
        for k, w in after.items():
            if s.endswith("m.pt"):
                assert torch.equal(w, policy.state_dict()[k] * fixed[k])
        moved = sum(not torch.equal(before[s][k] != 0, after[k] != 0) for k in after)
        assert (moved == 0) == s.endswith("m.pt"), (s, moved)


def test_a_bad_mask_file_is_refused_with_its_layer_named(tmp_path):
    policy = sharp_model()
    good = {k: nm_mask(mod.weight, 2, 4) for k, mod in nm_linears(policy, COPY_SKIP).items()}
    k0 = "model.layers.1.mlp.down_proj.weight"
    cases = {"shape": (dict(good, **{k0: good[k0][:, :32]}), 2, 4, r"down_proj.*\(32, 32\)"),
             "count": (dict(good, **{k0: torch.ones_like(good[k0])}), 2, 4, "exactly 2 of every 4"),
             "pattern": (good, 2, 8, "are 2:8"),
             "missing": ({k: v for k, v in good.items() if k != k0}, 2, 4, "no mask for")}
    for name, (masks, n, m, msg) in cases.items():
        torch.save(dict(n=n, m=m, masks=masks), tmp_path / f"{name}.pt")
        with pytest.raises(ValueError, match=msg):
            make_rollout_copy(policy, "nm2:4", str(tmp_path / f"{name}.pt"))
    (tmp_path / "junk.pt").write_text("not a mask file")
    with pytest.raises(ValueError, match="not a mask file"):
        make_rollout_copy(policy, "nm2:4", str(tmp_path / "junk.pt"))


def test_a_roi_mask_file_round_trips_into_the_copy(tmp_path):
    """roi.py learns masks on a saved model and writes OUT/masks.pt; a copy of the unmasked model
    under that file carries exactly the zeros of roi.py's masked model."""
    import roi
    from tasks import build_char_tokenizer
    tok = build_char_tokenizer(str(tmp_path / "base"))
    torch.manual_seed(0)
    base = Transformer(ModelConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   intermediate_size=64, max_position_embeddings=256))
    base.save_pretrained(str(tmp_path / "base"))
    roi.main(["learn", str(tmp_path / "base"), "--nm=2:4", f"--out={tmp_path / 'roi'}",
              "--steps=3", "--batch=4", "--eval=0", "--init=magnitude"])
    masked = Transformer.from_pretrained(str(tmp_path / "roi")).state_dict()
    copy = make_rollout_copy(base, "nm2:4", str(tmp_path / "roi"))  # the folder is enough
    assert set(copy.rollout_nm) == set(torch.load(tmp_path / "roi" / "masks.pt")["masks"])
    for k, w in pruned(copy).items():
        assert torch.equal(w, masked[k]), k  # the same zeros, and the same kept weights
    with pytest.raises(ValueError, match="are 2:4"):
        make_rollout_copy(base, "nm1:4", str(tmp_path / "roi"))
    # the file records the task it was fitted on (a bare folder: configs/sharpen.py's); a run of
    # another task or order is refused, one of the same is not
    from config import parse_config
    saved = torch.load(tmp_path / "roi" / "masks.pt")["task"]
    same = parse_config(["--rollout_copy=nm2:4", f"--rollout_copy_mask={tmp_path / 'roi'}",
                         f"--order={saved['order']}", f"--task={saved['task']}", "--sft_slip=0"])
    assert rollout_model_for(same, base).rollout_masks is not None
    other = dataclasses.replace(same, order="lagged" if saved["order"] != "lagged" else "marked")
    with pytest.raises(ValueError, match="was fitted on task"):
        rollout_model_for(other, base)


def test_rollout_model_for_reads_the_mask_key(tmp_path):
    from config import parse_config
    policy, prompts = sharp_model(), [[2, 3, 4, 5, 6], [7, 8, 9]] * 3
    cfg = parse_config(["--rollout_copy=nm2:4", "--rollout_copy_mask=wanda"])
    copy = rollout_model_for(cfg, policy, prompts)
    assert copy.rollout_norms is not None and "wanda masks" in describe_copy(copy)
    with pytest.raises(ValueError, match="rollout_copy_mask"):
        rollout_model_for(cfg, policy)


def test_plan_copy_mixes_blocks_and_refreshes_in_place(tmp_path):
    policy = sharp_model()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"blocks": {"model.layers.0": {"nm": "2:4", "precision": "int8"},
                                           "model.layers.1": {"nm": "dense",
                                                              "precision": "fp8"}}}))
    copy = make_rollout_copy(policy, str(plan))
    l0, l1 = copy.model.layers[0].mlp.up_proj, copy.model.layers[1].mlp.up_proj
    assert type(l0) is Int8Linear and type(l1) is FP8Linear and l0.weight.dtype == torch.int8
    assert set(copy.rollout_nm) == {k for k in nm_linears(policy) if ".layers.0." in k}
    w0 = policy.model.layers[0].mlp.up_proj.weight
    q, s = quantize(w0 * nm_mask(w0, 2, 4), torch.int8, 127.0)
    assert torch.equal(l0.weight, q) and torch.equal(l0.weight_scale, s)
    assert ((l0.weight != 0).view(l0.weight.shape[0], -1, 4).sum(-1) <= 2).all()
    ptr = l0.weight.data_ptr()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    refresh_rollout_copy(copy, policy.state_dict())
    q, s = quantize(w0 * nm_mask(w0, 2, 4), torch.int8, 127.0)
    assert l0.weight.data_ptr() == ptr and torch.equal(l0.weight, q)
    line = describe_copy(copy)
    assert "int8 W8A8" in line and "fp8 W8A8" in line and "masked 2:4" in line
    ro = Engine(copy, CharTok(), max_new_tokens=6, temperature=1.0).generate(PROMPTS, 2, seed=0)
    assert torch.isfinite(ro.logp[ro.mask]).all() and ro.mask.any()
    for blocks, msg in (({"model.layers.0": {"nm": "5:4", "precision": "bf16"}}, "block"),
                        ({"model.layers.0": {"nm": "dense", "precision": "fp4"}}, "block"),
                        ({"model.layers.9": {"nm": "dense", "precision": "bf16"}}, "no Linear")):
        plan.write_text(json.dumps({"blocks": blocks}))
        with pytest.raises(ValueError, match=msg):
            make_rollout_copy(policy, str(plan))
