"""
bench/sparsepath.py: stage 2 on the CPU at long contexts. Does the sparse decode path cost what its
read fraction says? Per decode token, the engine's attention and page selection at read fractions
r of 1/2, 1/4 and 1/8, against dense decode's attention, at cached contexts of 1k, 2k and 4k tokens,
with the same model, prompts and batch. The target: attention plus selection at most (r + 0.15)
times dense attention. Also the share of dense decode time that attention takes at each context:
what sparse attention can save at most.

    python -m bench sparsepath --threads 1       # about 20 minutes on one core
    python -m bench sparsepath --quick           # 1k only, fewer rows: a smoke run

Two kinds of context, because dense decode reads them differently:
    own     16 rows, each with its own prompt: the long-generation regime, where a row's context
            is its own tokens and dense decode reads each row's lane in place.
    shared  8 prompts x 8 rows (the loop's shape): dense decode reads a prompt once per group, its
            8 rows' queries side by side, while a selection is per row, so at read fraction r the
            rows of a group read r x 8 times the prompt's pages between them.

Simplifications:
    1. The model is random (speed does not depend on the weights), Qwen3-shaped like the long-CoT
       config's but with a context of 8k; decoding is greedy with EOS off, so every row runs to the
       end. Sparse and dense rows may differ in their tokens; the costs are per token.
    2. Every layer is sparse (dense_layers = 0) and the budget is a fraction of the cached pages
       (always-kept pages included), so r is the read fraction the engine reports. The last arm
       scores the pages once in 4 steps (kv_rescore_every = 4): the steps between select from
       those scores, which changes the pages read as well as the cost. The last three take pages of
       32 and 64 tokens (selection at a coarser grain: fewer pages to score, longer runs to read),
       against the same dense arm (pages of 8: dense decode reads each row's lane as one run either
       way). At 1k tokens the kept pages (the first, the last two and the partial one) are already
       a quarter of 16 pages of 64, so r there is larger.
    3. The prompt sets the context: decode runs `new` steps after a prompt of the context's length,
       so the cached length moves by new / context during the measurement.
    4. The arms take turns, three times; each arm's fastest round counts (engine.clock is the
       timer, wall time: on a busy machine, time the process waits for a core counts too).
"""

import torch

from bench.common import _Ids, hardware
from zeros_kernels.sparse_decode_cpu import cpu_kernel
from model import ModelConfig, Transformer
from rollout import Engine
from sparsity import fraction_budget

FRACTIONS = (0.5, 0.25, 0.125)
RESCORE = 4  # arms at the smallest fraction: its pages scored once in this many steps
BIG = 32  # and pages of this many tokens (4 KB of keys per KV head) and twice that, instead of 8


def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=8192)
    return Transformer(cfg).eval()


def measure(m, ctx, prompts, groups, new, rounds):
    """{arm: ms per token of decode, attention and selection, and the read fraction}, best round."""
    r = FRACTIONS[-1]
    arms = {"dense": (False, 1, 8),
            **{f"r = {f:g}": (fraction_budget(f), 1, 8) for f in FRACTIONS},
            f"r = {r:g}, scored every {RESCORE}": (fraction_budget(r), RESCORE, 8),
            f"r = {r:g}, pages of {BIG}": (fraction_budget(r), 1, BIG),
            **{f"r = {r:g}, pages of {ps}, scored every {RESCORE}":
               (fraction_budget(r), RESCORE, ps) for ps in (BIG, 2 * BIG)}}
    engines = {a: Engine(m, _Ids(), max_new_tokens=new, temperature=0.0, page_size=ps, sparse=b,
                         dense_layers=0, eos_ids=[-1], rescore_every=k)
               for a, (b, k, ps) in arms.items()}
    best = {}
    for _ in range(rounds):  # the arms take turns: a drifting machine load hits them all
        for a, eng in engines.items():
            eng.clock = {"attn": 0.0, "select": 0.0}
            with torch.no_grad():
                t = eng.generate(prompts, groups, seed=0).timings
            n = t["new_tokens"]
            got = dict(decode=1e3 * t["decode_s"] / n, attn=1e3 * eng.clock["attn"] / n,
                       select=1e3 * eng.clock["select"] / n,
                       read=t["pages_read"] / max(1, t["pages_dense"]))
            if a not in best or got["decode"] < best[a]["decode"]:
                best[a] = got
    return best


def run(quick, cmd):
    """-> the table, head included."""
    hw, m = hardware(), model()
    path = ("C++ kernel (zeros_kernels/sparse_decode_cpu.cpp)" if cpu_kernel() is not None
            else "PyTorch gather (the C++ kernel did not build)")
    # (name, prompts, rows per prompt): each row's context its own, as in a long generation; or
    # the loop's shape, 8 prompts x 8 rows sharing a prompt that dense decode reads once per group
    regimes = [("own", 4, 1), ("shared", 2, 4)] if quick else [("own", 16, 1), ("shared", 8, 8)]
    contexts, new, rounds = ((1024,), 16, 1) if quick else ((1024, 2048, 4096), 32, 3)
    g = torch.Generator().manual_seed(0)
    lines = [f"Hardware: {hw}. Command: `{cmd}`. A random 4-layer Qwen3-shaped model (2 KV heads "
             f"of 32), pages of 8 tokens, every layer sparse, greedy, {new} new tokens; ms per "
             f"decode token, best of {rounds} rounds. Sparse CPU path: {path}. Context \"own\": "
             f"{regimes[0][1]} rows, each with its own prompt (as in long generations); "
             f"\"shared\": {regimes[1][1]} prompts x {regimes[1][2]} rows, the prompt's pages "
             f"shared by its rows.", "",
             "| context | tokens | decode | attention share of dense decode | read fraction r | "
             "attention + selection (ms) | of dense attention | target r + 0.15 | met |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, n_prompts, group in regimes:
        for ctx in contexts:
            prompts = [torch.randint(3, 128, (ctx,), generator=g).tolist()
                       for _ in range(n_prompts)]
            res = measure(m, ctx, prompts, group, new, rounds)
            d = res["dense"]
            for arm, r in res.items():
                cost = r["attn"] + r["select"]
                ratio, target = cost / d["attn"], r["read"] + 0.15
                met = "-" if arm == "dense" else ("yes" if ratio <= target else "no")
                lines.append(f"| {name} | {ctx} | {arm} | {d['attn'] / d['decode']:.0%} | "
                             f"{r['read']:.2f} | {r['attn']:.3f} + {r['select']:.3f} | "
                             f"{ratio:.2f} | {target:.2f} | {met} |")
            print("\n".join(lines[-len(res):]), flush=True)
    return lines
