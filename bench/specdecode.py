"""
bench/specdecode.py: stage 2's lossless mode on the CPU. Does self-speculative decoding (the
sparse policy drafts k tokens, the dense policy verifies them in one forward:
rollout.Engine(speculative=k)) beat dense decode, at matched lengths? Over k in {2, 4, 8}, read
fractions 1/8 and 1/4 and cached contexts of 1k, 2k and 4k tokens: CPU ms per token against dense
decode, the acceptance rate, tokens per verify, where the time goes (draft, verify), and beside
each the cost model's prediction. Then the cost model's prediction for Qwen3-1.7B at 32K on an
H200 at the measured acceptance, beside the lossy sparse path's (Sparrow reports 2.21x lossy).

    python -m bench specdecode --threads 1     # about 10 minutes on one core
    python -m bench specdecode --quick         # 512 tokens, k in {2, 4}: a smoke run (seconds)

The cost model (bench/cost.py's rollout_cost, per row and step at context c, one token each):
    dense step   B (w + a + kv) + W        w = 2P / flops, a = attention FLOPs / flops,
    sparse step  B (w + f a + f kv + m) + W   kv = the row's KV bytes / bandwidth, f = read
    verify       B (T w + T a + kv) + W       fraction, m = page scoring, W = the weights' bytes
                                              once a forward; T = k + 1 tokens a row
    predicted speedup = tokens_per_verify x dense step / (k x sparse step + verify)
A verify reads each row's KV once for its T queries and multiplies T tokens through the weights:
self-speculation pays where reading KV (or the weights, in memory-bound decode) dominates, since
every accepted token's matmuls run twice, in the draft and in the verify.

Simplifications:
    1. The model is random (sparsepath's: 4 layers, 2 KV heads of 32, vocabulary 128); sampling at
       temperature 1 with EOS off, so every row runs to max_new_tokens on both sides (matched
       lengths; the rows' tokens differ). A random model's distributions are flat, so a sparse
       draft agrees with dense more than a trained model's would: the acceptance here is an upper
       end; what a trained policy gives is measured in the loop.
    2. Own contexts: 8 rows, each with its own prompt of the context's length (the long-generation
       regime), pages of 16, every layer sparse in the draft (dense_layers = 0). The verify
       reads each row's lane in place with the C++ kernel, as dense decode does, its k + 1
       queries as G * (k + 1) of one decode step (kvcache.PagedKVCache._verify_lanes).
    3. The arms take turns; each arm's fastest round counts. Times are the process's CPU time
       (run with --threads 1) less its prefill's: a machine shared with other work slows wall
       time, not CPU time. The draft and verify shares are wall time
       (the engine's draft_s and verify_s over its decode_s), and so is the time outside
       attention (decode_s less the engine's clock of attention and page selection).
    4. The fixed cost per decode step, from one more untimed call of each arm (bench/sparsecost's
       `Dispatched`): the PyTorch ops dispatched (a GPU's kernel launches; C++ kernel calls are
       not among them) and the host syncs (the host's reads of device values after device work),
       over the call's forwards (decode steps, draft steps and verifies; the prefill's ops among
       them).
    5. Every arm runs the engine's default step (on a CPU the fused one, decode.py) but "dense,
       eager step": dense decoding with the eager step, the reference, as the engine ran before
       the fused step; its speedup below 1 is what the fused step saves.
    6. The Qwen3-1.7B row is a prediction only (H200 datasheet rates, bf16 KV and weights, 8 rows
       each with 32K tokens of its own, tokens per verify (1 - a^(k+1)) / (1 - a) at acceptance a).
"""

import time

import torch

from bench.common import _Ids, hardware
from bench.cost import machine_rates, model_shape, rollout_cost
from bench.sparsecost import dispatch_counts
from bench.sparsepath import model
from model import ModelConfig
from rollout import Engine
from sparsity import fraction_budget

PAGE = 16
EAGER = "dense, eager step"  # decode.Runner's reference; every other arm runs the default step


def spec_cost(shape, B, ctx, k, tpv, schedule, rates, kv_bytes, param_bytes, dense_layers=0):
    """The cost model's seconds per token of dense decode and of speculative decoding (k drafts a
    verify, tpv tokens a verify) for B rows at context ctx -> (dense, speculative, lossy sparse)."""
    P, layers, kv_heads, head_dim, r = shape  # r: query heads per KV head
    D = 2 * layers * kv_heads * head_dim
    c = rollout_cost(P, layers, 1, r, D, ctx, 1, *rates, schedule=schedule, page_size=PAGE,
                     dense_layers=dense_layers, kv_bytes=kv_bytes)
    W = param_bytes * P / rates[1]  # the weights read once a forward
    w, a, kv = c["weights_s"], c["attn_s"], c["kv_s"]
    dense = B * (w + a + kv) + W
    sparse = B * (w + c["attn_sparse_s"] + c["kv_sparse_s"] + c["meta_s"]) + W
    verify = B * ((k + 1) * (w + a) + kv) + W
    return dense / B, (k * sparse + verify) / (tpv * B), sparse / B


def cpu_timed(eng):
    """Wrap eng._prefill so that each call adds its CPU seconds to eng.prefill_cpu."""
    prefill = eng._prefill

    def timed(*a):
        t0 = time.process_time()
        out = prefill(*a)
        eng.prefill_cpu += time.process_time() - t0
        return out
    eng._prefill, eng.prefill_cpu = timed, 0.0
    return eng


def measure(m, prompts, new, arms, rounds):
    """{arm: (decode CPU ms per token, timings)}, best round; the arms take turns. CPU time
    (time.process_time: on a machine shared with other work, time spent waiting for a core does
    not count) of the call less that of its prefill. The timings gain the best round's clock
    (attn_s, select_s) and the arm's ops and host syncs per forward (a decode, draft or verify
    step)."""
    kw = dict(temperature=1.0, page_size=PAGE, eos_ids=[-1], dense_layers=0)
    engines = {a: cpu_timed(Engine(m, _Ids(), max_new_tokens=new, **kw, **a_kw))
               for a, a_kw in arms.items()}
    for eng in engines.values():  # warm-up: first calls build kernels and pack weights
        with torch.no_grad():
            eng.generate([p[:64] for p in prompts[:2]], 1, seed=0)
    best = {}
    for _ in range(rounds):
        for a, eng in engines.items():
            eng.prefill_cpu, t0 = 0.0, time.process_time()
            eng.clock = clock = {"attn": 0.0, "select": 0.0}
            with torch.no_grad():
                t = eng.generate(prompts, 1, seed=0).timings
            s = time.process_time() - t0 - eng.prefill_cpu
            eng.clock = None
            if a not in best or s < best[a][0]:
                best[a] = (s, dict(t, attn_s=clock["attn"], select_s=clock["select"]))
    for a, eng in engines.items():  # the fixed cost, untimed
        best[a][1]["ops"], best[a][1]["syncs"] = dispatch_counts(eng, prompts, 1)
    return {a: (1e3 * s / (t["new_tokens"] - len(prompts)), t)  # the first token: prefill's
            for a, (s, t) in best.items()}


def qwen_rows(results):
    """The cost model's prediction for Qwen3-1.7B at 32K on an H200, at each measured acceptance."""
    qwen = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True)
    P, layers, kv_heads, head_dim = model_shape(qwen)
    shape, rates = (P, layers, kv_heads, head_dim, 16 // kv_heads), (989e12, 4.8e12)
    lines = []
    for (f, k), acc in sorted(results.items()):
        tpv = (1 - acc ** (k + 1)) / (1 - acc) if acc < 1 else k + 1
        dense, spec, lossy = spec_cost(shape, 8, 32768, k, tpv, fraction_budget(f), rates, 2, 2,
                                       dense_layers=2)
        lines.append(f"| Qwen3-1.7B, 32K, 8 rows | k = {k}, r = {f:g}, 2 dense layers | "
                     f"{acc:.3f} | {tpv:.2f} | {dense / spec:.2f}x | {dense / lossy:.2f}x | "
                     f"H200 datasheet (989 TFLOP/s, 4.8 TB/s): a prediction |")
    return lines


def run(quick, cmd):
    """-> the table, head included."""
    hw, m = hardware(), model()
    flops, bw = machine_rates()
    cfg = m.config
    P, layers, kv_heads, head_dim = model_shape(cfg)
    shape = (P, layers, kv_heads, head_dim, cfg.num_attention_heads // kv_heads)
    contexts, ks, fracs = ((512,), (2, 4), (0.125,)) if quick else ((1024, 2048, 4096), (2, 4, 8),
                                                                     (0.125, 0.25))
    B, new, rounds = (4, 24, 1) if quick else (8, 96, 3)
    g = torch.Generator().manual_seed(0)
    lines = [f"Hardware: {hw}. Command: `{cmd}`. A random 4-layer Qwen3-shaped model (2 KV heads "
             f"of 32), {B} rows each with its own prompt of the context's length, {new} new "
             f"tokens a row at temperature 1 with EOS off (matched lengths), pages of {PAGE}, the "
             f"draft sparse in every layer; CPU ms per decode token, best of {rounds} rounds. "
             f"Predicted: bench/cost.py's rollout_cost at {flops / 1e9:.0f} GFLOP/s and "
             f"{bw / 1e9:.1f} GB/s, with the measured tokens per verify.", "",
             "| context | arm | ms/token | speedup over dense | predicted | acceptance | "
             "tokens/verify | draft share | verify share | pages read / dense | outside attention "
             "| ops / step | host syncs / step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    measured = {}
    for ctx in contexts:
        prompts = [torch.randint(3, cfg.vocab_size, (ctx,), generator=g).tolist()
                   for _ in range(B)]
        arms = {"dense": {}, EAGER: dict(step="eager"),
                **{(f, k): dict(sparse=fraction_budget(f), speculative=k)
                   for f in fracs for k in ks}}
        res = measure(m, prompts, new, arms, rounds)
        d, out = res["dense"][0], lambda t: 1 - (t["attn_s"] + t["select_s"]) / t["decode_s"]
        td = res["dense"][1]
        lines.append(f"| {ctx} | dense | {d:.2f} | 1.00x | - | - | - | - | - | 1.00 | "
                     f"{out(td):.0%} | {td['ops']:.0f} | {td['syncs']:.2f} |")
        te = res[EAGER][1]  # the eager step: what the fused step's fixed cost was before
        lines.append(f"| {ctx} | {EAGER} | {res[EAGER][0]:.2f} | {d / res[EAGER][0]:.2f}x | - | - "
                     f"| - | - | - | 1.00 | {out(te):.0%} | {te['ops']:.0f} | {te['syncs']:.2f} |")
        for arm, (ms, t) in res.items():
            if arm in ("dense", EAGER):
                continue
            f, k = arm
            dense_c, spec_c, _ = spec_cost(shape, B, ctx, k, t["tokens_per_verify"],
                                           fraction_budget(f), (flops, bw), 4, 4)
            measured[arm] = measured.get(arm, []) + [t["acceptance"]]
            lines.append(f"| {ctx} | k = {k}, r = {f:g} | {ms:.2f} | {d / ms:.2f}x | "
                         f"{dense_c / spec_c:.2f}x | {t['acceptance']:.3f} | "
                         f"{t['tokens_per_verify']:.2f} | {t['draft_s'] / t['decode_s']:.0%} | "
                         f"{t['verify_s'] / t['decode_s']:.0%} | "
                         f"{t['pages_read'] / t['pages_dense']:.2f} | {out(t):.0%} | "
                         f"{t['ops']:.0f} | {t['syncs']:.2f} |")
        print("\n".join(lines[-len(res):]), flush=True)
    acc = {arm: sum(a) / len(a) for arm, a in measured.items()}
    lines += ["", "Cost model PREDICTION (nothing run): Qwen3-1.7B, 8 rows at 32K cached tokens "
              "each, bf16, speculative at the acceptance measured above (mean over contexts) "
              "against the lossy sparse path at the same read fraction.", "",
              "| model | arm | acceptance | tokens/verify | speculative (lossless) | "
              "sparse (lossy) | rates |", "|---|---|---|---|---|---|---|"]
    lines += qwen_rows(acc)
    print("\n".join(lines[-len(acc) - 4:]), flush=True)
    return lines
