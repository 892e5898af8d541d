"""
bench/verifycost.py: stage 2's lossless mode, what a verify's attention costs against a dense decode
step's. A verify brings k + 1 queries a row and query head where a decode step brings one; the C++
kernel reads each block of a row's keys once for all G * (k + 1) queries of its KV head (two small
GEMMs: zeros_kernels/sparse_decode_cpu.cpp's attend_block), where before it read them in chunks
of 8 queries and attended to the new tokens apart (kvcache.PagedKVCache._verify_lanes).

    python -m bench verifycost            # about a minute on one core
    python -m bench verifycost --quick    # 1k tokens, the bench model's heads only (seconds)

Per cached context (1k, 2k, 4k tokens; 8 rows, k = 8, 1 thread): the attention of a dense decode
step (in the same key blocks from sparse_decode_cpu.DECODE_BLOCKS_FROM keys a lane: all of these
contexts) and of a verify, before (the two-part path: BLOCKS off) and after, summed over the
layers; each as ms and as a multiple of the decode step's. Then the ceiling: the verify's
FLOP rate (4 D FLOPs a query and key: Q K^T and P V) against this core's fp32 GEMM rate
(bench/cost.py's machine_rates), and the verify at that rate, its floor, as a multiple of the
decode step as measured: where the floor is under 1.3x, the kernel, not the CPU, holds the goal.
Last, both at their roofline floor (the verify's FLOPs at the GEMM rate, or its bytes at the read
bandwidth if more; the decode step's bytes, K and V once, at the read bandwidth): the ratio no
pair of kernels on this CPU can beat, whatever they are made of.

Simplifications:
    1. No model: a one-call lanes cache (kvcache.PagedKVCache, pages of 16, fp32: the CPU's KV
       dtype) of 8 rows, each with a prompt of its own (no shared pages), random keys and values,
       and random queries. The attention is the cache's `attend` for every layer, the new tokens'
       K and V writes included (a decode step: one token a row; a verify: k + 1).
    2. Two head shapes, 4 layers each: the random model of bench specdecode and sparsepath (2 KV
       heads of 32, G = 2) and Qwen3-0.6B's (8 KV heads of 128, G = 2: 4 of its 28 layers).
    3. Times are the thread's CPU time (time.thread_time); the arms take turns, and each arm's
       fastest round counts: a machine shared with other work slows wall time, and CPU time less.
"""

import time
from types import SimpleNamespace

import torch

from bench.common import hardware
from bench.cost import machine_rates
from kvcache import PagedKVCache
from rollout import lane_pages
from zeros_kernels import sparse_decode_cpu

ROWS, K, PAGE, LAYERS = 8, 8, 16, 4
SHAPES = {"bench model (2 KV heads of 32, G = 2)": (2, 2, 32),
          "Qwen3-0.6B heads (8 KV heads of 128, G = 2)": (8, 2, 128)}


def lanes(n, H, G, D):
    """A lanes cache of ROWS rows of n cached tokens each (random K and V), H KV heads of D with
    G queries each, LAYERS layers."""
    cfg = SimpleNamespace(num_hidden_layers=LAYERS, num_key_value_heads=H, head_dim=D,
                          num_attention_heads=H * G)
    groups = [(n, [r]) for r in range(ROWS)]
    lp = lane_pages([(n, 1)] * ROWS, PAGE, 2 * (K + 1))
    cache = PagedKVCache(cfg, ROWS, -(-(n + 2 * (K + 1)) // PAGE), lp[0] * lp[1] + ROWS * lp[2],
                         PAGE, torch.float32, "cpu", lanes=lp)
    cache.begin_prefill(groups)
    cache.k.normal_(), cache.v.normal_()  # every slot: the prompts' keys and values, at random
    return cache


def step_ms(cache, T, rounds, gen):
    """{arm: ms of attention over the layers, fastest round}: a decode step (its token then cut
    off again), and a verify of T tokens before (BLOCKS off) and after."""
    rows, (H, G, D) = list(range(ROWS)), (cache.H, cache.G, cache.D)
    n = cache.lens[0]
    qkv = lambda T: [torch.randn(ROWS, h, T, D, generator=gen) for h in (H * G, H, H)]
    best = {"decode": float("inf"), "verify, before": float("inf"), "verify": float("inf")}
    for _ in range(rounds):
        for arm in best:
            sparse_decode_cpu.BLOCKS = arm != "verify, before"
            new = 1 if arm == "decode" else T
            if arm == "decode":
                cache.begin_decode(rows)
            else:
                cache.begin_verify(rows, T)
            q, k, v = qkv(new)
            t0 = time.thread_time()
            for layer in range(LAYERS):
                cache.attend(layer, q, k, v)
            best[arm] = min(best[arm], time.thread_time() - t0)
            cache.advance(new)
            for r in rows:  # back to n cached tokens: every arm sees the same context
                cache.truncate(r, n)
    sparse_decode_cpu.BLOCKS = True
    return {arm: 1e3 * t for arm, t in best.items()}


def run(quick, cmd):
    """-> the table, head included."""
    if sparse_decode_cpu.cpu_kernel() is None:
        return ["The C++ kernel did not build: nothing to measure (this section times it)."]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    contexts, shapes = ((1024,), list(SHAPES)[:1]) if quick else ((1024, 2048, 4096), SHAPES)
    rounds, gen = 3 if quick else 7, torch.Generator().manual_seed(0)
    flops, bw = machine_rates()
    lines = [f"Hardware: {hardware()}. Command: `{cmd}`. Attention alone, 1 thread: {ROWS} rows, "
             f"k = {K} drafts (a verify of {K + 1} tokens a row), {LAYERS} layers, fp32 KV in "
             f"lanes, pages of {PAGE}; thread CPU ms summed over the layers, fastest of {rounds} "
             f"rounds, the arms taking turns. GEMM rate: an fp32 2048 x 2048 matmul, "
             f"{flops / 1e9:.0f} GFLOP/s; read bandwidth: summing 256 MB, {bw / 1e9:.1f} GB/s.", "",
             "| heads | cached tokens | decode step ms | verify before ms | verify ms "
             "| before / decode | verify / decode | verify GFLOP/s | verify at the GEMM rate / "
             "decode | both at their floor |", "|---|---|---|---|---|---|---|---|---|---|"]
    try:
        for name in shapes:
            for n in contexts:
                ms = step_ms(lanes(n, *SHAPES[name]), K + 1, rounds, gen)
                d, b, a = ms["decode"], ms["verify, before"], ms["verify"]
                H, G, D = SHAPES[name]  # each of G (k + 1) queries against n + k + 1 keys
                work = ROWS * H * LAYERS * G * (K + 1) * (n + K + 1) * 4 * D
                kv = lambda T: ROWS * H * LAYERS * (n + T) * 2 * D * 4  # bytes of K and V read
                floor = max(work / flops, kv(K + 1) / bw) / (kv(1) / bw)
                lines.append(f"| {name} | {n} | {d:.2f} | {b:.2f} | {a:.2f} | {b / d:.2f}x "
                             f"| {a / d:.2f}x | {work / a / 1e6:.0f} "
                             f"| {1e3 * work / flops / d:.2f}x | {floor:.2f}x |")
                print(lines[-1], flush=True)
    finally:
        torch.set_num_threads(threads)
    return lines
