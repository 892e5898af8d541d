"""Stage 4's maths beyond the basics in test_train.py: which KL each loss form follows, Dr. GRPO's
advantage, the logged gradient norm, an inf loss, dropout only in the training forward, and DAPO's
overlong filtering."""
import pytest
import torch

import config
import update
from model import ModelConfig, Transformer, add_lora


def categorical_grads(kl_loss, V=6, seed=0):
    """The expected gradient of the per-token KL loss over tokens sampled from the policy (exact:
    every token, weighted by its probability), and the gradients of the two exact KLs, all w.r.t.
    the policy's logits."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=g, requires_grad=True)
    ref = torch.randn(V, generator=g).log_softmax(-1)
    logp = theta.log_softmax(-1)
    p = logp.exp().detach()
    # V "tokens" in one row, each weighted by its probability (the mask is a float weight in
    # pg_loss)
    loss, _ = update.pg_loss(logp[None], logp.detach()[None], torch.zeros(1), p[None], 0.2, 0.2,
                             ref[None], kl_coef=1.0, kl_loss=kl_loss)
    est = torch.autograd.grad(loss, theta, retain_graph=True)[0]
    fwd = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)[0]  # KL(policy || ref)
    # KL(ref || policy)
    rev = torch.autograd.grad((ref.exp() * (ref - theta.log_softmax(-1))).sum(), theta)[0]
    return est, fwd, rev


def test_k2_loss_follows_kl_policy_to_ref_and_k3_the_reverse():
    est, fwd, rev = categorical_grads("k2")
    assert torch.allclose(est, fwd, atol=1e-5) and not torch.allclose(est, rev, atol=1e-2)
    est, fwd, rev = categorical_grads("k3")
    assert torch.allclose(est, rev, atol=1e-5) and not torch.allclose(est, fwd, atol=1e-2)
    with pytest.raises(ValueError, match="kl_loss"):
        categorical_grads("k1")


def test_dr_grpo_advantage_is_not_divided_by_the_std():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    std, _ = update.group_advantages(r, 4)
    none, _ = update.group_advantages(r, 4, norm="none")
    assert torch.allclose(none, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert torch.allclose(std, none / r.std(unbiased=False), atol=1e-5)
    with pytest.raises(ValueError, match="adv_norm"):
        update.group_advantages(r, 4, norm="max")


def tiny(seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=20, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   intermediate_size=64))


def batch():
    ids = torch.randint(1, 20, (4, 8), generator=torch.Generator().manual_seed(1))
    tmask = torch.zeros(4, 8, dtype=torch.bool)
    tmask[:, 3:7] = True
    return ids, tmask, torch.tensor([1.0, -1.0, 0.5, -0.5])


def test_logged_grad_norm_is_a_mean_over_the_optimizer_steps_not_their_sum():
    ids, tmask, adv = batch()
    norms = []
    for passes in (1, 3):
        m = tiny()
        # the weights stay put: every step sees the same gradient
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        cfg = config.Config(micro_batch=4, passes=passes)
        norms.append(update.train_on(cfg, m, opt, ids, tmask, adv, world=1)["stats"][4].item())
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-5)


def test_an_inf_loss_skips_the_step_even_with_a_finite_gradient(monkeypatch):
    ids, tmask, adv = batch()
    m = tiny()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    real = update.pg_loss

    # the value is inf, the gradient the surrogate's (a constant adds nothing)
    def inf_loss(*a, **k):
        loss, s = real(*a, **k)
        return loss + float("inf"), s

    monkeypatch.setattr(update, "pg_loss", inf_loss)
    stats = update.train_on(config.Config(micro_batch=4), m, opt, ids, tmask, adv, world=1)["stats"]
    assert stats[3].item() == 1 and all(torch.equal(before[k], v)
                                        for k, v in m.state_dict().items())


def test_dropout_acts_only_in_the_training_forward():
    ids, tmask, adv = batch()
    m = tiny()
    add_lora(m, 4, 8, dropout=0.5)
    m.eval()
    for mod in m.modules():  # a nonzero adapter, so that dropping its input changes the output
        if hasattr(mod, "lora_B"):
            torch.nn.init.normal_(mod.lora_B.weight)
    with torch.no_grad():
        a, b = (update.token_logprobs(m, ids, tmask) for _ in range(2))
    assert torch.equal(a, b)  # eval mode: the same weights give the same log-probs
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.0)
    update.train_on(config.Config(micro_batch=4), m, opt, ids, tmask, adv, world=1)
    assert not m.training  # back in eval mode for the rollouts that follow
    m.train()
    with torch.no_grad():
        c = update.token_logprobs(m, ids, tmask)
    assert not torch.equal(a, c)  # the adapter's dropout is real: it is the mode that matters


def test_overlong_filtering_drops_truncated_rows_from_the_loss_but_not_from_the_group():
    G, toks = 4, torch.tensor([[5, 6, 7]] * 4)
    mask = torch.ones(4, 3, dtype=torch.bool)
    kept = [update.Group(0, toks, mask, torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, 3),
                         cut=torch.tensor([False, True, False, False]))]
    ids, tmask, adv, roll = update.batch_from_groups(kept, [[1, 2]], G, 0, 1e-6,
                                                     torch.device("cpu"), drop_rows=kept[0].cut)
    assert tmask[1].sum() == 0 and tmask[0].sum() == 3 and tmask[2].sum() == 3
    # the group's mean keeps row 1
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)


def test_one_optimizer_step_skips_the_old_logprob_pass_and_updates_the_same(monkeypatch):
    ids, tmask, adv = batch()
    roll = torch.randn(4, 8) * 0.1 - 2.0
    calls, real = [], update.token_logprobs

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(update, "token_logprobs", counted)
    after = {}
    for name, dense_dist in (("one pass", False), ("with the old pass", True)):
        m = tiny()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        calls.clear()
        out = update.train_on(config.Config(micro_batch=2), m, opt, ids, tmask, adv, world=1,
                              rollout_logp=roll, dense_dist=dense_dist)
        after[name] = (len(calls), m.state_dict(), out["sample_alpha_mean"], out["stats"][0].item())
    assert after["one pass"][0] == 2 and after["with the old pass"][0] == 4  # 2 micro-batches
    one, two = after["one pass"], after["with the old pass"]
    assert all(torch.allclose(one[1][k], two[1][k], atol=1e-6) for k in one[1])  # the same update
    assert one[2] == pytest.approx(two[2], abs=1e-6) and one[3] == pytest.approx(two[3], rel=1e-5)


def grouped_batch(seed=2):
    """3 groups of 4 rows: each group's prompt (5, 8 and 2 tokens), then completions of 1 to 8
    tokens, right-padded; the rows of a group in a row, as batch_from_groups lays them out."""
    gen = torch.Generator().manual_seed(seed)
    ids, tmask = torch.zeros(12, 18, dtype=torch.long), torch.zeros(12, 18, dtype=torch.bool)
    for g, n in enumerate([5, 8, 2]):
        prompt = torch.randint(1, 20, (n,), generator=gen)
        for i in range(4 * g, 4 * g + 4):
            c = int(torch.randint(1, 9, (), generator=gen))
            ids[i, :n], ids[i, n:n + c] = prompt, torch.randint(1, 20, (c,), generator=gen)
            tmask[i, n - 1:n + c - 1] = True
    return ids, tmask, torch.randn(12, generator=gen)


def test_a_shared_prompt_run_once_gives_the_same_logprobs_and_gradients():
    """token_logprobs with share_prompt (each distinct prompt once, PromptOnce) equals the forward
    that runs every row's prompt, log-probs and gradients alike, rows in any order; rows that share
    no prompt take the plain path."""
    ids, tmask, _ = grouped_batch()
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    ids, tmask = ids[perm], tmask[perm]
    got = {}
    for share in (False, True):
        m = tiny()
        lp = update.token_logprobs(m, ids, tmask, share_prompt=share)
        (lp * torch.arange(1.0, 19.0)).sum().backward()
        got[share] = lp, [p.grad for p in m.parameters()]
    assert (got[True][0] - got[False][0]).abs().max() <= 1e-5
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(*(got[s][1]
                                                                           for s in (True, False))))
    ids, tmask, _ = grouped_batch()
    one_each = [0, 4, 8]  # a row of each group: no prompt shared
    lens = (tmask.flip(1).cumsum(1).flip(1) > 0).sum(1) + 1
    assert update.split_prompts(ids[one_each], tmask[one_each], lens[one_each]) is None
    prompts, plens, rows = update.split_prompts(ids, tmask, lens)[:3]
    assert plens.tolist() == [4, 7, 1] and rows.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_share_prompt_trains_the_same_step():
    """train_on with share_prompt (whole groups per micro-batch) takes the same optimizer step as
    without it."""
    ids, tmask, adv = grouped_batch()
    after = {}
    for share in (False, True):
        m = tiny()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        cfg = config.Config(micro_batch=8, group_size=4, share_prompt=share)
        out = update.train_on(cfg, m, opt, ids, tmask, adv, world=1)
        after[share] = m.state_dict(), out["stats"][0].item()
    assert all(torch.allclose(after[True][0][k], after[False][0][k], atol=1e-6)
               for k in after[True][0])
    assert after[True][1] == pytest.approx(after[False][1], rel=1e-5)
