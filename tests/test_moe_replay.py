"""MoE router replay (R3): the engine records every layer's experts (the shared prompt once per
group), the trainer replays them (padded and packed alike) with gradients into the router, and a
rollout copy in another precision routes differently without replay and identically with it."""
import copy

import pytest
import torch

import copies
import model
import train
import update
from config import parse_config
from model import ModelConfig, Transformer
from moe import disagreement, moe_layers, replay_batch, replaying
from rollout import Engine
from update import build_batch, replay_mismatch, token_logprobs

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,
                                       26, 3, 4]]


class CharTok:  # what the engine needs of a tokenizer: pad 0, eos 1
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["" for _ in rows]


def moe_model(seed=0, std=0.3, dtype=torch.float32, experts=8):
    """A random tiny Qwen3-MoE with weights of std `std`: sharp enough that the router's choices
    and the sampled tokens depend on the weights, not on ties."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64,
                      num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    return m.to(dtype)


def rollout(model, G=4, topk=30, seed=1, **kw):
    eng = Engine(model, CharTok(), max_new_tokens=24, temperature=1.0, topk_logprobs=topk, **kw)
    return eng.generate(PROMPTS, group_size=G, seed=seed)


def test_engine_records_every_layer_once_per_prompt_and_matches_a_full_forward():
    m = moe_model()
    ro = rollout(m, G=3)
    r = ro.experts
    assert len(r.prompts) == len(PROMPTS)  # one entry per distinct prompt, shared by its G rows
    of = r.prompt_of.view(3, 3)  # (prompts, G): the rows of a prompt point at one entry
    assert (of == of[:, :1]).all() and len(set(of[:, 0].tolist())) == 3
    assert [tuple(r.prompts[j].shape) for j in of[:, 0].tolist()] == [(len(p), 2, 2)
                                                                      for p in PROMPTS]
    n = ro.mask.sum(1)
    for i in range(len(ro)):  # fed tokens recorded; the last sampled token never runs, nor pads
        assert (r.completion[i, :n[i] - 1] >= 0).all() and (r.completion[i, n[i] - 1:] == -1).all()
    # the recording sits where the trainer's own forward of the same weights routes: a shift by
    # one position, or rows swapped, would disagree on most tokens
    ids, tmask = build_batch([PROMPTS[i] for i in ro.prompt_index], ro.tokens, ro.mask, 0)
    routes = replay_batch([r.take(range(0, 6)), r.take(range(6, 9))],
                          [ro.mask[:6], ro.mask[6:]], ids.shape)
    with torch.no_grad():
        m(ids)
    picks, tokens = disagreement(m, routes, tmask)
    assert picks < 0.01 and tokens < 0.03
    assert len(r.take(range(0, 6)).prompts) == 2  # a block of rows keeps its prompts once each
    # unshared prefill records the same prompts
    r2 = rollout(m, G=3, share_prefix=False).experts
    assert len(r2.prompts) == 9 and all(torch.equal(r2.prompts[r2.prompt_of[i]],
                                                    r.prompts[r.prompt_of[i]]) for i in range(9))


@pytest.mark.parametrize("form, min_diff", [("bf16", 0.003), ("fp8", 0.02)])
def test_replay_makes_disagreement_zero_and_mismatch_smaller(form, min_diff):
    """The rollout copy differs from the fp32 trainer. Without replay the two route differently
    (the test fails if the copy is too close to matter); with replay, not at all, and the
    per-position mismatch drops."""
    m = moe_model()
    ro = rollout(copies.make_rollout_copy(m, form))
    s = replay_mismatch(m, PROMPTS, ro, 1.0, 4)
    print(form, {k: round(v, 4) for k, v in s.items()})
    assert s["moe_diff"] >= min_diff and s["moe_diff_tok"] >= 2 * min_diff  # the baseline
    assert s["moe_diff_replay"] == 0.0 and s["moe_diff_tok_replay"] == 0.0  # exactly
    assert s["alpha_replay_mean"] > s["alpha_own_mean"]
    assert s["alpha_replay_p5"] > s["alpha_own_p5"]
    assert s["kl_replay"] < 0.5 * s["kl_own"]
    # the control: the trainer generating itself leaves (almost) nothing to replay away
    same = replay_mismatch(m, PROMPTS, rollout(m), 1.0, 4)
    assert same["moe_diff"] < 0.25 * s["moe_diff"]


def loss_under_replay(model, ids, tmask, routes):
    """The summed log-prob of the sampled tokens in the model's dtype (token_logprobs rounds to
    fp32, too coarse for finite differences)."""
    with replaying(model, routes):
        h = model(ids, hidden=True)[tmask]
    lp = torch.log_softmax(model.lm_head(h), -1)
    return lp.gather(-1, torch.roll(ids, -1, 1)[tmask][:, None]).sum()


def test_router_gets_gradient_under_replay_and_it_matches_finite_differences(monkeypatch):
    # RMSNorm normalises in fp32 (the reference's bits): in fp64 here, or its rounding would swamp
    # the finite differences
    monkeypatch.setattr(model.RMSNorm, "forward", lambda self, x: self.weight * x * torch.rsqrt(
        x.pow(2).mean(-1, keepdim=True) + self.eps))
    m = moe_model(std=0.3, dtype=torch.float64)
    ro = rollout(copies.make_rollout_copy(moe_model(std=0.3), "fp8"), G=2)
    ids, tmask = build_batch([PROMPTS[i] for i in ro.prompt_index], ro.tokens, ro.mask, 0)
    routes = replay_batch([ro.experts], [ro.mask], ids.shape)
    # the trainer's path: token_logprobs under replay gives the router a gradient
    token_logprobs(m, ids, tmask, routes=routes)[tmask].sum().backward()
    gate = moe_layers(m)[0].gate.weight
    assert gate.grad is not None and gate.grad.abs().max() > 1e-3
    m.zero_grad()
    loss_under_replay(m, ids, tmask, routes).backward()
    eps, g = 1e-6, torch.Generator().manual_seed(0)
    for _ in range(4):  # replay fixes the experts: the loss is smooth in the router's weights
        i, j = (int(torch.randint(n, (1,), generator=g)) for n in gate.shape)
        with torch.no_grad():
            gate[i, j] += eps
            up = loss_under_replay(m, ids, tmask, routes)
            gate[i, j] -= 2 * eps
            down = loss_under_replay(m, ids, tmask, routes)
            gate[i, j] += eps
        fd = (up - down) / (2 * eps)
        assert float(fd) == pytest.approx(float(gate.grad[i, j]), rel=1e-5, abs=1e-8)


def test_packed_forward_replays_the_same_experts_as_padded():
    m = moe_model()
    ro = rollout(m, G=2)
    ids, tmask = build_batch([PROMPTS[i] for i in ro.prompt_index], ro.tokens, ro.mask, 0)
    # routes far from the model's own (random experts): a misaligned packing would show
    g = torch.Generator().manual_seed(0)
    routes = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(ids.numel() * 2)])
    routes = routes.view(*ids.shape, 2, 2).to(torch.int16)
    with torch.no_grad():
        padded = token_logprobs(m, ids, tmask, routes=routes)
        packed = token_logprobs(m, ids, tmask, packed=True, routes=routes)
        used = moe_layers(m)[0].last_experts  # (total, k): packed, the rows back to back
        own = token_logprobs(m, ids, tmask)
    assert torch.allclose(padded, packed, atol=1e-5)
    assert (padded - own).abs().max() > 0.1  # the replay did change the routing
    lens = (tmask.flip(1).cumsum(1).flip(1) > 0).sum(1) + 1
    assert torch.equal(used, torch.cat([routes[i, :lens[i], 0] for i in range(len(lens))]).long())


def test_balance_loss_follows_the_replayed_experts_and_reaches_the_router():
    m = moe_model()
    ids = torch.tensor([PROMPTS[2]])
    forced = torch.zeros(*ids.shape, 2, 2, dtype=torch.int16)
    forced[..., 1] = 1  # every token to experts 0 and 1
    terms = []
    with replaying(m, forced, aux=terms):
        m(ids)
    aux = torch.stack(terms).mean()
    # E * sum_e f_e P_e with f = (1/2, 1/2, 0, ...): 4 * (P_0 + P_1) averaged over the layers
    P = []
    with torch.no_grad():
        x = m.model.embed_tokens(ids)
        from model import rope_cos_sin
        cos, sin = rope_cos_sin(torch.arange(ids.shape[1])[None], 8, m.config.rope_theta, x.dtype)
        for block in m.model.layers:
            h = block.post_attention_layernorm(x + block.self_attn(block.input_layernorm(x), cos,
                                                                    sin))
            p = torch.softmax(block.mlp.gate(h[0]), -1).mean(0)
            P.append(4 * (p[0] + p[1]))
            with replaying(m, forced):
                x = block(x, cos, sin)
    assert aux.item() == pytest.approx(float(sum(P) / len(P)), rel=1e-5)
    aux.backward()
    assert moe_layers(m)[1].gate.weight.grad.abs().max() > 0


def test_train_on_replays_per_mode_and_adds_the_balance_loss(monkeypatch):
    m = moe_model()
    ro = rollout(copies.make_rollout_copy(m, "fp8"), G=2)
    ids, tmask = build_batch([PROMPTS[i] for i in ro.prompt_index], ro.tokens, ro.mask, 0)
    routes = replay_batch([ro.experts], [ro.mask], ids.shape)
    adv = torch.linspace(-1, 1, len(ro))
    roll = torch.zeros(tmask.shape)
    roll[tmask] = ro.logp[ro.mask]
    seen = []
    orig = update.token_logprobs
    monkeypatch.setattr(update, "token_logprobs", lambda *a, **k: (
        seen.append((torch.is_grad_enabled(), k.get("routes") is not None)), orig(*a, **k))[1])
    for mode, want in (("off", {(True, False)}), ("logprob", {(False, True), (True, False)}),
                       ("update", {(True, True)})):
        cfg = parse_config(["--micro_batch=4", f"--router_replay={mode}", "--moe_aux_coef=0.01",
                            "--lr=1e-3", "--minibatches=1"])  # one optimizer step: no old forward
        seen.clear()
        out = update.train_on(cfg, copy.deepcopy(m), torch.optim.SGD(m.parameters(), lr=0.0),
                              ids, tmask, adv, 1, roll, routes=routes)
        assert set(seen) == want, mode  # (grad on, replayed) of every forward
        assert out["moe_aux"] > 0


def test_router_replay_config_errors(monkeypatch):
    with pytest.raises(ValueError, match="router_replay"):
        parse_config(["--router_replay=on"])
    dense = Transformer(ModelConfig(vocab_size=30, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    monkeypatch.setattr(train, "build_policy", lambda *a, **k: (dense, CharTok()))
    with pytest.raises(ValueError, match="'router_replay'.*needs an MoE model"):
        train.build(parse_config(["--router_replay=update"]), 0, 1, torch.device("cpu"), None,
                    print)


def test_tiny_moe_trains_with_replay_in_the_loop(tmp_path, monkeypatch):
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)
    small = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--n_expert=4",
             "--moe_ffn=16", "--sft_steps=3", "--sft_batch=8", "--n_train=64", "--n_eval=8",
             "--prompts_per_step=4", "--group_size=4", "--max_new_tokens=12", "--steps=2",
             "--eval_every=100", "--plot=false", "--difficulty=(1,2)", "--rollout_copy=fp8",
             "--micro_batch=8", "--save_every=100", f"--out_dir={tmp_path}"]
    recs = train.main(["configs/tiny_moe.py"] + small)["records"]
    for r in recs:
        assert r["moe_diff_replay"] == 0.0 and "alpha_replay_p5" in r and "alpha_own_p5" in r
    assert any(r["tokens"] > 0 and r.get("moe_aux", 0) > 0 for r in recs)
