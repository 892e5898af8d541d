"""The engine against the naive full-recompute loop, its sampling and stopping rules, the paged cache
(prefix sharing, freeing), and sparse decode (full budget equals dense, small budgets stay finite)."""
import pytest
import torch

import kvcache
import rollout
from model import ModelConfig, Transformer
from rollout import Engine, generate_naive, sample
from sparsity import dense_budget, fixed_budget, fraction_budget


class CharTok:  # the smallest tokenizer the engine needs: ids 0 pad, 1 eos, then characters
    pad_token_id, eos_token_id = 0, 1
    chars = "abcdefghij =#>?+,\n0123456789"

    def encode(self, s):
        return [self.chars.index(c) + 2 for c in s]

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(self.chars[t - 2] for t in r if t >= 2) for r in rows]


def tiny_model(seed=0, moe=False):
    torch.manual_seed(seed)
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) if moe else {}
    return Transformer(ModelConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, intermediate_size=64, **extra)).eval()


PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.mark.parametrize("moe", [False, True])
def test_greedy_matches_naive_loop(moe):
    m, tok = tiny_model(moe=moe), CharTok()
    eng = Engine(m, tok, max_new_tokens=12, temperature=0.0)
    ro = eng.generate(PROMPTS, group_size=2)
    ref_tok, ref_lp = generate_naive(m, tok, PROMPTS, group_size=2, max_new_tokens=12, temperature=0.0)
    for i in range(len(ro)):
        n = int(ro.mask[i].sum())
        assert ro.tokens[i, :n].tolist() == ref_tok[i]
        assert torch.allclose(ro.logp[i, :n], torch.tensor(ref_lp[i]), atol=1e-5, rtol=0)


def test_sampling_matches_naive_and_is_seeded():
    m, tok = tiny_model(), CharTok()
    eng = Engine(m, tok, max_new_tokens=10, temperature=1.0)
    a, b, c = eng.generate(PROMPTS, 3, seed=5), eng.generate(PROMPTS, 3, seed=5), eng.generate(PROMPTS, 3, seed=6)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logp, b.logp)
    assert not torch.equal(a.tokens, c.tokens)
    ref_tok, ref_lp = generate_naive(m, tok, PROMPTS, 3, seed=5, max_new_tokens=10, temperature=1.0)
    for i in range(len(a)):
        n = int(a.mask[i].sum())
        assert a.tokens[i, :n].tolist() == ref_tok[i]
        assert torch.allclose(a.logp[i, :n], torch.tensor(ref_lp[i]), atol=1e-5, rtol=0)


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits, 1.0, 0.7, gen)[0].item() for _ in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.7: tokens 2 and 3 are never drawn


def test_eos_stop_and_length():
    m, tok = tiny_model(), CharTok()
    greedy = Engine(m, tok, max_new_tokens=6, temperature=0.0).generate(PROMPTS, 1)
    # declare row 1's first greedy token an end-of-sequence token: row 1 must stop there, the others run on
    eos = greedy.tokens[1, 0].item()
    ro = Engine(m, tok, max_new_tokens=6, temperature=0.0, eos_ids=[eos]).generate(PROMPTS, 1)
    assert ro.finish[1] == "eos" and int(ro.mask[1].sum()) == 1
    for i in range(len(ro)):
        n = int(ro.mask[i].sum())
        assert (ro.finish[i] == "eos") == (ro.tokens[i, n - 1].item() == eos)
        assert ro.finish[i] != "length" or n == 6
        assert not ro.mask[i, n:].any()
    first = greedy.texts[0][:2]
    assert len(first) == 2
    ro2 = Engine(m, tok, max_new_tokens=6, temperature=0.0, stop=[first]).generate(PROMPTS[:1], 1)
    assert ro2.finish[0] == "stop" and ro2.texts[0] == first


def test_prompt_too_long_is_named():
    m, tok = tiny_model(), CharTok()
    eng = Engine(m, tok, max_new_tokens=m.config.max_position_embeddings)
    with pytest.raises(ValueError, match="prompt 0 has 5 tokens"):
        eng.generate(PROMPTS)


# ----------------------------------------------------------------------------- paged cache, sharing, sparse decode

RAGGED = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]  # 1 page + partial, < 1 page, exactly 2 pages


def capture_caches(monkeypatch):
    """Keep every cache the engine builds, so a test can look at its page tables and free list afterwards."""
    caches, new_cache = [], Engine._new_cache

    def keep(self, *a):
        caches.append(new_cache(self, *a))
        return caches[-1]
    monkeypatch.setattr(Engine, "_new_cache", keep)
    return caches


def assert_same_generation(ro, ref_tok, ref_lp):
    for i in range(len(ro)):
        n = int(ro.mask[i].sum())
        assert ro.tokens[i, :n].tolist() == ref_tok[i], f"row {i}"
        assert torch.allclose(ro.logp[i, :n], torch.tensor(ref_lp[i]), atol=1e-5, rtol=0), f"row {i}"


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("scorer", ["centroid", "quest", "oracle"])
def test_sparse_at_full_budget_equals_dense_and_naive(moe, scorer):
    m, tok = tiny_model(moe=moe), CharTok()
    kw = dict(max_new_tokens=10, temperature=0.0, page_size=4)
    dense = Engine(m, tok, **kw).generate(RAGGED, group_size=2)
    sparse = Engine(m, tok, sparse=dense_budget, scorer=scorer, dense_layers=1, **kw).generate(RAGGED, group_size=2)
    assert_same_generation(sparse, [r[r.ne(-1)].tolist() for r in dense.tokens.masked_fill(~dense.mask, -1)],
                           [r[k].tolist() for r, k in zip(dense.logp, dense.mask)])
    ref_tok, ref_lp = generate_naive(m, tok, RAGGED, group_size=2, max_new_tokens=10, temperature=0.0)
    assert_same_generation(sparse, ref_tok, ref_lp)
    assert_same_generation(dense, ref_tok, ref_lp)
    assert torch.equal(sparse.budget, sparse.budget_dense)  # every page was selected
    assert sparse.timings["pages_read"] == sparse.timings["pages_dense"] > 0
    assert sparse.budget_dense.max() >= 4  # several pages per row, so the selection had pages to choose from


def test_prefix_is_prefilled_once_and_its_pages_are_shared(monkeypatch):
    m, tok, G, ps = tiny_model(), CharTok(), 3, 4
    prompts = RAGGED + [RAGGED[0]]  # a repeated prompt is still one distinct prompt
    calls = []
    h = m.register_forward_pre_hook(lambda mod, args: calls.append(tuple(args[0].shape)))
    caches = capture_caches(monkeypatch)
    ro = Engine(m, tok, max_new_tokens=6, temperature=0.0, page_size=ps).generate(prompts, group_size=G)
    h.remove()
    t, cache = ro.timings, caches[0]
    assert t["prefill_calls"] == 1 and calls[0] == (3, 8) and all(c[1] == 1 for c in calls[1:])  # 3 distinct prompts
    assert t["prefill_tokens"] == 5 + 2 + 8 and t["prefill_tokens_naive"] == G * (5 + 2 + 8 + 5)
    table = cache.table
    rows_a = [0, 1, 2, 9, 10, 11]  # prompt 0 and its repeat (prompt 3)
    assert len({table[r, 0].item() for r in rows_a}) == 1  # the full prompt page: one physical page
    assert len({table[r, 1].item() for r in rows_a}) == 6  # the partial page: copied per row
    assert len({tuple(table[r, :2].tolist()) for r in (6, 7, 8)}) == 1  # prompt 2 fills 2 pages: all shared
    assert len({table[r, 2].item() for r in (6, 7, 8)}) == 3  # its rows' first own pages
    assert len({table[r, 0].item() for r in (3, 4, 5)}) == 3  # prompt 1 is shorter than a page: nothing shared
    assert cache.used == 0 and cache.refs == [0] * cache.num_pages and t["pages_free_end"] == t["pages_total"]
    # sharing changes the work, not the result
    alone = Engine(m, tok, max_new_tokens=6, temperature=0.0, page_size=ps, share_prefix=False).generate(prompts, G)
    assert alone.timings["prefill_tokens"] == t["prefill_tokens_naive"]
    assert torch.equal(alone.tokens, ro.tokens) and torch.allclose(alone.logp, ro.logp, atol=1e-5, rtol=0)


def test_lanes_equal_the_free_list_and_the_naive_loop(monkeypatch):
    """The default pool (lanes: each row's own tokens read in place, a shared prompt's pages read
    once per group, rows moved into the lanes that finished rows leave) against a capped pool
    (free list, every token gathered) and the naive loop: sampling, with EOS tokens common enough
    that rows finish at different steps, over shared and unshared ragged prompts."""
    m, tok = tiny_model(seed=1), CharTok()
    prompts = RAGGED + [[3] * 9]
    kw = dict(max_new_tokens=12, temperature=1.0, page_size=4, eos_ids=[5, 6, 7])
    moved = []
    compact = rollout.PagedKVCache._compact
    monkeypatch.setattr(rollout.PagedKVCache, "_compact", lambda self, rows: (
        moved.append(sum(self.lane[r] >= len(rows) for r in rows)), compact(self, rows))[1])
    lanes = Engine(m, tok, **kw).generate(prompts, group_size=3, seed=4)
    assert sum(moved) > 0  # rows did move into freed lanes
    n = lanes.mask.sum(1)
    assert n.min() < n.max() == 12  # some rows stopped early, others ran to the end
    capped = Engine(m, tok, num_pages=10_000, **kw).generate(prompts, group_size=3, seed=4)
    assert torch.equal(capped.tokens, lanes.tokens)
    assert torch.allclose(capped.logp, lanes.logp, atol=1e-5, rtol=0)
    ref_tok, ref_lp = generate_naive(m, tok, prompts, 3, seed=4, max_new_tokens=12,
                                     temperature=1.0, eos_ids=[5, 6, 7])
    assert_same_generation(lanes, ref_tok, ref_lp)


def test_rows_move_into_freed_lanes_before_owning_a_page():
    """Rows that finish at their first token free lanes 0 and 1; the rows of a prompt of exactly
    two pages (shared, nothing of their own yet) move down and decode on as the naive loop does."""
    m, tok = tiny_model(seed=2), CharTok()
    prompts, kw = [RAGGED[0], RAGGED[2]], dict(max_new_tokens=6, temperature=0.0, page_size=4)
    first = Engine(m, tok, **kw).generate(prompts, 2).tokens[:, 0].tolist()
    assert first[0] != first[2]  # the seed gives the two prompts different first tokens
    ro = Engine(m, tok, eos_ids=[first[0]], **kw).generate(prompts, 2)
    assert ro.mask.sum(1).tolist()[:2] == [1, 1] and ro.mask[2:].all()
    ref_tok, ref_lp = generate_naive(m, tok, prompts, 2, max_new_tokens=6, temperature=0.0,
                                     eos_ids=[first[0]])
    assert_same_generation(ro, ref_tok, ref_lp)


def test_finished_rows_give_their_pages_back(monkeypatch):
    m, tok = tiny_model(), CharTok()
    first = Engine(m, tok, max_new_tokens=8, temperature=0.0, page_size=2).generate(RAGGED, 1)
    eos = int(first.tokens[1, 2])  # make row 1 stop at its third token
    caches = capture_caches(monkeypatch)
    events = []  # "decode" per round of decode steps, and the pages that each release gave back
    begin, release = rollout.PagedKVCache.begin_round, rollout.PagedKVCache.release
    monkeypatch.setattr(rollout.PagedKVCache, "begin_round", lambda self, *a: (events.append("decode"),
                                                                                begin(self, *a))[1])
    monkeypatch.setattr(rollout.PagedKVCache, "release", lambda self, seq: events.append(
        self.used - (release(self, seq), self.used)[1]))
    kw = dict(max_new_tokens=8, temperature=0.0, page_size=2, eos_ids=[eos], sync_every=2)  # rounds of 2 steps
    ro = Engine(m, tok, **kw).generate(RAGGED, 1)
    assert ro.finish[1] == "eos" and int(ro.mask[1].sum()) <= 3
    cache = caches[0]
    first_free = next(i for i, e in enumerate(events) if e != "decode")
    assert events[first_free] > 0 and "decode" in events[first_free:]  # freed mid-way, while others decode on
    assert cache.used == 0 and cache.refs == [0] * cache.num_pages
    # a pool too small for every row at full length still suffices when finished rows free their pages
    need = ro.timings["pages_peak"]
    ro2 = Engine(m, tok, num_pages=need, **kw).generate(RAGGED, 1)
    assert torch.equal(ro2.tokens, ro.tokens) and need < ro.timings["pages_total"]
    with pytest.raises(RuntimeError, match="out of pages"):
        Engine(m, tok, max_new_tokens=8, temperature=0.0, page_size=2, num_pages=need - 1).generate(RAGGED, 1)


def test_small_budget_changes_outputs_but_stays_finite(monkeypatch):
    m, tok = tiny_model(seed=3), CharTok()
    kw = dict(max_new_tokens=16, temperature=0.0, page_size=2, dense_layers=1)
    dense = Engine(m, tok, **kw).generate(RAGGED, 1)
    layers = []
    select = rollout.PagedKVCache._select
    monkeypatch.setattr(rollout.PagedKVCache, "_select", lambda self, layer, q: (layers.append(layer),
                                                                                  select(self, layer, q))[1])
    sparse = Engine(m, tok, sparse=fixed_budget(2), keep_recent=1, **kw).generate(RAGGED, 1)
    assert set(layers) == {1}  # layer 0 stays dense
    assert torch.isfinite(sparse.logp).all()
    n = int(torch.minimum(dense.mask.sum(1), sparse.mask.sum(1)).min())
    assert (sparse.logp[:, :n] - dense.logp[:, :n]).abs().max() > 1e-4
    late = sparse.mask & (sparse.budget_dense > 3)
    late[:, 0] = False  # the first token comes from the (dense) prefill
    assert (sparse.budget[late] == 2).all() and (sparse.budget <= sparse.budget_dense).all()
    assert sparse.timings["pages_read"] < sparse.timings["pages_dense"]
    # sparse sampling is seeded too
    eng = Engine(m, tok, sparse=fraction_budget(0.5), max_new_tokens=10, temperature=1.0, page_size=2)
    a, b = eng.generate(RAGGED, 2, seed=7), eng.generate(RAGGED, 2, seed=7)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logp, b.logp)


def test_engine_feeds_the_triton_kernel_what_it_expects(monkeypatch):
    """The same generation through the Triton kernel (its interpreter on a CPU): the index tensors the engine
    builds (narrowed page table, int32 selection, broadcast counts) meet the kernel's contract."""
    import functools
    import zeros_kernels.block_sparse_decode as bsd
    m, tok = tiny_model(), CharTok()
    kw = dict(max_new_tokens=4, temperature=0.0, page_size=4, sparse=fraction_budget(0.5), dense_layers=1)
    want = Engine(m, tok, **kw).generate(RAGGED, 2)
    monkeypatch.setattr(kvcache, "decode_attention", functools.partial(bsd.decode_attention, use_triton=True))
    got = Engine(m, tok, **kw).generate(RAGGED, 2)
    assert torch.equal(got.tokens, want.tokens) and torch.allclose(got.logp, want.logp, atol=1e-5, rtol=0)


def test_engine_options_are_checked():
    m, tok = tiny_model(), CharTok()
    with pytest.raises(ValueError, match="scorer must be"):
        Engine(m, tok, scorer="topk")
    with pytest.raises(TypeError, match="sparse must be False or a budget function"):
        Engine(m, tok, sparse=0.125)
    with pytest.raises(ValueError, match="page_size"):
        Engine(m, tok, page_size=0)


def test_bench_rewrites_only_its_readme_block(tmp_path):
    from bench.common import write_block
    f = tmp_path / "README.md"
    f.write_text("intro\n<!-- bench:rollout -->\nold\n<!-- /bench:rollout -->\noutro\n")
    assert write_block("rollout", "| new |", str(f))
    assert f.read_text() == "intro\n<!-- bench:rollout -->\n| new |\n<!-- /bench:rollout -->\noutro\n"
    g = tmp_path / "OTHER.md"
    g.write_text("no markers\n")
    assert not write_block("rollout", "| new |", str(g)) and g.read_text() == "no markers\n"
