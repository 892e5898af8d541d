"""
bench/cost.py: the cost model of a rollout, and its check against the engine. `rollout_cost`
predicts the seconds of a group's decode, dense and sparse, from FLOPs and bytes; `cost_model_check`
times the engine on the same shape and lengths; `rollout_cost_vs_measured` prints both as row (e) of
the rollout section, then what the model predicts for Qwen3-1.7B on an H200 from datasheet rates (a
prediction: nothing is run).

Simplifications:
    1. The model counts FLOPs and bytes at two rates (a big matmul's FLOP/s and a sum's bytes/s,
       measured here by `machine_rates`); it knows nothing of per-op overheads, small matmuls below
       peak, or the CPU path's re-gathering of the shared prompt's pages for every row. So it gets
       the sparse-to-dense ratio far closer than the absolute seconds.
    2. Prefill is the same dense work on both sides of the ratio and is left out of both.
    3. The rows of a group select different pages: their reads of the shared prompt are counted as
       disjoint, a conservative bound.

    python -m bench rollout --threads 1                  # row (e), after (a) to (d)
    python -m pytest -q tests/test_bench_cost.py         # the check on a tiny model
"""

import torch

from bench.common import _Ids, best_of, row
from model import ModelConfig, Transformer
from rollout import Engine
from sparsity import dense_budget, fraction_budget, pages_to_read


# ------------------------------------------------------------------ the cost model (after Kinetics)


def model_shape(cfg):
    """model.ModelConfig -> (P, layers, kv_heads, head_dim) for rollout_cost. P counts the
    parameters that each token multiplies through: every layer (for MoE, the router and the active
    experts only), the final norm and the output head; the embedding is a lookup, not a matmul. For
    a tied dense model that is num_params(). From the rest: r = cfg.num_attention_heads / kv_heads
    and D = 2 * layers * kv_heads * head_dim."""
    C, hd, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    attn = 2 * C * Hq * hd + 2 * C * Hkv * hd + 2 * hd  # q, o; k, v; q_norm, k_norm
    if cfg.attention_bias:
        attn += Hq * hd + 2 * Hkv * hd + C
    P = cfg.hidden_size * cfg.vocab_size + C  # output head, final norm
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            mlp = C * cfg.num_experts + cfg.num_experts_per_tok * 3 * C * cfg.moe_intermediate_size
        else:
            mlp = 3 * C * cfg.intermediate_size
        P += attn + mlp + 2 * C  # two RMSNorms per block
    return P, cfg.num_hidden_layers, Hkv, hd


def rollout_cost(P, n_layers, N, r, D, L_in, L_out, flops, bandwidth, schedule=None, page_size=16,
                 dense_layers=2, keep_first=1, keep_recent=2, kv_bytes=2, meta_keys=1,
                 param_bytes=0):
    """Predicted seconds to generate N completions of L_out tokens from one prompt of L_in tokens,
    dense and with `schedule` (any budget function: pages read from pages cached). Units:
        P          parameters per token (model_shape)
        N          sequences sharing the prompt
        r          query heads per KV head (GQA ratio)
        D          KV elements per token, all layers, K and V: 2 * layers * kv_heads * head_dim
                   (57,344 for Qwen3-1.7B: 112 KiB a token in bf16)
        flops      FLOP/s the device sustains
        bandwidth  bytes/s of memory bandwidth (1 / I)
        kv_bytes   bytes per KV element (2: bf16)
    Dense, the formula of Kinetics / Sparrow, C = 2 P N L_out + r (2 L_in + L_out) L_out N D
    + I (2 L_in L_out D + N L_out^2 D), in seconds:
        weights  2 P N L_out / flops: every token multiplies through every parameter
        attn     r (2 L_in + L_out) L_out N D / flops: 2 r D FLOPs per (token, context token), q.k
                 and p.v
        kv       kv_bytes D (L_in L_out + N L_out^2 / 2) / bandwidth: per step the prompt's KV is
                 read once for all N rows (a shared prefix) and each row reads its own tokens; with
                 kv_bytes = 2 this is the formula's 2 L_in L_out D + N L_out^2 D.
    The step that makes token t sees L_in + t + 1/2 context tokens (the midpoint: the sums over
    steps equal the closed form exactly). Sparse: in the layers past `dense_layers` a row reads f_t
    = K_t / n_t of its n_t cached pages, K_t = pages_to_read(schedule, ...) as the engine clamps it.
    Attention FLOPs and the row's own KV shrink by f_t; the prompt part shrinks to min(1, N f_t)
    (the rows' selections differ: counted as disjoint, a conservative bound). Added: `meta` for
    scoring, each row reads `meta_keys` key-sized vectors per page in the sparse layers (1:
    centroid, 2: Quest's min and max) and spends 2 FLOPs per element; a step that reads every page
    skips it. `param_bytes` > 0 adds the weights' traffic, param_bytes P per step (the formula
    leaves it out). Returns {"dense_s", "sparse_s", "speedup"} and the parts in seconds."""
    if min(P, n_layers, N, r, D, L_in, L_out, flops, bandwidth, page_size) <= 0:
        raise ValueError("rollout_cost: P, n_layers, N, r, D, L_in, L_out, flops, bandwidth and "
                         "page_size must all be positive")
    budget = schedule or dense_budget
    sp = max(0, n_layers - dense_layers) / n_layers  # share of D in sparse layers
    attn = kv = attn_s = kv_s = meta = 0.0  # FLOPs, bytes
    for t in range(L_out):
        ctx, cached = L_in + t + 0.5, L_in + t + 1
        n = -(-cached // page_size)
        f = pages_to_read(budget, n, cached // page_size, keep_first, keep_recent) / n
        attn += 2 * r * D * N * ctx
        kv += kv_bytes * D * (L_in + N * (t + 0.5))
        attn_s += 2 * r * D * N * ctx * ((1 - sp) + sp * f)
        kv_s += kv_bytes * D * ((1 - sp) * (L_in + N * (t + 0.5))
                                + sp * (min(1.0, N * f) * L_in + N * f * (t + 0.5)))
        if f < 1:
            meta += N * n * meta_keys * (sp * D / 2) * (kv_bytes / bandwidth + 2 / flops)  # seconds
    weights = 2 * P * N * L_out / flops + param_bytes * P * L_out / bandwidth
    parts = {"weights_s": weights, "attn_s": attn / flops, "kv_s": kv / bandwidth,
             "attn_sparse_s": attn_s / flops, "kv_sparse_s": kv_s / bandwidth, "meta_s": meta}
    dense = weights + parts["attn_s"] + parts["kv_s"]
    sparse = weights + parts["attn_sparse_s"] + parts["kv_sparse_s"] + meta
    return {"dense_s": dense, "sparse_s": sparse, "speedup": dense / sparse, **parts}


# ------------------------------------------------------------------ the model against the engine


def machine_rates(n=2048, nbytes=256 << 20, repeats=3):
    """This machine's sustained fp32 FLOP/s (an n x n matmul) and read bandwidth in bytes/s (summing
    nbytes of fp32), best of `repeats`: the two rates that the cost model divides by."""
    a, b, x = torch.randn(n, n), torch.randn(n, n), torch.ones(nbytes // 4)
    t = best_of({"matmul": lambda: a @ b, "sum": lambda: x.sum()}, repeats=repeats)
    return 2 * n ** 3 / t["matmul"], nbytes / t["sum"]


def cost_model_check(model, L_in, L_out, N, schedule, dense_layers, rates, page_size=16, repeats=2):
    """One group of N rows sharing an L_in-token prompt, L_out new tokens each: decode seconds
    measured with the engine (dense and with `schedule`, best of `repeats`) and predicted by
    rollout_cost for the same shape, schedule and lengths from rates = (FLOP/s, bytes/s). The
    engine's first token comes from prefill, so decode runs L_out - 1 forwards with L_in + 1 ...
    L_in + L_out - 1 tokens cached: exactly rollout_cost's steps for L_out - 1 tokens. Prefill is
    the same dense work on both sides and is left out of both."""
    cfg = model.config
    prompt = torch.randint(2, cfg.vocab_size, (L_in,), generator=torch.Generator().manual_seed(2))
    prompt = prompt.tolist()
    keep = dict(page_size=page_size, dense_layers=dense_layers, keep_first=1, keep_recent=2)
    engines = {"dense": Engine(model, _Ids(), max_new_tokens=L_out, temperature=0.0, eos_ids=[],
                               **keep),
               "sparse": Engine(model, _Ids(), max_new_tokens=L_out, temperature=0.0, eos_ids=[],
                                sparse=schedule, **keep)}
    ros = {k: [] for k in engines}
    best_of({k: (lambda k=k: ros[k].append(engines[k].generate([prompt], N))) for k in engines},
            repeats, warmup=0)
    measured = {k: min(r.timings["decode_s"] for r in ros[k]) for k in ros}
    P, layers, kv_heads, head_dim = model_shape(cfg)
    # fp32 everywhere on a CPU: 4-byte KV, and every step re-reads the 4-byte weights
    pred = rollout_cost(P, layers, N, cfg.num_attention_heads // kv_heads,
                        2 * layers * kv_heads * head_dim, L_in, L_out - 1, *rates,
                        schedule=schedule, kv_bytes=4, param_bytes=4, **keep)
    t = ros["sparse"][-1].timings
    return {"measured": measured, "pred": pred, "pages": t["pages_read"] / t["pages_dense"],
            "speedup": measured["dense"] / measured["sparse"]}


def rollout_cost_vs_measured(hw, cmd, quick):
    """(e) rollout_cost against the engine on this CPU: predicted vs measured decode speedup and
    seconds for 1/8 of the pages; then what the model predicts for Qwen3-1.7B on an H200 (a
    prediction only)."""
    flops, bw = machine_rates()
    # narrow, shallow and KV-heavy (D = 3,072 KV elements a token against ~7M weights): attention
    # over a long prompt is most of a decode step, so the schedule has something to save
    L_in, L_out, N, dl = (1024, 64, 4, 2) if quick else (2048, 128, 4, 2)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768,
                                    num_hidden_layers=6, num_attention_heads=8,
                                    num_key_value_heads=4, head_dim=64,
                                    max_position_embeddings=L_in + L_out)).eval()
    c = cost_model_check(model, L_in, L_out, N, fraction_budget(1 / 8), dl, (flops, bw))
    m, p = c["measured"], c["pred"]
    setup = (f"N = {N} rows of one {L_in}-token prompt, {L_out} new tokens, 1/8 of the pages "
             f"past {dl} dense layers (engine read {c['pages']:.0%} of the dense pages), 6 layers, "
             f"Hq 8, Hkv 4, head_dim 64, fp32; rates {flops / 1e9:.0f} GFLOP/s (matmul), "
             f"{bw / 1e9:.1f} GB/s (sum)")
    rows = [row(f"(e) cost model: decode speedup predicted vs measured, {setup}",
                f"{p['speedup']:.2f}x predicted", f"{c['speedup']:.2f}x measured",
                p["speedup"] / c["speedup"], "", hw, cmd)]
    for k in ("dense", "sparse"):
        # the model reads the prompt's KV once a step for all N rows; the CPU path gathers every
        # row's pages, the shared prompt's included, into an fp32 copy before attention (the largest
        # item in a profile at 2k tokens, then the attention bmm, the N-row matmuls far below the
        # big-matmul rate and elementwise ops): it under-predicts the seconds several-fold, dense
        # more than sparse
        rows.append(row(f"(e) cost model: {k} decode seconds predicted vs measured, same run "
                        f"(the model counts FLOPs and bytes at the measured rates; the CPU path "
                        f"re-gathers the shared prompt's KV per row and runs small matmuls below "
                        f"peak)",
                        f"{p[k + '_s']:.2f} s predicted", f"{m[k]:.2f} s measured",
                        p[k + "_s"] / m[k], "", hw, cmd))
    # Qwen3-1.7B (tied embeddings) on an H200's datasheet rates, bf16: a prediction, nothing is run
    qwen = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True)
    P, layers, kv_heads, head_dim = model_shape(qwen)
    args = (P, layers, 8, 16 // kv_heads, 2 * layers * kv_heads * head_dim, 1024, 16384, 989e12,
            4.8e12)
    q = rollout_cost(*args, schedule=fraction_budget(1 / 8), dense_layers=2, kv_bytes=2)
    qw = rollout_cost(*args, schedule=fraction_budget(1 / 8), dense_layers=2, kv_bytes=2,
                      param_bytes=2)
    rows.append(row(f"(e) cost model PREDICTION (not measured): Qwen3-1.7B, N = 8 rollouts of a "
                    f"1,024-token prompt, 16,384 new tokens, 1/8 of the pages past 2 dense layers, "
                    f"bf16; with the weights' traffic (2 bytes a parameter a step, which the "
                    f"formula leaves out) added: {qw['sparse_s']:.0f} s sparse vs "
                    f"{qw['dense_s']:.0f} s dense, {qw['speedup']:.2f}x",
                    f"{q['sparse_s']:.1f} s sparse", f"{q['dense_s']:.1f} s dense", q["speedup"],
                    "", "H200 datasheet: 989 TFLOP/s bf16, 4.8 TB/s", cmd))
    print("\n".join(rows), flush=True)
    return rows
