"""
bench/regime.py: stage 2's long-CoT regime (configs/lagged.py), measured before any sparse arm
trains: where dense decode's time goes at each cached length, and how many KV pages each page scorer
needs to hold the mismatch tail.

    1. Attention share of dense decode, per context length: each row with its own context (a
       prompt and its lagged stream, L tokens, prefilled), then greedy decode steps that the
       engine's clock splits into attention and the rest, at L = 512 to 4,096.
    2. Read fraction per scorer: calibrate.py's sweep on the warm start (the config's calibration
       prompts, group and seed) with the centroid, Quest and oracle scorers, at the config's pages
       of 8 (bins of 64 pages) and at pages of 64 scored once in 4 steps (bins of 8 pages); then one
       sparse rollout of the same prompts at each calibrated table: the pages it read of what dense
       decode reads, and its p5 alpha per bin (the check that the table holds). The oracle scores a
       page by the attention mass it really gets (it reads every key: a yardstick, not a speedup),
       so its read fraction is about the least a query-aware scorer can hold the threshold with.
    The ceiling of a read fraction r: 1 / ((1 - s) + s * r), s the attention share at the
    rollouts' mean context, if selection cost nothing.

Simplifications:
    1. The warm start `python train.py configs/lagged.py` cached is reused; otherwise it is built
       (about 20 minutes on 2 cores).
    2. Times are the best of 3 rounds; the read fractions and p5 come from one seeded rollout.

    python -m bench regime --threads 1     # about 25 minutes at 1 thread, the warm start cached
    python -m bench regime --quick         # a short warm start, short contexts: a smoke run
"""

import dataclasses
import shutil
import tempfile

import torch

from bench.common import hardware
from calibrate import calibrated_schedule, sparse_tail
from config import parse_config
from rollout import Engine
from tasks import LAG_LINES, LAG_WIDTH, encode_pool, load_problems, make_synthetic
from warmstart import build_policy

CONTEXTS = (512, 1024, 2048, 3072, 4096)
SCORERS = ("centroid", "quest", "oracle")
PAGES = ((8, 64, 1), (64, 8, 4))  # (page size, bin pages, scored once in k steps)


def stream(prompt, n):
    """The prompt and n tokens of its lagged stream, with no end: a line's first v may be 0 (where
    the task would stop). Contexts of any length for timing; the attention share does not depend
    on the tokens."""
    s, out = [int(c) for c in prompt if c != "\n"][1::2], prompt
    while len(out) < n:
        line = []
        for _ in range(LAG_WIDTH):
            s.append((s[-1] + s[-LAG_LINES * LAG_WIDTH]) % 10)
            line.append(f"{s[-LAG_LINES * LAG_WIDTH - 1]}{s[-1]}")
        out += "".join(line) + "\n"
    return out[:n]


def attention_share(model, tok, contexts, rows, new, rounds=3):
    """{L: (ms per decode token, share of it in attention)} for rows of their own contexts."""
    prompts = [p.prompt for p in make_synthetic(rows, 31_337, (1, 2), "lagged")]
    ctx = model.config.max_position_embeddings  # RoPE needs no table: time past the config's too
    model.config.max_position_embeddings = max(ctx, max(contexts) + new)
    out = {}
    for L in contexts:
        ids = [tok.encode(stream(p, L), add_special_tokens=False) for p in prompts]
        eng = Engine(model, tok, max_new_tokens=new, temperature=0.0, page_size=8, eos_ids=[-1])
        best = None
        for _ in range(rounds):
            eng.clock = {"attn": 0.0, "select": 0.0}
            with torch.no_grad():
                t = eng.generate(ids, 1, seed=0).timings
            got = (1e3 * t["decode_s"] / t["new_tokens"], eng.clock["attn"] / t["decode_s"])
            best = got if best is None or got[0] < best[0] else best
        out[L] = best
        print(f"context {L}: {best[0]:.3f} ms a token, attention {best[1]:.0%}", flush=True)
    model.config.max_position_embeddings = ctx
    return out


def check(cfg, model, tok, prompts, sched):
    """One sparse rollout at the schedule: (pages read of dense, p5 alpha per bin, mean context)."""
    ro, p5 = sparse_tail(model, tok, prompts, sched, len(sched.table), cfg.group_size, cfg.seed,
                         20, cfg.max_new_tokens, cfg.temperature, cfg.page_size, cfg.alpha_topk,
                         cfg.kv_quantile, scorer=cfg.kv_scorer, dense_layers=cfg.dense_layers,
                         rescore_every=cfg.kv_rescore_every)
    t = ro.timings
    ctx = (ro.budget_dense[ro.mask].float().mean().item()) * cfg.page_size
    return t["pages_read"] / max(1, t["pages_dense"]), p5, ctx


def run(quick, cmd):
    """-> the two tables, each with its head."""
    hw = hardware()
    root = tempfile.mkdtemp(prefix="zeros-bench-regime-")
    small = ["--sft_steps=10", "--sft_init=", "--calib_prompts=2", "--group_size=2",  # no curriculum
             "--max_new_tokens=96", "--difficulty=(1,2)", f"--out_dir={root}/quick"]
    cfg = parse_config(["configs/lagged.py"] + (small if quick else []))
    try:
        model, tok = build_policy(cfg, torch.device("cpu"), print)
    finally:  # the quick warm start is this run's only
        shutil.rmtree(root, ignore_errors=True)
    model.eval()
    contexts = (128, 256) if quick else CONTEXTS
    share = attention_share(model, tok, contexts, 4 if quick else 32, 4 if quick else 32,
                            1 if quick else 3)
    pool, _ = load_problems(cfg)
    _, ids = encode_pool(tok, pool, cfg, model.config.max_position_embeddings, print)
    prompts = ids[:cfg.calib_prompts]
    found = []
    for ps, bp, k in PAGES:
        floor = cfg.kv_keep_first + cfg.kv_keep_recent  # every step reads these pages anyway
        cands = tuple(c for c in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256,
                                  384, 512) if c * ps <= 4096 and c * ps >= 16 and c >= floor)
        for sc in SCORERS:
            k_sc = 1 if sc == "oracle" else k  # the oracle reads every key each step anyway
            c = dataclasses.replace(cfg, page_size=ps, kv_bin_pages=bp, kv_scorer=sc,
                                    kv_rescore_every=k_sc, kv_candidates=cands)
            print(f"--- pages of {ps}, {sc}, scored every {k_sc}", flush=True)
            sched = calibrated_schedule(c, model, tok, prompts, print)
            read, p5, ctx = check(c, model, tok, prompts, sched)
            found.append((ps, bp, k_sc, sc, sched.table, read, p5, ctx))
    s_at = lambda ctx: min(share.items(), key=lambda kv: abs(kv[0] - ctx))[1][1]
    head1 = [f"Hardware: {hw}. Command: `{cmd}`. Dense decode of {cfg.n_layer}-layer "
             f"configs/lagged.py warm start, {4 if quick else 32} rows each with its own context, "
             f"greedy, pages of 8; best of {1 if quick else 3} rounds.", "",
             "| context (tokens) | dense decode ms per token | attention share |", "|---|---|---|"]
    rows1 = [f"| {L} | {ms:.3f} | {s:.0%} |" for L, (ms, s) in share.items()]
    fmt = lambda xs: " ".join("-" if x != x else f"{x:.2f}" for x in xs)
    head2 = ["", f"Calibration: {len(prompts)} prompts x {cfg.group_size} rollouts, p5 alpha >= "
             f"{cfg.kv_target} per bin, first {cfg.dense_layers} layer(s) dense; read fraction "
             f"and p5 from one rollout at the calibrated table.", "",
             "| pages | scorer | scored every | table (pages per bin) | read fraction | p5 alpha "
             "per bin at that table | mean context | ceiling, selection free |",
             "|---|---|---|---|---|---|---|---|"]
    rows2 = []
    for ps, bp, k_sc, sc, table, read, p5, ctx in found:
        s = s_at(ctx)
        rows2.append(f"| {ps} (bins of {bp * ps} tokens) | {sc} | {k_sc} | {table} | {read:.2f} | "
                     f"{fmt(p5)} | {ctx:.0f} | {1 / ((1 - s) + s * read):.2f}x |")
    return head1 + rows1 + head2 + rows2
