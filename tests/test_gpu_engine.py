"""The rollout engine's memory on the one-GPU path, checked on the CPU: the KV pool's dtype follows
config key kv_dtype (bf16 decoding stays close to fp32, dense, sparse and speculative), the pool
is sized in tokens (kv_pool_tokens; rollout.pool_pages bounds a rollout batch), a call that does
not fit runs as calls that do and gives what one call gives, held-out evaluation is cut into calls
that fit, and one pool serves every call."""
import functools
from types import SimpleNamespace

import pytest
import torch

import heldout
import kvcache
import rollout
from config import Config, check
from kvcache import KVPool
from rollout import Engine, kv_dtype_for, lane_pages, pool_pages
from sparsity import fixed_budget, fraction_budget
from synthetic import Problem
from test_rollout import RAGGED, CharTok, capture_caches, tiny_model

# 30 prompts of 3 to 13 tokens
PROMPTS = [[3 + (7 * i + j) % 25 for j in range(3 + (5 * i) % 11)] for i in range(30)]


def pool_k(engine):  # the pool's K buffer
    return next(b for (name, _), b in engine.pool.bufs.items() if name == "k")


# ----------------------------------------------------------------------------- kv_dtype


def test_kv_dtype_key_is_checked_and_picks_the_pools_dtype(monkeypatch):
    assert Config().kv_dtype == "auto" and Config().kv_pool_tokens == 0
    check(Config(kv_dtype="bfloat16", kv_pool_tokens=4096))
    with pytest.raises(ValueError, match="kv_dtype"):
        check(Config(kv_dtype="float16"))
    with pytest.raises(ValueError, match="kv_pool_tokens"):
        check(Config(kv_pool_tokens=-1))
    with pytest.raises(ValueError, match="kv_dtype"):
        Engine(tiny_model(), CharTok(), kv_dtype="fp8")
    # auto: bf16 on a GPU, the weights' dtype elsewhere (a CPU run keeps fp32)
    gpu = SimpleNamespace(is_cuda=True, dtype=torch.float32)
    assert kv_dtype_for("auto", gpu) == torch.bfloat16
    assert kv_dtype_for("auto", torch.zeros(1)) == torch.float32
    assert kv_dtype_for("auto", torch.zeros(1, dtype=torch.bfloat16)) == torch.bfloat16
    assert kv_dtype_for("float32", gpu) == torch.float32
    m, tok = tiny_model(), CharTok()
    for key, want in (("auto", torch.float32), ("float32", torch.float32),
                      ("bfloat16", torch.bfloat16)):
        caches = capture_caches(monkeypatch)
        Engine(m, tok, max_new_tokens=4, sparse=fraction_budget(0.5), scorer="quest",
               kv_dtype=key).generate(RAGGED, 2)
        c = caches[-1]
        assert {c.k.dtype, c.v.dtype, c.kmean.dtype, c.kmin.dtype, c.kmax.dtype} == {want}, key


@pytest.mark.parametrize("mode", ["dense", "sparse", "quest", "speculative", "triton"])
def test_bf16_kv_decodes_within_a_tolerance_of_fp32(mode, monkeypatch):
    """The same tokens decoded over an fp32 pool and a bf16 one: the log-probs stay within bf16's
    rounding. Teacher-forced on the fp32 run's tokens, so a token that flips on a near tie does
    not end the comparison; the speculative mode samples greedily (it has no forced path)."""
    m, tok = tiny_model(seed=1), CharTok()
    kw = dict(max_new_tokens=12, temperature=0.0, page_size=4)
    if mode in ("sparse", "triton"):
        kw.update(sparse=fraction_budget(0.5), dense_layers=1)
    if mode == "quest":
        kw.update(sparse=fixed_budget(2), scorer="quest", dense_layers=1, rescore_every=2)
    if mode == "speculative":
        kw.update(sparse=fraction_budget(0.5), dense_layers=1, speculative=3)
    if mode == "triton":  # the GPU's kernel, through its interpreter: a bf16 cache, fp32 queries
        import zeros_kernels.block_sparse_decode as bsd
        monkeypatch.setattr(kvcache, "decode_attention",
                            functools.partial(bsd.decode_attention, use_triton=True))
    prompts = RAGGED + [[5] * 13]
    ref = Engine(m, tok, **kw).generate(prompts, 2)
    bf = Engine(m, tok, kv_dtype="bfloat16", **kw)
    if mode == "speculative":
        got = bf.generate(prompts, 2)
        assert torch.equal(got.mask, ref.mask) and torch.equal(got.tokens, ref.tokens)
    else:
        got = bf.generate(prompts, 2, force=[r[k].tolist() for r, k in zip(ref.tokens, ref.mask)])
    assert pool_k(bf).dtype == torch.bfloat16
    d = (got.logp - ref.logp)[ref.mask].abs()
    assert 0 < d.max() < 2e-2, d.max()  # bf16 rounds the keys (not bit-equal), slightly


# ----------------------------------------------------------------------------- sizing in tokens


def test_pool_pages_bounds_any_rollout_batch_and_is_tight():
    cfg = Config(prompts_per_step=5, group_size=3, max_new_tokens=21, page_size=4)
    gen = torch.Generator().manual_seed(0)
    for longest in (2, 3, 4, 9, 16, 23):
        bound = pool_pages(cfg, longest)
        for _ in range(50):  # 5 prompts of up to `longest` tokens
            lens = torch.randint(1, longest + 1, (5,), generator=gen).tolist()
            S, P, R = lane_pages([(n, 3) for n in lens], 4, 21)
            assert S * P + 15 * R <= bound, (longest, lens)
            # the first two the same prompt: one group of 6 rows
            S, P, R = lane_pages([(lens[0], 6)] + [(n, 3) for n in lens[2:]], 4, 21)
            assert S * P + 15 * R <= bound, (longest, lens)
        # every prompt `longest` tokens, one short of a page boundary: the bound is met
        if longest % 4 == 3 or longest < 4:
            S, P, R = lane_pages([(longest, 3)] * 5, 4, 21)
            assert S * P + 15 * R == bound
    spec = Config(prompts_per_step=5, group_size=3, max_new_tokens=21, page_size=4,
                  rollout_mode="speculative", spec_k=2, spec_k_max=6)
    assert pool_pages(spec, 9) == 5 * (9 // 4 + 3 * -(-(3 + 21 + 6) // 4))  # k up to spec_k_max
    assert pool_pages(Config(kv_pool_tokens=1001, page_size=16), 50) == 63


def test_an_auto_sized_pool_runs_a_rollout_batch_in_one_call(monkeypatch):
    cfg = Config(prompts_per_step=4, group_size=3, max_new_tokens=9, page_size=4)
    m, tok = tiny_model(), CharTok()
    caches = capture_caches(monkeypatch)
    batch = [PROMPTS[i] for i in (2, 5, 7, 7)]  # a repeat: its rows share one prompt
    longest = max(map(len, batch))
    eng = Engine(m, tok, max_new_tokens=9, page_size=4,
                 pool_tokens=pool_pages(cfg, longest) * 4)
    ro = eng.generate(batch, 3, seed=1)
    assert ro.timings["generate_calls"] == 1 and len(ro) == 12
    assert caches[0].num_pages <= pool_pages(cfg, longest)


def test_a_call_that_does_not_fit_runs_as_calls_that_do(monkeypatch):
    """A small pool: generate splits the prompts into calls whose pages fit, every call inside
    the pool (allocated once, at its cap), and the joined Rollouts equal one call's, field by
    field: tokens, log-probs, budgets, top-k, the recorded pages; MoE routes per row."""
    m, tok = tiny_model(), CharTok()
    kw = dict(max_new_tokens=8, temperature=0.0, page_size=4, topk_logprobs=3,
              sparse=fraction_budget(0.5), dense_layers=1, record_pages=True)
    one = Engine(m, tok, **kw).generate(PROMPTS, 2)
    caches = capture_caches(monkeypatch)
    cap = 40  # pages: about 8 rows of these prompts
    small = Engine(m, tok, pool_tokens=cap * 4 - 3, **kw)  # tokens, rounded up to pages
    spans = small.calls(PROMPTS, 2)
    assert len(spans) > 2 and spans[0][0] == 0 and spans[-1][1] == len(PROMPTS)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    split = small.generate(PROMPTS, 2)
    assert split.timings["generate_calls"] == len(spans) == len(caches)
    assert all(c.num_pages <= cap for c in caches)  # each call's lanes inside the pool
    L, H, D = m.config.num_hidden_layers, m.config.num_key_value_heads, m.config.head_dim
    # allocated once, whole, never grown; one page more: the scratch page (decode.py)
    assert pool_k(small).numel() == L * H * (cap + 1) * 4 * D
    for f in ("prompt_index", "tokens", "mask", "budget", "budget_dense", "topk_ids",
              "read_pages"):
        assert torch.equal(getattr(split, f), getattr(one, f)), f
    for f in ("logp", "topk_logp"):
        assert torch.allclose(getattr(split, f), getattr(one, f), atol=1e-5), f
    assert split.finish == one.finish and split.texts == one.texts
    for k in ("new_tokens", "pages_read", "pages_dense", "prefill_tokens"):
        assert split.timings[k] == one.timings[k], k
    # MoE: each row's routes over its prompt and completion, as one call records them
    moe, n = tiny_model(moe=True), 12
    a = Engine(moe, tok, max_new_tokens=6, temperature=0.0, page_size=4).generate(PROMPTS[:n], 2)
    b = Engine(moe, tok, max_new_tokens=6, temperature=0.0, page_size=4,
               pool_tokens=64).generate(PROMPTS[:n], 2)
    assert b.timings["generate_calls"] > 1 and torch.equal(a.tokens, b.tokens)
    for i in range(2 * n):
        t = int(a.mask[i].sum())
        assert torch.equal(a.experts.sequence(i, t), b.experts.sequence(i, t))
    # a group that cannot fit at all is refused, naming the key that lowers it
    with pytest.raises(ValueError, match="kv_pool_tokens"):
        Engine(m, tok, max_new_tokens=8, page_size=4, pool_tokens=16).generate(PROMPTS[:2], 4)


def test_speculative_calls_split_too():
    m, tok = tiny_model(seed=2), CharTok()
    kw = dict(max_new_tokens=8, temperature=0.0, page_size=4, sparse=fraction_budget(0.5),
              dense_layers=1, speculative=2)
    one = Engine(m, tok, **kw).generate(PROMPTS[:16], 2)
    split = Engine(m, tok, pool_tokens=160, **kw).generate(PROMPTS[:16], 2)
    assert split.timings["generate_calls"] > 1
    assert torch.equal(split.tokens, one.tokens) and torch.equal(split.mask, one.mask)
    for k in ("drafted", "accepted", "verifies", "rejections"):
        assert split.timings[k] == one.timings[k], k
    assert split.timings["acceptance"] == pytest.approx(one.timings["acceptance"])
    assert split.timings["accept_geom"] == pytest.approx(one.timings["accept_geom"])


# ----------------------------------------------------------------------------- held-out


class Cascade:  # a reward from the text alone: the same completions, the same rewards
    def score_batch(self, problems, texts, group_size, finish):
        return SimpleNamespace(rewards=[float(len(t) % 2) for t in texts])


def heldout_run(greedy, pool):
    tok = greedy.tok
    probs = [Problem(prompt=str(i), answer="", task="synthetic", meta={"difficulty": i % 3})
             for i in range(len(PROMPTS))]
    return SimpleNamespace(role=SimpleNamespace(me=0, n=1, group=None), eval_p=probs,
                           eval_ids=PROMPTS, greedy=greedy, tok=tok, cascade=Cascade(),
                           sparse=SimpleNamespace(pool=pool))


def test_heldout_runs_in_calls_that_fit_the_pool(monkeypatch):
    """Held-out evaluation of many prompts over a small pool runs in several generate calls, each
    of them inside the pool (one call of the engine: generate never has to split it), and the
    greedy figures and the shown completions equal one big call's."""
    m, tok = tiny_model(), CharTok()
    cfg = SimpleNamespace(temperature=1.0, max_new_tokens=8, kv_dtype="auto", eval_k_per_bin=0)
    kw = dict(temperature=0.0, max_new_tokens=8, page_size=4)
    want = heldout.evaluate(cfg, heldout_run(Engine(m, tok, **kw), KVPool()), texts=range(30))
    calls, generate = [], Engine.generate

    def spy(self, prompt_ids, G=1, seed=0, force=None):
        ro = generate(self, prompt_ids, G, seed, force)
        calls.append((len(prompt_ids), ro.timings["generate_calls"], ro.timings["pages_total"]))
        return ro
    monkeypatch.setattr(Engine, "generate", spy)
    cap = 40  # pages
    small = Engine(m, tok, pool_tokens=cap * 4, **kw)
    got = heldout.evaluate(cfg, heldout_run(small, KVPool()), texts=range(30))
    assert got == want
    assert len(calls) > 2 and sum(n for n, _, _ in calls) == len(PROMPTS)
    assert all(parts == 1 and pages <= cap for _, parts, pages in calls), calls
    # sampled (pass@k): over the run's pool, cut into calls of k rows a prompt that fit it
    calls.clear()
    pool = KVPool(cap * 4)
    passes = heldout.evaluate(cfg, heldout_run(small, pool), k=4)
    assert set(passes) == {"pass@1", "pass@4"}
    assert len(calls) > 2 and all(parts == 1 and pages <= cap for _, parts, pages in calls)
    L, H, D = m.config.num_hidden_layers, m.config.num_key_value_heads, m.config.head_dim
    assert pool_k(SimpleNamespace(pool=pool)).numel() == L * H * (cap + 1) * 4 * D  # + scratch


# ----------------------------------------------------------------------------- one pool, reused


@pytest.mark.parametrize("sparse", [False, True])
def test_one_pool_serves_every_call_and_engines_that_share_it(monkeypatch, sparse):
    """Two calls of one engine, and a second engine given its pool, write the same storage (no
    allocation after the first call), and each gives the tokens a fresh engine gives: what an
    earlier call left in the pool is never read."""
    m, tok = tiny_model(seed=1), CharTok()
    kw = dict(max_new_tokens=10, temperature=1.0, page_size=4, eos_ids=[5, 6])
    if sparse:
        kw.update(sparse=fraction_budget(0.5), dense_layers=1, scorer="quest", rescore_every=2)
    caches = capture_caches(monkeypatch)
    eng = Engine(m, tok, **kw)
    first = eng.generate(RAGGED + [[9] * 11], 3, seed=1)  # the largest call comes first
    second = eng.generate(RAGGED[:2], 2, seed=2)
    other = Engine(m, tok, pool=eng.pool, **kw)
    third = other.generate(RAGGED[1:], 2, seed=3)
    ptrs = {c.k.data_ptr() for c in caches} | {c.v.data_ptr() for c in caches}
    assert len({c.k.data_ptr() for c in caches}) == 1 and len(ptrs) == 2, "one K and one V"
    for ro, (prompts, G, seed) in zip((first, second, third), ((RAGGED + [[9] * 11], 3, 1),
                                                              (RAGGED[:2], 2, 2),
                                                              (RAGGED[1:], 2, 3))):
        fresh = Engine(m, tok, **kw).generate(prompts, G, seed=seed)
        assert torch.equal(ro.tokens, fresh.tokens) and torch.equal(ro.logp, fresh.logp)
    # a call that needs more than the pool holds grows it once; the next smaller one reuses it
    before = pool_k(eng).numel()
    eng.generate([[4] * 60], 16, seed=4)
    grown = pool_k(eng)
    assert grown.numel() > before
    eng.generate(RAGGED, 1, seed=5)
    assert pool_k(eng).data_ptr() == grown.data_ptr()
