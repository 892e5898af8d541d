"""Lossless sparse rollout (rollout.Engine(speculative=k)): the sparse policy drafts, the dense
policy verifies, and speculative rejection sampling makes every token an exact sample of the dense
policy. Exactness against the enumerated dense distribution, greedy and full-budget equality with
dense decoding, the cache after rejections against a fresh prefill, the behaviour log-probs against
the trainer's, and the stopping rules."""
import math

import pytest
import torch

from kvcache import PagedKVCache
from model import ModelConfig, Transformer
from rollout import Engine
from speculative import best_k, top_p_probs
from sparsity import dense_budget, dense_logprobs, fixed_budget, fraction_budget, page_metadata
from zeros_kernels.layer_cpu import fused_refusals


class Ids:  # token ids only: pad 0, no EOS (eos_ids=[-1] keeps every row to max_new_tokens)
    pad_token_id, eos_token_id = 0, None

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["" for _ in rows]


class CharTok(Ids):  # for stop strings: id i >= 2 decodes to letter i - 2
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(ord("a") + t - 2) for t in r if t >= 2) for r in rows]


def tiny_model(V=8, scale=5.0, seed=0, head_dim=8):
    """A random 2-layer model with GQA, its weights scaled up so that attention is peaked and a
    sparse draft (one page) parts from dense: the draft's acceptance is about 0.7."""
    torch.manual_seed(seed)
    m = Transformer(ModelConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                intermediate_size=64, max_position_embeddings=256)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.mul_(scale)
    return m


PROMPT = [(i * 5 + 3) % 8 for i in range(21)]  # 5 full pages of 4 and one partial
# the draft reads one page a step (the partial last one), every layer sparse
ONE_PAGE = dict(sparse=fixed_budget(1), keep_first=0, keep_recent=0, dense_layers=0, page_size=4)


def exact_dense(model, prompt, n, temperature, top_p):
    """The dense policy's exact joint over the first n completion tokens: (V,) * n probabilities,
    every prefix enumerated (V ** (n - 1) sequences in one forward), each conditional top-p-
    truncated and renormalised as `sample` draws."""
    V = model.config.vocab_size
    prefixes = torch.cartesian_prod(*[torch.arange(V)] * (n - 1)).view(-1, n - 1)
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    with torch.no_grad():
        logits = model(ids)[:, len(prompt) - 1:]  # (V^(n-1), n, V)
    p = top_p_probs(torch.softmax(logits.double() / temperature, -1), top_p)
    p = (p / p.sum(-1, keepdim=True)).view(*[V] * (n - 1), n, V)
    joint = torch.ones(())
    for t in range(n):  # P(x_<=t) = P(x_<t) p(x_t | x_<t): p at t depends on prefix tokens < t
        cond = p[(slice(None),) * t + (0,) * (n - 1 - t) + (t,)]  # (V,) * t + (V,)
        joint = joint[..., None] * cond
    return joint


def chi2_critical(dof, z=3.719):
    """The chi-square quantile at the normal quantile z (3.719: p = 1e-4), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts, probs):
    """Pearson's statistic over the cells with expected count >= 5 (the rest pooled) and its
    degrees of freedom."""
    n = counts.sum()
    big = probs * n >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([probs[big], probs[~big].sum()[None]]).double() * n
    keep = exp > 0
    return float(((obs - exp)[keep] ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_speculative_samples_are_exact_dense_samples(temperature, top_p):
    """4,000 rows (two seeds) of a one-page draft with k = 3 against the dense policy's exact
    distribution: each position's marginal (1 to 3) and the joint of positions 1 and 2 pass a
    chi-square test at p = 1e-4. Resampling from p instead of the residual fails it (by hand)."""
    m, V, n = tiny_model(), 8, 4
    eng = Engine(m, Ids(), max_new_tokens=n, temperature=temperature, top_p=top_p, eos_ids=[-1],
                 speculative=3, **ONE_PAGE)
    ros = [eng.generate([PROMPT], 2000, seed=s) for s in (0, 1)]
    assert all(ro.timings["acceptance"] < 0.9 for ro in ros)  # the draft does part from dense
    toks = torch.cat([ro.tokens for ro in ros])  # (4000, n)
    joint = exact_dense(m, PROMPT, n, temperature, top_p)  # (V, V, V, V)
    for pos in (1, 2, 3):
        marg = joint.sum(dim=[d for d in range(n) if d != pos])
        stat, dof = chi2(torch.bincount(toks[:, pos], minlength=V), marg)
        assert stat < chi2_critical(dof), f"position {pos}: chi2 {stat:.1f} on {dof} dof"
    pair = joint.sum(dim=(0, 3)).view(-1)
    stat, dof = chi2(torch.bincount(toks[:, 1] * V + toks[:, 2], minlength=V * V), pair)
    assert stat < chi2_critical(dof), f"positions 1, 2: chi2 {stat:.1f} on {dof} dof"


def test_full_budget_accepts_everything_and_equals_dense_decoding():
    """At full budget the draft is the dense policy: every draft is accepted, and since the
    drafts and the bonus token draw from the main generator as dense decoding's steps do, the
    tokens are dense decoding's under the same seed (and their log-probs within float error)."""
    m = tiny_model()
    prompts = [PROMPT, PROMPT[:9], PROMPT[3:]]
    kw = dict(max_new_tokens=13, temperature=1.0, page_size=4, eos_ids=[-1])
    dense = Engine(m, Ids(), **kw).generate(prompts, 3, seed=7)
    spec = Engine(m, Ids(), sparse=dense_budget, dense_layers=0, speculative=4,
                  **kw).generate(prompts, 3, seed=7)
    t = spec.timings
    assert t["acceptance"] == 1.0 and t["accepted"] == t["drafted"] > 0
    assert sum(t["pages_read_layer"]) == t["pages_read"]  # counted in the cache: the same
    assert torch.equal(spec.tokens, dense.tokens)
    assert torch.allclose(spec.logp, dense.logp, atol=1e-5, rtol=0)
    # 12 tokens after the first: rounds of 5, the last one cut at max_new_tokens
    assert t["verify_calls"] == 3 and t["tokens_per_verify"] == pytest.approx(12 / 3)


@pytest.mark.parametrize("num_pages", [None, 200])  # lanes, and the free list
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_an_aggressive_budget_equals_dense_greedy(k, num_pages):
    """Temperature 0 with a one-page draft: a draft is kept iff it is the dense argmax, so the
    tokens are dense greedy's token for token, in rows of different lengths that share prompts."""
    m = tiny_model()
    prompts = [PROMPT, PROMPT[:8], PROMPT[5:]]  # 8 tokens: two shared pages of 4
    kw = dict(max_new_tokens=17, temperature=0.0, eos_ids=[-1], num_pages=num_pages)
    dense = Engine(m, Ids(), page_size=4, **kw).generate(prompts, 2)
    spec = Engine(m, Ids(), speculative=k, **ONE_PAGE, **kw).generate(prompts, 2)
    assert spec.timings["acceptance"] < 1.0  # some drafts were rejected
    assert torch.equal(spec.tokens, dense.tokens) and torch.equal(spec.mask, dense.mask)
    assert torch.allclose(spec.logp, dense.logp, atol=1e-5, rtol=0)
    assert spec.timings["pages_free_end"] == spec.timings["pages_total"]  # every page came back


def row_kv(cache, r, n):
    """K and V (L, H_kv, n, D) of the first n positions of cache row r, through its page table."""
    ps = cache.page_size
    slots = torch.tensor([cache.pages[r][t // ps] * ps + t % ps for t in range(n)])
    return cache.k[:, :, slots], cache.v[:, :, slots]


@pytest.mark.parametrize("num_pages", [None, 300])
def test_cache_after_rejections_equals_a_fresh_prefill(monkeypatch, num_pages):
    """Each row's cache when it finishes (after rounds with rejections, truncations and refills)
    holds the K and V of a fresh dense prefill of its prompt and tokens, and every full page's mean
    key is the dense one: nothing of the draft is left."""
    m, seen = tiny_model(), []
    release = PagedKVCache.release

    def spy(self, seq):  # what the row holds when it gives its pages back
        if self.pages[seq]:
            n = self.lens[seq]
            meta = self.kmean[:, self.pages[seq][:n // self.page_size]].clone()
            seen.append((self, seq, n, *row_kv(self, seq, n), meta))
        release(self, seq)

    monkeypatch.setattr(PagedKVCache, "release", spy)
    prompts = [PROMPT, PROMPT[:8]]
    eng = Engine(m, Ids(), max_new_tokens=15, temperature=1.0, eos_ids=[-1], speculative=4,
                 num_pages=num_pages, **ONE_PAGE)
    ro = eng.generate(prompts, 2, seed=3)
    assert 0 < ro.timings["acceptance"] < 1.0
    assert len(seen) == len(ro)
    for cache, r, n, k, v, meta in seen:
        prompt, toks = prompts[r // 2], ro.tokens[r].tolist()
        # the row's last round ran the verify past its end: positions beyond its tokens are junk
        ids = prompt + toks[:-1]
        assert n >= len(ids)
        fresh = PagedKVCache(m.config, 1, 16, 16, 4, torch.float32, "cpu")
        fresh.begin_prefill([(len(ids), [0])])
        with torch.no_grad():
            m(torch.tensor([ids]), cache=fresh)
        k0, v0 = row_kv(fresh, 0, len(ids))
        assert torch.allclose(k[:, :, :len(ids)], k0, atol=1e-4), f"row {r}: K"
        assert torch.allclose(v[:, :, :len(ids)], v0, atol=1e-4), f"row {r}: V"
        full = len(ids) // 4  # pages that hold only this row's tokens
        # (L, P, 4, H, D)
        pages = k0[:, :, :full * 4].unflatten(2, (full, 4)).permute(0, 2, 3, 1, 4)
        mean, _, _ = page_metadata(pages.flatten(0, 1), False)  # (L * P, H, D)
        assert torch.allclose(meta[:, :full].flatten(0, 1), mean, atol=1e-4), f"row {r}: meta"


def verify_cache(m, prompts, steps, verify_ref):
    """A lanes cache of the prompts x 2 rows (pages of 4) after the prefill and `steps` decode
    steps, row 1 released after the first (the last row moves into its lane) -> (cache, live
    rows)."""
    N = 2 * len(prompts)
    eng = Engine(m, Ids(), max_new_tokens=20, eos_ids=[-1], page_size=4, speculative=7)
    groups = eng.groups(prompts, 2)
    cache, live = eng._new_cache(groups, N), list(range(N))
    cache.verify_ref = verify_ref
    with torch.no_grad():
        eng._prefill(cache, groups, N)
        for step in range(steps):
            if step == 1:
                cache.release(1)
                live = [r for r in live if r != 1]
            cache.begin_decode(live)
            m(torch.tensor([[(3 * r + step) % 8] for r in live]), cache=cache)
    return cache, live


@pytest.mark.parametrize("prompts", [
    [PROMPT, PROMPT[:8], PROMPT[:3]],  # 5 shared pages and a partial own; 2 and none; no shared
    [PROMPT[:8], PROMPT[4:20]]])  # 2 and 4 shared pages: at step 0 no row owns a token
@pytest.mark.parametrize("steps", [0, 1, 3])
@pytest.mark.parametrize("T,D", [(1, 8), (4, 8), (7, 8), (4, 32), (7, 32)])  # D = 32: C++ kernel
def test_verify_on_the_lanes_equals_the_gather_reference(T, D, steps, prompts):
    """The verify's attention on a CPU's lanes (the cache before the new tokens read in place, its
    T queries as G * T of a decode step, merged by log-sum-exp with the causal T x T part) equals
    the reference (each row's cache gathered, SDPA with a mask): rows with and without a shared
    prompt, with no own token yet (some rows, or all), and moved between lanes; and it writes the
    same pool."""
    m = tiny_model(head_dim=D)
    (fast, live), (ref, _) = (verify_cache(m, prompts, steps, r) for r in (False, True))
    g = torch.Generator().manual_seed(T + steps)
    q, k, v = (torch.randn(len(live), H, T, D, generator=g) for H in (4, 2, 2))
    for layer in (0, 1):
        fast.begin_verify(live, T), ref.begin_verify(live, T)
        y, y_ref = (c.attend(layer, q * (layer + 1), k, v) for c in (fast, ref))
        assert fast._slots is None and ref._slots is not None  # the two paths ran
        assert torch.allclose(y, y_ref, atol=1e-5, rtol=0), (y - y_ref).abs().max()
        for c in (fast, ref):
            c.advance(T)
    assert torch.equal(fast.k, ref.k) and torch.equal(fast.v, ref.v)


def test_behaviour_logprobs_are_the_trainers_dense_logprobs():
    """ro.logp of a sparse-drafted speculative rollout equals sparsity.dense_logprobs (a plain
    full forward, what the trainer recomputes) on the same weights, at temperature and top-p; and
    its top-k is the dense distribution's, so its alpha against dense is 1."""
    m = tiny_model()
    prompts = [PROMPT, PROMPT[:7], PROMPT[2:15]]
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.8), (0.0, 1.0)):
        ro = Engine(m, Ids(), max_new_tokens=12, temperature=temperature, top_p=top_p,
                    eos_ids=[-1], speculative=3, topk_logprobs=8,
                    **ONE_PAGE).generate(prompts, 2, seed=1)
        ref = dense_logprobs(m, prompts, ro, temperature)
        assert torch.allclose(ro.logp, ref, atol=1e-5, rtol=0)
        # the whole vocabulary kept (k = V): it holds every sampled token's log-prob
        at = (ro.topk_ids == ro.tokens[..., None]).float().argmax(-1, keepdim=True)
        got = ro.topk_logp.gather(-1, at)[..., 0]
        assert torch.allclose(got[ro.mask], ref[ro.mask], atol=1e-5, rtol=0)
        assert torch.equal(ro.budget, ro.budget_dense)


def test_rows_end_as_in_dense_decoding():
    """EOS inside an accepted block ends the row there (the block's later tokens are dropped), a
    stop string likewise, and max_new_tokens cuts the last block; the finish reasons and lengths
    are dense greedy's."""
    m, tok = tiny_model(), CharTok()
    prompts = [PROMPT, PROMPT[:8], PROMPT[5:]]
    kw = dict(max_new_tokens=14, temperature=0.0)
    greedy = Engine(m, tok, eos_ids=[-1], page_size=4, **kw).generate(prompts, 1)
    eos = greedy.tokens[1, 5].item()  # a token that row 1 samples at position 5
    stop = greedy.texts[0][2:4]  # two letters row 0 produces at positions 2 and 3
    for extra in (dict(eos_ids=[eos]), dict(eos_ids=[-1], stop=[stop]),
                  dict(eos_ids=[eos], stop=[stop])):
        dense = Engine(m, tok, page_size=4, **kw, **extra).generate(prompts, 2)
        for k in (2, 5):
            spec = Engine(m, tok, speculative=k, **ONE_PAGE, **kw, **extra).generate(prompts, 2)
            assert spec.finish == dense.finish and spec.texts == dense.texts, (extra, k)
            assert torch.equal(spec.tokens, dense.tokens) and torch.equal(spec.mask, dense.mask)
    assert "eos" in dense.finish and "stop" in dense.finish and "length" in dense.finish


def test_speculative_keyword_is_checked():
    m = tiny_model()
    with pytest.raises(ValueError, match="speculative"):
        Engine(m, Ids(), eos_ids=[-1], speculative=-1)
    with pytest.raises(ValueError, match="needs speculative"):
        Engine(m, Ids(), eos_ids=[-1], draft=tiny_model(seed=1))
    with pytest.raises(ValueError, match="must match"):
        Engine(m, Ids(), eos_ids=[-1], speculative=2, draft=tiny_model(V=9))


def test_another_draft_model_keeps_the_samples_exact():
    """A draft of other weights (draft=: what DistillSparse's adapter copy is) drafts; the samples
    stay exact samples of `model` (chi-square as above, 2,000 rows, positions 1 to 3), and its
    acceptance is its own, lower than the model's own sparse draft's."""
    m, V, n = tiny_model(), 8, 4
    kw = dict(max_new_tokens=n, temperature=1.0, eos_ids=[-1], speculative=3, **ONE_PAGE)
    other = Engine(m, Ids(), draft=tiny_model(seed=1), **kw).generate([PROMPT], 2000, seed=0)
    own = Engine(m, Ids(), **kw).generate([PROMPT], 2000, seed=0)
    assert other.timings["acceptance"] < own.timings["acceptance"] - 0.05
    joint = exact_dense(m, PROMPT, n, 1.0, 1.0)
    for pos in (1, 2, 3):
        marg = joint.sum(dim=[d for d in range(n) if d != pos])
        stat, dof = chi2(torch.bincount(other.tokens[:, pos], minlength=V), marg)
        assert stat < chi2_critical(dof), f"position {pos}: chi2 {stat:.1f} on {dof} dof"


def test_bench_specdecode_quick_runs():
    """`python -m bench specdecode --quick` (a few seconds): the measured table, one row per arm,
    dense and dense with the eager step (fewer ops a step with the default's fused one, on a CPU
    where it runs), and the cost model's Qwen3-1.7B prediction beside the lossy path's."""
    from bench import specdecode
    lines = specdecode.run(True, "python -m bench specdecode --quick")
    rows = [x for x in lines if x.startswith("| 512 |")]
    assert len(rows) == 4 and "| dense |" in rows[0] and "| dense, eager step |" in rows[1]
    ops = [float(r.split("|")[-3]) for r in rows[:2]]  # the ops / step column
    assert ops[0] < ops[1] or fused_refusals(tiny_model())  # (no C++ kernel: both eager)
    qwen = [x for x in lines if x.startswith("| Qwen3-1.7B")]
    assert len(qwen) == 2 and all(x.count("x |") == 2 for x in qwen)


def test_best_k_maximises_tokens_a_second():
    """(1 - a^(k+1)) / (1 - a) tokens in k d + v seconds: at a = 0.8, d = 1, v = 4 the rates of
    k = 1..5 are 0.360, 0.407, 0.422, 0.420, 0.410 (by hand): k = 3. A dearer draft or a lower
    acceptance never asks for more drafts; a draft that is always right and free asks for all."""
    assert best_k(0.8, 1.0, 4.0, 8) == 3
    assert best_k(0.8, 1.0, 4.0, 2) == 2
    assert best_k(0.5, 1.0, 4.0, 8) <= 3 and best_k(0.8, 3.0, 4.0, 8) <= 3
    assert best_k(1.0, 1e-3, 1.0, 16) == 16


def test_adapt_k_moves_k_to_what_the_last_call_measured():
    """Engine(adapt_k=K): after a call, k is best_k of that call's per-draft acceptance and costs.
    A one-page draft that parts from dense (per-draft acceptance about 0.6) on 4 prompt rows
    brings k = 8 down; a full-budget draft (every draft accepted) takes it to K."""
    m = tiny_model()
    kw = dict(max_new_tokens=24, temperature=1.0, eos_ids=[-1])
    eng = Engine(m, Ids(), speculative=8, adapt_k=12, **kw, **ONE_PAGE)
    ro = eng.generate([PROMPT], 4, seed=0)
    t = ro.timings
    assert t["k"] == 8 and 0.3 < t["accept_geom"] < 0.9
    want = best_k(t["accept_geom"], t["draft_s"] / (8 * t["verify_calls"]),
                  t["verify_s"] / t["verify_calls"], 12)
    assert eng.speculative == want < 8
    assert eng.generate([PROMPT], 4, seed=0).timings["k"] == want
    full = Engine(m, Ids(), speculative=2, adapt_k=12, sparse=dense_budget, page_size=4, **kw)
    full.generate([PROMPT], 4, seed=0)
    assert full.speculative == 12
    with pytest.raises(ValueError, match="adapt_k"):
        Engine(m, Ids(), adapt_k=4, **kw)
