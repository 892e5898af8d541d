"""The static decode step (decode.py): its rounds of padded buckets give the tokens and logits of
the host-laid per-step reference (PagedKVCache.begin_decode), of exact single steps and of the
naive loop; compiled, it gives the eager step's; its draws are the row's own; its slots are reused
across calls (what a captured graph replays on); a captured CUDA graph gives the eager step's."""
import pytest
import torch

import decode
from decode import Runner, bucket, graph_refusals
from model import ModelConfig, Transformer
from rollout import Engine, generate_naive
from speculative import Noise, sample
from sparsity import fraction_budget


class Ids:  # token ids only: pad 0, no EOS of its own
    pad_token_id, eos_token_id = 0, None

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["" for _ in rows]


def tiny_model(seed=0, head_dim=8):
    torch.manual_seed(seed)
    m = Transformer(ModelConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                intermediate_size=64, max_position_embeddings=256)).eval()
    with torch.no_grad():  # peaked attention, so a sparse read parts from dense
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    return m


PROMPTS = [[(i * 5 + 3) % 16 for i in range(21)], [4, 9, 2, 7, 1, 3, 8, 6, 5], [11, 2, 13]]
SPARSE = dict(sparse=fraction_budget(0.34), keep_first=1, keep_recent=1, dense_layers=1)
MODES = {"dense": {}, "sparse": SPARSE, "speculative": dict(SPARSE, speculative=3)}


class Tap(Runner):
    """A Runner that keeps every step's logits of the live slots by (row, position): a dense or
    sparse step's, or a speculative draft's (the latest at a position)."""

    def __init__(self, mode):
        super().__init__(mode)
        self.seen = {}

    def __call__(self, model, cache, s):
        logits, n_read = super().__call__(model, cache, s)
        for j in range(s.n):
            if s.live[j]:
                self.seen[(int(s.rows[j]), int(s.pos[j]))] = logits[j].clone()
        return logits, n_read


def tapped(m, mode="eager", **kw):
    eng = Engine(m, Ids(), page_size=4, step=mode, **kw)
    eng.run = Tap(mode)
    return eng


def eos_of(m, prompts, G, kw):
    """A token that row 1 samples at position 4: taken as EOS, rows finish at different steps."""
    ro = Engine(m, Ids(), page_size=4, eos_ids=[-1], **kw).generate(prompts, G, seed=1)
    return int(ro.tokens[1, 4])


def eos_mid(m, prompts, G, kw):
    """A token that some rows make at a decode step (not the prefill's first token) and others
    make later or never: taken as EOS, rows finish at different steps inside the rounds."""
    ro = Engine(m, Ids(), page_size=4, eos_ids=[-1], **kw).generate(prompts, G, seed=1)
    T = ro.tokens.shape[1]
    for v in ro.tokens.unique().tolist():
        hit = ro.tokens == v
        first = torch.where(hit.any(1), hit.float().argmax(1), torch.tensor(T))
        if 1 <= first.min() < first.max():
            return v
    raise AssertionError("no token makes the rows finish apart")


@pytest.mark.parametrize("mode", list(MODES))
def test_padded_rounds_equal_single_exact_steps_and_the_naive_loop(mode):
    """Rounds of 5 steps in padded buckets (6 rows; the bucket shrinks as rows finish at an EOS
    that some rows sample) against rounds of one step with exactly the live rows (no padding,
    the host looking every step): the same sampled tokens, and every step's logits at every
    (row, position) within 1e-5; the tokens also equal the naive loop's."""
    m = tiny_model()
    base = dict(max_new_tokens=14, temperature=1.0, **MODES[mode])
    eos = eos_of(m, PROMPTS, 2, base)
    kw = dict(base, eos_ids=[eos])
    fast, ref = tapped(m, sync_every=5, **kw), tapped(m, sync_every=1, **kw)
    ref.one_step = True  # exact buckets, one step a round
    a, b = fast.generate(PROMPTS, 2, seed=1), ref.generate(PROMPTS, 2, seed=1)
    n = a.mask.sum(1)
    assert n.min() < n.max() and "eos" in a.finish  # rows finished at different steps
    assert len(fast.slots) > 1  # the bucket changed
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask)
    assert torch.allclose(a.logp, b.logp, atol=1e-5, rtol=0)
    assert set(fast.run.seen) >= set(ref.run.seen) and ref.run.seen
    for key, x in ref.run.seen.items():
        assert torch.allclose(fast.run.seen[key], x, atol=1e-5, rtol=0), key
    if mode == "dense":
        naive, _ = generate_naive(m, Ids(), PROMPTS, 2, seed=1, max_new_tokens=14,
                                  temperature=1.0, eos_ids=[eos])
        assert [r[k].tolist() for r, k in zip(a.tokens, a.mask)] == naive


def host_laid(eng, prompts, G, steps):
    """The reference step: the index tensors laid out on the host from its lists each step
    (PagedKVCache.begin_decode), then the model -> {(row, position): logits}, greedy."""
    call, seen = eng.start(prompts, G, 0), {}
    cache, tok = call.cache, torch.tensor([o[-1] for o in call.out])
    with torch.no_grad():
        for step in range(1, steps):
            cache.begin_decode(call.live)
            cache.step = step
            logits = eng.model(tok[:, None], cache=cache)[:, -1]
            seen.update({(r, step): logits[j] for j, r in enumerate(call.live)})
            tok = logits.argmax(-1)
    return seen


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_the_static_step_equals_the_host_laid_reference(mode):
    """The static step reads its index tensors from the slots on the device (lay_step); the
    reference lays them out on the host from its lists (begin_decode): every step's logits at
    every (row, position) within 1e-5, over shared and unshared prompts and pages that fill."""
    m = tiny_model(seed=1)
    kw = dict(max_new_tokens=12, temperature=0.0, eos_ids=[-1], **MODES[mode])
    eng = tapped(m, sync_every=4, **kw)
    eng.generate(PROMPTS, 2)
    ref = host_laid(Engine(m, Ids(), page_size=4, **kw), PROMPTS, 2, 12)
    assert len(ref) == 6 * 11
    for (r, pos), x in ref.items():
        assert torch.allclose(eng.run.seen[(r, pos)], x, atol=1e-5, rtol=0), (r, pos)


def test_compiled_step_equals_the_eager_step():
    """torch.compile of the step's forward (one compilation per bucket): the eager step's greedy
    tokens, and its logits within 1e-5, for dense and sparse decoding and the speculative draft,
    across buckets and rows that finish. Its compile time is counted apart."""
    m = tiny_model(seed=2, head_dim=32)  # D = 32: the C++ kernels' graph breaks too
    for mode in MODES:
        kw = dict(max_new_tokens=10, temperature=0.0, sync_every=4, **MODES[mode])
        kw["eos_ids"] = [eos_mid(m, PROMPTS[:2], 2, kw)]
        eager, comp = tapped(m, **kw), tapped(m, "compile", **kw)
        a, b = eager.generate(PROMPTS[:2], 2), comp.generate(PROMPTS[:2], 2)
        n = a.mask.sum(1)
        assert n.min() < n.max() and len(eager.slots) > 1, mode  # rows finish, buckets change
        assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.logp, b.logp, atol=1e-5)
        assert b.timings["compile_s"] > 0 == a.timings["compile_s"]
        assert set(comp.run.seen) == set(eager.run.seen)
        for key, x in eager.run.seen.items():
            assert torch.allclose(comp.run.seen[key], x, atol=1e-5, rtol=0), (mode, key)


def test_fused_step_equals_the_eager_step():
    """The fused step (each layer's work outside attention in two C++ calls, layer_cpu.cpp): the
    eager step's greedy tokens, and its logits within 1e-5, for dense and sparse decoding and the
    speculative draft, across buckets and rows that finish; and on a model 256 wide inside
    Transformer.packed() (oneDNN's packed weights, 16 rows: above the small-batch kernel)."""
    m = tiny_model(seed=2, head_dim=32)
    wide = Transformer(ModelConfig(vocab_size=64, hidden_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   intermediate_size=512, max_position_embeddings=256)).eval()
    prompts = [[(i * 7 + j) % 64 for i in range(5 + 3 * j)] for j in range(8)]
    cases = [(m, PROMPTS[:2], 2, mode) for mode in MODES] + [(wide, prompts, 2, "dense")]
    for model, ps, G, mode in cases:
        kw = dict(max_new_tokens=10, temperature=0.0, sync_every=4, **MODES[mode])
        kw["eos_ids"] = [eos_mid(model, ps, G, dict(kw, step="eager"))]
        eager, fused = tapped(model, **kw), tapped(model, "fused", **kw)
        a, b = eager.generate(ps, G), fused.generate(ps, G)
        assert fused.run.mode == "fused", mode
        n = a.mask.sum(1)  # rows finish; buckets change (16 rows: one bucket)
        assert n.min() < n.max() and (len(eager.slots) > 1 or model is wide), mode
        assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.logp, b.logp, atol=1e-5)
        assert set(fused.run.seen) == set(eager.run.seen)
        for key, x in eager.run.seen.items():
            assert torch.allclose(fused.run.seen[key], x, atol=1e-5, rtol=0), (mode, key)


def test_the_fused_layer_kernels_equal_the_blocks_pytorch():
    """layer_cpu.cpp against model.py, one layer, 3 rows of 4 tokens (the verify's shape): pre_attn
    gives Attention.forward's q, k, v (RMSNorm, the projections, the per-head norms, RoPE), and
    post_attn Block.forward's output from the attention's y, within 1e-5."""
    from model import apply_rope, rope_cos_sin
    from zeros_kernels.cpu_ext import load_cpu_ext
    ext, m = load_cpu_ext("layer_cpu"), tiny_model(seed=3, head_dim=8)
    if ext is None:
        pytest.skip("no C++ compiler")
    blk, cfg = m.model.layers[1], m.config
    B, T, eps = 3, 4, cfg.rms_norm_eps
    x, y = torch.randn(B, T, cfg.hidden_size), torch.randn(B, cfg.num_attention_heads, T, 8)
    cos, sin = rope_cos_sin(torch.arange(5, 5 + T).expand(B, T), 8, cfg.rope_theta, x.dtype)
    at, mlp = blk.self_attn, blk.mlp
    with torch.no_grad():
        h = blk.input_layernorm(x)
        heads = lambda p, n, norm: norm(p(h).view(B, T, n, 8)).transpose(1, 2)  # noqa: E731
        want = [apply_rope(heads(at.q_proj, 4, at.q_norm), cos, sin),
                apply_rope(heads(at.k_proj, 2, at.k_norm), cos, sin),
                at.v_proj(h).view(B, T, 2, 8).transpose(1, 2)]
        got = ext.pre_attn(x, blk.input_layernorm.weight, 0,
                           [at.q_proj.weight, at.k_proj.weight, at.v_proj.weight],
                           at.q_norm.weight, at.k_norm.weight, cos[:, 0].contiguous(),
                           sin[:, 0].contiguous(), 4, 2, eps)
        x1 = x + at.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        out = x1 + mlp(blk.post_attention_layernorm(x1))
        fused = ext.post_attn(x, y, 0, [at.o_proj.weight], blk.post_attention_layernorm.weight, 0,
                              [mlp.gate_proj.weight, mlp.up_proj.weight], 0,
                              [mlp.down_proj.weight], mlp.gate_proj.out_features, eps)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=0)
    assert torch.allclose(fused, out, atol=1e-5, rtol=0)


def test_small_packed_steps_keep_the_small_batch_kernel(monkeypatch):
    """small_packs: inside Transformer.packed(), a step of at most SMALL_ROWS rows where linear_cpu
    runs takes the model's own forward (linear_cpu's kernel, which layer_cpu does not call);
    more rows, no packs, or no linear_cpu: the fused forward."""
    import zeros_kernels.linear_cpu as lc
    from zeros_kernels.layer_cpu import small_packs
    wide = Transformer(ModelConfig(vocab_size=64, hidden_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   intermediate_size=512)).eval()
    monkeypatch.setattr(lc, "linear_cpu_available", lambda: True)
    assert not small_packs(wide, 4)  # not packed
    with wide.packed():
        assert small_packs(wide, 4) == torch.backends.mkldnn.is_available()
        assert not small_packs(wide, lc.SMALL_ROWS + 1)
        monkeypatch.setattr(lc, "linear_cpu_available", lambda: False)
        assert not small_packs(wide, 4)


def test_the_fused_step_is_refused_where_it_would_not_run_the_model():
    """fused_refusals: MoE, a LoRA layer, bf16 weights: `auto` and `fused` run those eagerly."""
    from lora import add_lora
    from zeros_kernels.layer_cpu import fused_refusals
    m, moe = tiny_model(), Transformer(ModelConfig(num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=16))
    assert fused_refusals(m) == [] and fused_refusals(moe) == ["MoE"]
    assert fused_refusals(tiny_model().to(torch.bfloat16))[0] == "not fp32"
    lo = tiny_model()
    add_lora(lo, r=2)
    assert fused_refusals(lo) == ["a linear that is not a plain fp32 nn.Linear (LoRA, fp8, "
                                  "N:M, bias)"]
    for model, mode in ((m, "fused"), (lo, "eager")):
        eng = Engine(model, Ids(), eos_ids=[-1], max_new_tokens=4, step="fused")
        eng.generate(PROMPTS[:1], 1)
        assert eng.run.mode == mode


def test_buckets_and_slots_are_reused_across_calls():
    """Buckets: 1, 2, 4, 8, 16, then multiples of 16, at most the call's rows. An engine's
    slots are made once per (bucket, page-table width) and reused by every call (a captured
    step replays on their memory): a second call gives a fresh engine's tokens."""
    assert [bucket(n, 1000) for n in (1, 2, 3, 5, 9, 16, 17, 33, 64, 65)] == [
        1, 2, 4, 8, 16, 16, 32, 48, 64, 80]
    assert bucket(5, 6) == 6 and bucket(3, 3) == 3
    m = tiny_model()
    kw = dict(max_new_tokens=9, temperature=1.0, eos_ids=[5], page_size=4)
    eng = Engine(m, Ids(), **kw)
    eng.generate(PROMPTS, 2, seed=1)
    ptrs = {k: s.tok.data_ptr() for k, s in eng.slots.items()}
    again = eng.generate(PROMPTS, 2, seed=2)
    assert {k: s.tok.data_ptr() for k, s in eng.slots.items() if k in ptrs} == ptrs
    fresh = Engine(m, Ids(), **kw).generate(PROMPTS, 2, seed=2)
    assert torch.equal(again.tokens, fresh.tokens) and torch.equal(again.logp, fresh.logp)


def test_a_rows_draws_are_its_own():
    """Keyed noise: row r's token at position p depends on (seed, r, p) and its logits only, so
    a row sampled alone, with other rows, or in any order draws the same; and the draws race
    exactly: with a torch.Generator they are torch.multinomial's."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 16, generator=g)
    noise, rows, pos = Noise(3), torch.tensor([0, 1, 2, 3, 4]), torch.tensor([7, 7, 2, 9, 0])
    tok, _ = sample(logits, 1.0, 1.0, noise.at(rows, pos))
    alone = [sample(logits[j:j + 1], 1.0, 1.0, noise.at(rows[j:j + 1], pos[j:j + 1]))[0].item()
             for j in (4, 2, 0)]
    assert alone == tok[[4, 2, 0]].tolist()
    g1, g2 = (torch.Generator().manual_seed(5) for _ in range(2))
    probs = torch.softmax(logits, -1)
    assert torch.equal(sample(logits, 1.0, 1.0, g1)[0],
                       torch.multinomial(probs, 1, generator=g2)[:, 0])
    m = tiny_model()
    kw = dict(max_new_tokens=8, temperature=1.0, eos_ids=[-1], page_size=4)
    both = Engine(m, Ids(), **kw).generate(PROMPTS[:2], 1, seed=4)
    first = Engine(m, Ids(), **kw).generate(PROMPTS[:1], 1, seed=4)
    assert torch.equal(both.tokens[0], first.tokens[0])


def test_graph_capture_is_refused_where_a_replay_would_differ():
    """A captured step replays fixed memory: capture is only taken on CUDA, without page
    records, MoE, rescoring once in several steps or autocast; elsewhere `auto` runs eager."""
    m, moe = tiny_model(), Transformer(ModelConfig(num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=16))
    kw = dict(eos_ids=[-1], max_new_tokens=4)
    assert graph_refusals(Engine(m, Ids(), **kw), m) == ["not on CUDA"]
    assert graph_refusals(Engine(moe, Ids(), **kw), moe) == ["not on CUDA", "MoE"]
    eng = Engine(m, Ids(), record_pages=True, rescore_every=2, **SPARSE, **kw)
    assert graph_refusals(eng, m) == ["not on CUDA", "record_pages", "rescore_every > 1"]
    eng.generate(PROMPTS[:1], 1)
    assert eng.run.mode == "fused"  # a CPU's auto: the fused step (layer_cpu.cpp)
    with pytest.raises(ValueError, match="step one of"):
        Engine(m, Ids(), step="fast")
    with pytest.raises(ValueError, match="sync_every"):
        Engine(m, Ids(), sync_every=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", list(MODES))
def test_captured_step_equals_the_eager_step_on_a_gpu(mode):
    """On a GPU: each bucket's forward captured once and replayed gives the eager step's tokens
    and logits within 1e-5 (fp32), dense, sparse and speculative, across buckets and rows that
    finish."""
    m = tiny_model(head_dim=32).cuda()
    kw = dict(max_new_tokens=12, temperature=0.0, sync_every=4, kv_dtype="float32", **MODES[mode])
    kw["eos_ids"] = [eos_of(m, PROMPTS, 2, kw)]
    eager, graph = tapped(m, "eager", **kw), tapped(m, "graph", **kw)
    a, b = eager.generate(PROMPTS, 2), graph.generate(PROMPTS, 2)
    assert graph.run.mode == "graph" and graph.run.graphs and b.timings["compile_s"] > 0
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.logp, b.logp, atol=1e-5)
    for key, x in eager.run.seen.items():
        assert torch.allclose(graph.run.seen[key], x, atol=1e-5, rtol=0), key
    assert decode.capture is not None


def test_speculative_rounds_drive_the_engine_through_its_public_step_api():
    """One decode step, one API: speculative.py drives the engine only through Engine.start,
    decode (decode.decode_step's rounds, draft=True for its drafts), take and finish, the calls
    the dense loop makes; no private method or attribute of the engine."""
    import ast
    import inspect
    import speculative
    tree = ast.parse(inspect.getsource(speculative))
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "eng"}
    assert {"start", "decode", "take", "finish"} <= used
    assert not [a for a in used if a.startswith("_")], used
    assert all(callable(getattr(Engine, a)) for a in ("start", "decode", "take", "finish"))


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_a_round_reads_the_device_once(mode):
    """The host's one look a round: decoding rounds of 4 steps reads device values once a
    round (bench/sparsecost's Dispatched counts the reads that follow device work, where a GPU
    would wait), a quarter of what rounds of one step read, for the same tokens."""
    from bench.sparsecost import Dispatched
    m, seen = tiny_model(), {}
    for every in (1, 4):
        eng = Engine(m, Ids(), page_size=4, max_new_tokens=13, temperature=1.0, eos_ids=[-1],
                     sync_every=every, **MODES[mode])
        with torch.no_grad():
            call, rounds = eng.start(PROMPTS, 2, 0), 0
            with Dispatched() as d:
                while call.live:
                    eng.decode(call, every)
                    rounds += 1
        assert d.syncs == rounds and call.steps == 12, (every, d.syncs, rounds)
        seen[every] = eng.finish(call).tokens
    assert torch.equal(seen[1], seen[4])
