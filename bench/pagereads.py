"""
bench/pagereads.py: stage 2 on the CPU, the memory system's share of the sparse path's cost. The
sparse decode kernel alone (zeros_kernels/sparse_decode_cpu.cpp, no engine and no selection) reading a
fraction r of each row's KV pages, against dense decode's kernel reading all of them, from memory
that is not in the caches. Two selections at each r: pages drawn at random (sorted, as a selection
is), and the same number of pages as one contiguous run (the best layout any selection could
have), and between them runs of 4 adjacent pages at random places (what a selection that picks
neighbours together would read). If the random selection costs far more than r of dense while the
run costs about r, the gap is what the memory system charges for jumping, not the kernel's work.

    python -m bench pagereads --threads 1    # about 2 minutes
    python -m bench pagereads --quick        # smaller pools, one round: a smoke run

Simplifications:
    1. The shape is bench/sparsepath.py's "own" context: 16 rows of 4,096 cached tokens, 2 KV heads
       of 32 dims with 2 queries each, fp32, the engine's head-major pool. The pages of a row lie
       in one run of the pool, as the engine lays a row's own tokens.
    2. Cold memory: each timing walks 8 such pools in turn (about 270 MB, far past the last-level
       cache), one kernel call each, and takes the mean per call; the best of 5 rounds counts.
    3. The random selections are fixed per (row, head) for the run, drawn from a seeded generator.
"""

import time

import torch

from bench.common import hardware
from zeros_kernels.sparse_decode_cpu import attend_runs_cpu, cpu_kernel, sparse_decode_cpu

FRACTIONS = (1.0, 0.5, 0.25, 0.125)
RUN = 4  # the middle selection: runs of this many adjacent pages, placed at random


def runs_at_random(P, n, run, gen):
    """n of P page ids (ascending) in runs of `run` adjacent pages, aligned, at random places."""
    starts = torch.randperm(P // run, generator=gen)[:max(1, n // run)] * run
    return (starts[:, None] + torch.arange(run)).flatten().sort().values[:n]


def timed(fn, pools, rounds):
    """Best over rounds of the mean seconds of fn(k, v) per pool."""
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for k, v in pools:
            fn(k, v)
        best = min(best, (time.perf_counter() - t) / len(pools))
    return best


def run(quick, cmd):
    """-> the table, head included."""
    if cpu_kernel() is None:
        return ["The C++ kernel did not build: nothing to measure (this section times it alone)."]
    B, H, G, D, ctx = (4, 2, 2, 32, 1024) if quick else (16, 2, 2, 32, 4096)
    n_pools, rounds = (2, 1) if quick else (8, 5)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H * G, D, generator=gen)
    lens = torch.full((B,), ctx, dtype=torch.int32)
    lines = [f"Hardware: {hardware()}. Command: `{cmd}`. Kernels alone, cold memory: {B} rows of "
             f"{ctx} cached tokens, {H} KV heads of {D} with {G} queries each, fp32; ms per layer "
             f"call (all rows), best of {rounds} rounds over {n_pools} pools; bandwidth on the "
             f"bytes the selected pages hold.", "",
             "| page size | read fraction r | selection | ms | GB/s | of dense | r + 0.15 |",
             "|---|---|---|---|---|---|---|"]
    for ps in (8, 32):
        P = ctx // ps
        pools = [tuple(torch.randn(H, B * ctx, D, generator=gen) for _ in "kv")
                 for _ in range(n_pools)]
        table = torch.arange(B * P, dtype=torch.int32).view(B, P)
        full = 2 * H * B * ctx * D * 4  # K and V bytes of every page

        def dense(k, v):
            view = [t.view(H, B, ctx, D).transpose(0, 1) for t in (k, v)]
            return attend_runs_cpu(q.view(B, H, G, D), *view, lens)

        t_dense = timed(dense, pools, rounds)
        lines.append(f"| {ps} | 1 | dense kernel | {1e3 * t_dense:.3f} | "
                     f"{full / t_dense / 1e9:.1f} | 1.00 | - |")
        for r in FRACTIONS:
            n = max(1, round(P * r))
            picks = {"random": lambda: torch.randperm(P, generator=gen)[:n].sort().values,
                     f"runs of {RUN}": lambda: runs_at_random(P, n, RUN, gen),
                     "one run": lambda: torch.arange(n) + torch.randint(0, P - n + 1, (1,),
                                                                        generator=gen)}
            for name, pick in picks.items():
                if r == 1.0 and name != "random":
                    continue  # every page: the same selection
                sel = torch.stack([torch.stack([pick() for _ in range(H)]) for _ in range(B)])
                sel, n_sel = sel.int(), torch.full((B, H), n, dtype=torch.int32)

                def sparse(k, v):
                    paged = [t.view(H, B * P, ps, D).permute(1, 2, 0, 3) for t in (k, v)]
                    return sparse_decode_cpu(q, *paged, table, lens, sel, n_sel)

                t = timed(sparse, pools, rounds)
                lines.append(f"| {ps} | {r:g} | {name} | {1e3 * t:.3f} | "
                             f"{full * n / P / t / 1e9:.1f} | {t / t_dense:.2f} | "
                             f"{n / P + 0.15:.2f} |")
        print("\n".join(lines[-11:]), flush=True)
    return lines
