"""KV-page selection: budgets, the two scorers on hand-made pages, the always-kept pages, and
full-budget selection through decode_attention against SDPA."""
import pytest
import torch
import torch.nn.functional as F

from zeros_kernels.block_sparse_decode import decode_attention
from sparsity import (centroid_scores, dense_budget, fixed_budget, fraction_budget, kept_count,
                      oracle_scores, page_metadata, pages_to_read, quest_scores, select_pages,
                      table_budget)


def test_budget_functions():
    assert fixed_budget(5)(100) == 5 and dense_budget(37) == 37
    assert (fraction_budget(1 / 8)(64) == 8 and fraction_budget(1 / 8)(65) == 9
            and fraction_budget(0.1, 4)(10) == 4)
    # Sparrow-style bins of 2,000 tokens of 16-token pages
    sched = table_budget([29, 61, 93], bin_pages=125)
    assert [sched(n) for n in (1, 124, 125, 300, 10_000)] == [29, 29, 61, 93, 93]
    with pytest.raises(ValueError, match="fraction in"):
        fraction_budget(0)
    with pytest.raises(ValueError, match="fixed_budget"):
        fixed_budget(0)


def test_budget_is_clamped_to_kept_and_cached_pages():
    assert kept_count(10, 10, 1, 2) == 3  # sink + 2 recent
    assert kept_count(10, 9, 1, 0) == 2  # the partial last page is kept even with keep_recent = 0
    assert kept_count(2, 1, 1, 2) == 2  # ranges overlap on a short sequence
    assert pages_to_read(fixed_budget(1), 10, 10, 1, 2) == 3  # below the kept count: the kept pages
    assert pages_to_read(fixed_budget(50), 10, 9, 1, 2) == 10  # above the cache: everything
    assert pages_to_read(fixed_budget(6), 10, 9, 1, 2) == 6


def test_centroid_picks_the_page_aligned_with_the_group_query():
    # 1 sequence, 2 KV heads, G = 2, D = 4, 5 pages;
    # head 0's queries point along e0, head 1's along e1
    q = torch.zeros(1, 4, 4)
    q[0, 0, 0], q[0, 1, 0] = 1.0, 3.0  # group 0: mean (2, 0, 0, 0)
    q[0, 2, 1], q[0, 3, 1] = 2.0, 0.0  # group 1: mean (0, 1, 0, 0)
    kmean = torch.zeros(1, 5, 2, 4)
    kmean[0, 3, 0, 0] = 1.0  # head 0: page 3 is aligned with e0
    kmean[0, 1, 1, 1] = 1.0  # head 1: page 1 is aligned with e1
    kmean[0, 2, 1, 1] = -1.0  # and page 2 opposes it
    s = centroid_scores(q, kmean)  # (1, 2, 5)
    assert s.shape == (1, 2, 5)
    assert s[0, 0].argmax() == 3 and s[0, 1].argmax() == 1 and s[0, 1].argmin() == 2
    assert torch.isclose(s[0, 0, 3], torch.tensor(2.0))


def test_quest_bound_uses_min_and_max_and_the_group_max():
    # a page with keys spanning [-1, 1] in dim 0 beats a page whose mean is higher but whose
    # spread is 0, for a query that is positive in dim 0: the bound is max(q * min, q * max)
    # summed over dims
    q = torch.zeros(1, 2, 2)  # 1 KV head, G = 2, D = 2
    q[0, 0] = torch.tensor([2.0, 0.0])
    q[0, 1] = torch.tensor([0.0, -3.0])
    kmin = torch.tensor([[[[-1.0, 0.0]], [[0.5, 0.0]], [[0.0, -1.0]]]])  # (1, P=3, 1, 2)
    kmax = torch.tensor([[[[1.0, 0.0]], [[0.5, 0.0]], [[0.0, 0.0]]]])
    s = quest_scores(q, kmin, kmax)[0, 0]  # (3,)
    # head 0: pages give 2, 1, 0; head 1 (q = -3 e1): pages give 0, 0, 3; the group keeps the max
    assert torch.allclose(s, torch.tensor([2.0, 1.0, 3.0]))
    # the bound really bounds: every key inside the box scores at most the bound
    keys = (kmin[0, :, 0][:, None]
            + torch.rand(3, 50, 2) * (kmax - kmin)[0, :, 0][:, None])  # (P, 50, D)
    for h in range(2):
        assert ((keys @ q[0, h]) <= s[:, None] + 1e-6).all()


def test_oracle_is_the_attention_mass_per_page_with_the_group_max():
    torch.manual_seed(0)
    B, H_kv, G, D, P, ps = 3, 2, 2, 8, 5, 4
    q, kp = torch.randn(B, H_kv * G, D), torch.randn(B, P, ps, H_kv, D)
    lens = torch.tensor([20, 9, 0])  # full, ending inside page 2, empty
    kp[1].view(-1, H_kv, D)[9:] = float("nan")  # past the end: never read into the result
    s = oracle_scores(q, kp, lens)
    ref = torch.zeros(B, H_kv, P)
    for b in range(B):
        n = int(lens[b])
        for h in range(H_kv):
            for g in range(G):
                if n == 0:
                    continue
                w = F.softmax(kp[b, :, :, h].reshape(P * ps, D)[:n] @ q[b, h * G + g] / D ** 0.5,
                              -1)
                mass = F.pad(w, (0, P * ps - n)).view(P, ps).sum(-1)
                ref[b, h] = torch.maximum(ref[b, h], mass)
    assert torch.allclose(s, ref, atol=1e-6)
    # pages past the end and an empty row get no mass
    assert (s[1, :, 3:] == 0).all() and (s[2] == 0).all()
    # the max over the group: at least one query head's full mass
    assert (s[:2].sum(-1) >= 1 - 1e-6).all()


def test_page_metadata():
    pages = torch.arange(2 * 4 * 1 * 3, dtype=torch.float32).view(2, 4, 1, 3)
    mean, lo, hi = page_metadata(pages, True)
    assert (torch.equal(mean, pages.mean(1)) and torch.equal(lo, pages[:, 0])
            and torch.equal(hi, pages[:, 3]))
    assert page_metadata(pages, False)[1] is None


def test_select_keeps_sink_recent_and_partial_pages_even_when_they_score_worst():
    gen = torch.Generator().manual_seed(0)
    B, H, P = 3, 2, 12
    scores = torch.rand(B, H, P, generator=gen)
    n_pages = torch.tensor([12, 7, 2])
    n_full = torch.tensor([11, 7, 1])  # row 0 and row 2 end in a partial page
    scores[:, :, 0] = -100.0  # the sink scores worst
    scores[0, :, 9:] = -100.0  # so do row 0's recent pages
    n_read = torch.tensor([pages_to_read(fixed_budget(5), int(n), int(f), 1, 2)
                           for n, f in zip(n_pages, n_full)])
    sel, n_sel = select_pages(scores, n_pages, n_full, n_read, keep_first=1, keep_recent=2)
    assert n_sel.tolist() == [[5, 5], [5, 5], [2, 2]]
    for b in range(B):
        for h in range(H):
            chosen = sel[b, h, :n_sel[b, h]].tolist()
            n = int(n_pages[b])
            assert chosen == sorted(chosen) and len(set(chosen)) == len(chosen) and max(chosen) < n
            # sink and the two recent pages (the partial one included)
            assert {0, n - 2, n - 1} <= set(chosen)
            others = [j for j in range(1, n - 2) if j not in chosen]
            best_left = max((scores[b, h, j].item() for j in others), default=-1e9)
            # the rest is the top
            assert all(scores[b, h, j] >= best_left for j in chosen if 0 < j < n - 2)


def test_full_budget_selection_through_decode_attention_equals_sdpa():
    """Pages in a shuffled pool, the full budget: the selection covers everything and attention is
    SDPA's."""
    gen = torch.Generator().manual_seed(1)
    ps, H_kv, G, D = 4, 2, 2, 8
    lens = [13, 3, 8]  # partial last page, shorter than a page, exactly two pages
    B, n_pages = len(lens), [-(-n // ps) for n in lens]
    P = max(n_pages)
    perm = torch.randperm(sum(n_pages), generator=gen).tolist()
    k = torch.randn(B, H_kv, 16, D, generator=gen)  # (B, H_kv, T, D) unpaged
    v = torch.randn(B, H_kv, 16, D, generator=gen)
    k_pool = torch.full((len(perm), ps, H_kv, D), float("nan"))  # NaN where nothing may be read
    v_pool = torch.full_like(k_pool, float("nan"))
    table = torch.zeros(B, P, dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(n_pages[b]):
            p = perm.pop()
            table[b, j] = p
            t1 = min((j + 1) * ps, n)
            k_pool[p, :t1 - j * ps] = k[b, :, j * ps:t1].transpose(0, 1)
            v_pool[p, :t1 - j * ps] = v[b, :, j * ps:t1].transpose(0, 1)
    q = torch.randn(B, H_kv * G, D, generator=gen)
    n_full = torch.tensor([n // ps for n in lens])
    n_pg = torch.tensor(n_pages)
    # any scores: at full budget they only order the pages
    kmean = torch.randn(B, P, H_kv, D, generator=gen)
    sel, n_sel = select_pages(centroid_scores(q, kmean), n_pg, n_full, n_pg, 1, 2)
    out = decode_attention(q, k_pool, v_pool, table, torch.tensor(lens, dtype=torch.int32), sel,
                           n_sel)
    mask = (torch.arange(16) < torch.tensor(lens)[:, None])[:, None, None, :]  # (B, 1, 1, T)
    want = F.scaled_dot_product_attention(q[:, :, None], k.repeat_interleave(G, 1),
                                          v.repeat_interleave(G, 1), attn_mask=mask)[:, :, 0]
    assert (out - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("scorer", ["centroid", "quest"])
def test_cpu_selection_equals_select_pages(scorer):
    """select_pages_cpu (the C++ kernel: scores read in place through the page tables) picks what
    select_pages picks from the gathered scores, at budgets from the kept pages to everything."""
    from zeros_kernels.sparse_decode_cpu import UNSCORED, cpu_kernel, select_pages_cpu
    if cpu_kernel() is None:
        pytest.skip("the C++ CPU kernel did not build here")
    gen = torch.Generator().manual_seed(2)
    B, H, G, D, ps, num_pages = 5, 2, 3, 16, 4, 90
    lens = [1, 6, 21, 40, 33]
    n_pages = torch.tensor([-(-n // ps) for n in lens])
    n_full = torch.tensor([n // ps for n in lens])
    table = torch.stack([torch.randperm(num_pages, generator=gen)[:10] for _ in lens]).int()
    q = torch.randn(B, H * G, D, generator=gen)
    meta = [torch.randn(num_pages, H, D, generator=gen) for _ in range(1 + (scorer == "quest"))]
    score = centroid_scores if scorer == "centroid" else quest_scores
    for fraction in (0.01, 0.3, 0.7, 1.0):
        n_read = torch.tensor([pages_to_read(fraction_budget(fraction), int(n), int(f), 1, 2)
                               for n, f in zip(n_pages, n_full)])
        want = select_pages(score(q, *(m[table.long()] for m in meta)), n_pages, n_full, n_read)
        got = select_pages_cpu(q, meta, table, n_pages, n_full, n_read)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        # rescoring: the same pick, and every full page's score kept (UNSCORED past them)
        kept = torch.zeros(B, H, 10)
        got = select_pages_cpu(q, meta, table, n_pages, n_full, n_read, scores=kept)
        assert torch.equal(got[0], want[0])
        full = torch.arange(10) < n_full[:, None, None]
        exact = score(q, *(m[table.long()] for m in meta)).masked_fill(~full, UNSCORED)
        real = torch.arange(10) < n_pages[:, None, None]  # past a row's pages: left as they were
        assert torch.allclose(kept[real.expand_as(kept)], exact[real.expand_as(kept)], rtol=1e-5,
                              atol=1e-5)  # summation order: the C++ dot differs by ~1 ulp
        # and a step that reuses them picks what select_pages picks from them, reading no meta
        later = select_pages_cpu(q, [torch.full_like(m, float("nan")) for m in meta], table,
                                 n_pages, n_full, n_read, scores=kept, rescore=False)
        assert torch.equal(later[0], select_pages(kept, n_pages, n_full, n_read)[0])


class Ids:  # the engine's tokenizer, for token ids only
    pad_token_id, eos_token_id = 0, None

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["" for _ in rows]


def _small_model():
    """A random 2-layer Qwen3-shaped model with GQA (4 query heads on 2 KV heads of 16)."""
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("every", [1, 3])
def test_engine_cpu_fast_path_equals_the_reference_path(monkeypatch, every):
    """A sparse engine on the CPU fast path (C++ selection and attention, or the gather path
    without a compiler) generates what it generates on the reference path (scores gathered per
    row, select_pages, block_sparse_decode_ref): the same tokens, log-probs within 1e-5."""
    import zeros_kernels.block_sparse_decode as bsd
    import kvcache
    import rollout
    m = _small_model()
    prompts = [[5, 9, 2, 7] * 9, [3] * 13, [11, 12, 13] * 7]
    kw = dict(max_new_tokens=12, temperature=0.0, page_size=4, dense_layers=0, eos_ids=[-1])
    for scorer in ("centroid", "quest"):
        eng = lambda: rollout.Engine(m, Ids(), sparse=fraction_budget(0.4), scorer=scorer,
                                     rescore_every=every, **kw)
        fast = eng().generate(prompts, group_size=2)
        with monkeypatch.context() as mp:
            mp.setattr(kvcache, "cpu_kernel", lambda: None)  # selection: gathered scores
            mp.setattr(kvcache, "decode_attention",  # attention: the reference
                       lambda *a, finite=False, **k: bsd.decode_attention(*a, **k))
            ref = eng().generate(prompts, group_size=2)
        assert ref.timings["pages_read"] < 0.7 * ref.timings["pages_dense"]  # truly sparse
        assert torch.equal(fast.tokens, ref.tokens) and torch.equal(fast.budget, ref.budget)
        assert torch.allclose(fast.logp, ref.logp, atol=1e-5, rtol=0)


def test_rescoring_every_k_steps_scores_at_steps_1_k_plus_1_and_reuses_between(monkeypatch):
    """kv_rescore_every: the page metadata is read at decode steps 1, k + 1, ... only; between, the
    selection reads the kept scores, and a page that filled since is read (UNSCORED) until the
    next scoring."""
    import kvcache
    import rollout
    from zeros_kernels.sparse_decode_cpu import UNSCORED
    m = _small_model()
    calls = []
    real = kvcache.select_pages_cpu

    def spy(*a, scores=None, rescore=True, **k):
        out = real(*a, scores=scores, rescore=rescore, **k)
        calls.append((rescore, scores.clone()))  # after the call: what a rescoring wrote
        return out

    monkeypatch.setattr(kvcache, "select_pages_cpu", spy)
    # a plain stride, so that the rescored steps are known here (the engine's hashed offsets, which
    # cannot alias with a task's rhythm, are tests/test_sparse_fidelity.py's)
    monkeypatch.setattr(kvcache, "rescores", lambda step, every: (step - 1) % every == 0)
    eng = rollout.Engine(m, Ids(), sparse=fraction_budget(0.3), rescore_every=4, max_new_tokens=9,
                         temperature=0.0, page_size=4, dense_layers=0, eos_ids=[-1],
                         record_pages=True)
    ro = eng.generate([[5, 9, 2, 7] * 9], group_size=2)
    if not calls:
        pytest.skip("the C++ CPU kernel did not build here")
    # layer 0 of each step (two sparse layers a step; a static decode step selects at every
    # step, decode.py). 36 prompt tokens in pages of 4: steps 1-4 write page 9, which fills at
    # step 4 (it stays read, UNSCORED), step 5 rescores, steps 6-8 read what step 5 scored
    flags = [r for r, _ in calls[::2]]
    assert flags == [True, False, False, False, True, False, False, False]
    assert all(torch.equal(calls[0][1], calls[2 * i][1]) for i in (1, 2, 3))  # what step 1 scored
    assert not torch.equal(calls[0][1], calls[8][1])  # step 5 scored afresh
    assert (calls[6][1][:, :, 9] == UNSCORED).all() and (calls[8][1][:, :, 9] < 1e30).all()
    assert all(torch.equal(calls[8][1], calls[2 * i][1]) for i in (5, 6, 7))
    # the clock counts decode steps, not rounds: rounds of 1 or 3 steps score at the same steps
    # and read the same pages
    for every in (1, 3):
        n = len(calls)
        eng.sync_every = every
        again = eng.generate([[5, 9, 2, 7] * 9], group_size=2)
        assert [r for r, _ in calls[n::2]] == flags
        assert torch.equal(again.read_pages, ro.read_pages) and torch.equal(again.tokens, ro.tokens)
    with pytest.raises(ValueError, match="rescore_every"):
        rollout.Engine(m, Ids(), rescore_every=0, eos_ids=[-1])
