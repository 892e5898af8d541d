"""The sparse-to-dense mismatch: alpha in its exact, top-k and per-sample forms on hand-made
distributions, the per-bin tail statistic, and the engine's top-k log-probs against the naive
forward."""
import pytest
import torch
import torch.nn.functional as F

from rollout import Engine
from sparsity import (alpha_exact, alpha_k, alpha_sample, alpha_topk, bin_stats, dense_alpha, dense_logprobs,
                      fixed_budget)


def logp(*probs):
    return torch.tensor(probs).log()


def test_alpha_identical_is_one_and_disjoint_is_zero():
    p, q = logp(0.5, 0.3, 0.2, 0.0), logp(0.0, 0.0, 0.0, 1.0)
    assert alpha_exact(p, p).item() == pytest.approx(1.0, abs=1e-6)
    assert alpha_exact(p, q).item() == 0.0
    ids = torch.tensor([0, 1, 2, 3])  # k = vocab: every token kept, in any order
    assert alpha_topk(p, ids, p).item() == pytest.approx(1.0, abs=1e-6)
    assert alpha_topk(p, ids, q).item() == 0.0
    # both sides as top-2 lists
    assert alpha_topk(p[[3, 0]], ids[[3, 0]], q[[1, 3]], ids[[1, 3]]).item() == 0.0


def test_alpha_exact_by_hand():
    p, q = logp(0.5, 0.3, 0.2), logp(0.2, 0.3, 0.5)
    assert alpha_exact(p, q).item() == pytest.approx(0.2 + 0.3 + 0.2)  # = 1 - TV = 1 - 0.3
    # top-2 of p is {0, 1}: min(0.5, 0.2) + min(0.3, 0.3);
    # token 2 is dropped, so the bound is 0.2 lower
    assert alpha_topk(logp(0.5, 0.3), torch.tensor([0, 1]), q).item() == pytest.approx(0.5)
    # against q's top-2 {2, 1} only token 1 is kept by both
    assert alpha_topk(logp(0.5, 0.3), torch.tensor([0, 1]), logp(0.5, 0.3),
                      torch.tensor([2, 1])).item() == pytest.approx(0.3)


def test_topk_is_a_lower_bound_and_exact_at_full_vocab():
    g = torch.Generator().manual_seed(0)
    V = 50
    p = F.log_softmax(torch.randn(64, V, generator=g) * 2, -1)
    # a perturbed copy: alpha well inside (0, 1)
    q = F.log_softmax(p + torch.randn(64, V, generator=g), -1)
    exact = alpha_exact(p, q)
    assert ((exact > 0.2) & (exact < 0.99)).all()
    for k in (1, 5, 20):
        pv, pi = p.topk(k, -1)
        qv, qi = q.topk(k, -1)
        one, both = alpha_topk(pv, pi, q), alpha_topk(pv, pi, qv, qi)
        assert (one <= exact + 1e-6).all() and (both <= one + 1e-6).all()
    pv, pi = p.topk(V, -1)
    qv, qi = q.topk(V, -1)
    assert torch.allclose(alpha_topk(pv, pi, q), exact, atol=1e-5)
    assert torch.allclose(alpha_topk(pv, pi, qv, qi), exact, atol=1e-5)
    with pytest.raises(ValueError, match="alpha_exact"):
        alpha_exact(p, q[:, :10])


def test_alpha_sample():
    dense, sparse = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.0, -1.0, -3.0]])
    a = alpha_sample(dense, sparse)
    assert torch.allclose(a, torch.tensor([[1.0, torch.e ** -1, 1.0]]))
    # its expectation under sampling from the sparse side is alpha_exact:
    # sum_v q(v) min(1, p(v)/q(v))
    p, q = logp(0.5, 0.3, 0.2), logp(0.2, 0.3, 0.5)
    assert (q.exp() * alpha_sample(p, q)).sum().item() == pytest.approx(alpha_exact(p, q).item())


def test_bin_stats_by_hand():
    alpha = torch.tensor([[1.0, 0.9, 0.8, 0.7], [0.6, 0.5, 0.4, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    st = bin_stats(alpha, mask, torch.tensor([2, 0]), bin_size=2)  # cached lengths 2..5 and 0..3
    assert st["count"].tolist() == [2, 3, 2]  # bin 0: 0.6 0.5; bin 1: 1.0 0.9 0.4; bin 2: 0.8 0.7
    assert torch.allclose(st["mean"], torch.tensor([0.55, 2.3 / 3, 0.75]))
    # linear interpolation at 0.05
    assert torch.allclose(st["p5"], torch.tensor([0.505, 0.45, 0.705]))
    pos = torch.tensor([[2, 3, 4, 5], [0, 1, 2, 3]])  # the same lengths, given per token
    st2 = bin_stats(alpha, mask, pos, bin_size=2, n_bins=4)
    assert (st2["count"].tolist() == [2, 3, 2, 0] and torch.isnan(st2["p5"][3])
            and torch.isnan(st2["mean"][3]))
    st3 = bin_stats(alpha, mask, pos, bin_size=2, n_bins=2)  # beyond the last bin: into it
    assert st3["count"].tolist() == [2, 5]
    with pytest.raises(ValueError, match="positions"):
        bin_stats(alpha, mask, torch.tensor([1, 2, 3]), bin_size=2)


# --------------------------------------------------------------------- the engine's top-k log-probs


from test_rollout import CharTok, tiny_model  # noqa: E402  (the same tiny model and tokenizer stub)


PROMPTS = [[3, 4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_engine_topk_matches_the_naive_forward(temperature):
    m = tiny_model()
    ro = (Engine(m, CharTok(), max_new_tokens=8, temperature=temperature, topk_logprobs=5)
          .generate(PROMPTS, 2, seed=1))
    assert ro.topk_logp.shape == (4, ro.tokens.shape[1], 5) == ro.topk_ids.shape
    t = temperature or 1.0  # greedy: reported at temperature 1, like ro.logp
    with torch.no_grad():
        for i in range(len(ro)):
            n, p = int(ro.mask[i].sum()), PROMPTS[i // 2]
            logits = m(torch.tensor([p + ro.tokens[i, :n].tolist()]))[0, len(p) - 1:len(p) + n - 1]
            ref = F.log_softmax(logits / t, -1).topk(5, -1)
            assert torch.allclose(ro.topk_logp[i, :n], ref.values, atol=1e-5)
            assert torch.equal(ro.topk_ids[i, :n], ref.indices)
            assert (ro.topk_logp[i, n:] == float("-inf")).all()  # padding holds no mass


def test_engine_full_vocab_topk_gives_exact_alpha_and_k0_keeps_nothing():
    m, tok = tiny_model(), CharTok()
    assert Engine(m, tok, max_new_tokens=4).generate(PROMPTS).topk_logp is None
    with pytest.raises(ValueError, match="topk_logprobs"):
        Engine(m, tok, topk_logprobs=31)
    kw = dict(max_new_tokens=12, temperature=1.0, page_size=2, topk_logprobs=30)
    dense = Engine(m, tok, **kw).generate(PROMPTS, 2, seed=3)
    sparse = (Engine(m, tok, sparse=fixed_budget(1), dense_layers=0, keep_recent=1, **kw)
              .generate(PROMPTS, 2, seed=3))
    mask = sparse.mask
    assert torch.allclose(sparse.topk_logp.exp().sum(-1)[mask], torch.ones(int(mask.sum())),
                          atol=1e-5)
    # the dense side of the same sampled prefixes, from a
    # plain forward: it agrees with a dense engine's ro.logp
    assert torch.allclose(dense_logprobs(m, PROMPTS, dense)[dense.mask], dense.logp[dense.mask],
                          atol=1e-5)
    a = alpha_sample(dense_logprobs(m, PROMPTS, sparse), sparse.logp)[mask]
    # sparse decode did change something
    assert (a <= 1).all() and (a > 0).all() and (a < 1 - 1e-4).any()
    # with k = vocab the kept lists are the whole sparse distribution: alpha_topk is alpha_exact
    with torch.no_grad():
        for i in range(len(sparse)):
            n, p = int(mask[i].sum()), PROMPTS[i // 2]
            dense_full = F.log_softmax(
                m(torch.tensor([p + sparse.tokens[i, :n].tolist()]))[0, len(p) - 1:-1], -1)
            sparse_full = torch.empty_like(dense_full).scatter(-1, sparse.topk_ids[i, :n],
                                                               sparse.topk_logp[i, :n])
            exact = alpha_exact(sparse_full, dense_full)
            assert torch.allclose(
                alpha_topk(sparse.topk_logp[i, :n], sparse.topk_ids[i, :n], dense_full), exact,
                atol=1e-5)
            # token 0 comes from the dense prefill: 1
            assert (exact <= 1).all() and (exact > 0.5).all()


# --------------------------------------------------------------------- Sparrow's per-position alpha


def sparse_rollout(topk, seed=3):
    m, tok = tiny_model(), CharTok()
    kw = dict(max_new_tokens=12, temperature=1.0, page_size=2, topk_logprobs=topk)
    ro = (Engine(m, tok, sparse=fixed_budget(1), dense_layers=0, keep_recent=1, **kw)
          .generate(PROMPTS, 2, seed=seed))
    return m, ro


def test_dense_alpha_is_one_minus_tv_by_hand():
    m, ro = sparse_rollout(topk=30)  # the whole vocabulary: exact
    got = dense_alpha(m, PROMPTS, ro, temperature=1.0, micro_batch=3)  # rows split across batches
    with torch.no_grad():
        for i in range(len(ro)):
            n, p = int(ro.mask[i].sum()), PROMPTS[i // 2]
            for t in range(n):  # one position at a time: the dense forward of the prefix alone
                pd = F.softmax(m(torch.tensor([p + ro.tokens[i, :t].tolist()]))[0, -1], -1)
                ps = torch.zeros(30).scatter(0, ro.topk_ids[i, t], ro.topk_logp[i, t].exp())
                assert got[i, t].item() == pytest.approx(1 - 0.5 * (pd - ps).abs().sum().item(), abs=1e-5)
    assert (got[~ro.mask] == 0).all() and (got[ro.mask] < 1 - 1e-3).any()  # sparse changed something


def test_dense_alpha_from_top_k_is_a_lower_bound_equal_at_k_equal_v():
    m, exact = sparse_rollout(topk=30)
    a_exact = dense_alpha(m, PROMPTS, exact)
    for k in (1, 3, 10):
        _, ro = sparse_rollout(topk=k)  # the same seed: the same tokens
        assert torch.equal(ro.tokens, exact.tokens)
        a = dense_alpha(m, PROMPTS, ro)
        assert (a[ro.mask] <= a_exact[ro.mask] + 1e-6).all()
    assert (a[ro.mask] < a_exact[ro.mask] - 1e-4).any()  # top-10 of 30 misses some mass somewhere
    with pytest.raises(ValueError, match="topk_logprobs"):
        dense_alpha(m, PROMPTS, Engine(m, CharTok(), max_new_tokens=2).generate(PROMPTS))
    assert alpha_k(30) == 30 and alpha_k(151_936) == 20 and alpha_k(151_936, 5) == 5


def test_calibration_thresholds_the_per_position_alpha(monkeypatch):
    import calibrate
    m, tok, seen = tiny_model(), CharTok(), []
    real = calibrate.dense_alpha

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    monkeypatch.setattr(calibrate, "dense_alpha", spy)
    calibrate.calibrate_engine(m, tok, PROMPTS, [1, 2, 16], bin_pages=4, group_size=2, threshold=0.5,
                               max_new_tokens=12, page_size=2, dense_layers=0, keep_recent=1)
    assert seen  # every candidate's p5 came from Sparrow's statistic
