"""
bench/sparsecost.py: stage 2, where a long-CoT decode step's time goes. The same prompts of the CPU
long-CoT warm start (configs/longcot.py, built if missing) generated four ways: dense, at a fixed
8 pages a step, at the table calibrated for p5 alpha >= kv_target, and at
the table calibrated with the oracle scorer (the true attention mass per page: about the fewest
pages a query-aware scorer can hold the threshold with; it reads every key, so its time is no
speedup). The engine's clock splits each decode into attention (gather + SDPA, or the kernel), page
selection and the rest. Per arm: pages read, ms per token in each part, the speedup over dense, and
the ceiling its read fraction allows, 1 / ((1 - s) + s * r), s the attention share of dense decode,
r the fraction.

Simplifications:
    1. The ceiling assumes page selection is free and the rest of the step unchanged.
    2. The arms take turns, three rounds with the same seed (the same tokens); each arm's fastest
       run counts. The timings vary by 20-30% run to run on a shared virtual machine; the read
       fractions, and so the ceilings, do not.
    3. The split comes from the engine's own `clock` (the seconds it spends in decode attention and
       in page selection); the rest is the decode time less those two.

    python -m bench sparsecost --threads 1    # about 4 minutes on 2 cores
    python -m bench sparsecost --quick        # 2 prompts, 64 new tokens, a short warm start
"""

import dataclasses
import os
import shutil
import tempfile

import torch

import rollout
from bench.common import hardware
from calibrate import Schedule, kv_budget
from config import parse_config
from tasks import encode_pool, load_problems
from warmstart import build_policy

FIXED = 8  # pages of 8 tokens a decode step: below what calibration asks of the later bins


def run(quick, cmd):
    """-> the table, its own head included."""
    hw = hardware()
    root = tempfile.mkdtemp(prefix="zeros-bench-sparsecost-")  # quick warm start, calibration files
    small = ["--sft_steps=20", "--calib_prompts=2", "--max_new_tokens=64",
             f"--out_dir={root}/quick"]
    cfg = parse_config(["configs/longcot.py"] + (small if quick else []))
    try:
        model, tok = build_policy(cfg, torch.device("cpu"), print)
        pool, _ = load_problems(cfg)
        pool, ids = encode_pool(tok, pool, cfg, model.config.max_position_embeddings, print)
        n = 2 if quick else cfg.prompts_per_step
        prompts = [ids[i] for i in range(n)]
        scorers = (cfg.kv_scorer, "oracle")
        for sc in scorers:
            os.makedirs(f"{root}/{sc}")
        calib = {sc: kv_budget(dataclasses.replace(cfg, kv_budget="calibrate", kv_scorer=sc,
                                                   out_dir=f"{root}/{sc}"), model, tok, ids, print)
                 for sc in scorers}
        arms = {"dense": (False, cfg.kv_scorer),
                f"fixed {FIXED} pages": (Schedule([FIXED], cfg.kv_bin_pages), cfg.kv_scorer),
                f"calibrated table {calib[cfg.kv_scorer].table}": (calib[cfg.kv_scorer],
                                                                   cfg.kv_scorer),
                f"oracle scorer (reads every key), its calibrated table {calib['oracle'].table}":
                    (calib["oracle"], "oracle")}
        engines = {name: rollout.Engine(model, tok, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                                        [cfg.stop], sparse=budget, page_size=cfg.page_size,
                                        scorer=scorer, dense_layers=cfg.dense_layers)
                   for name, (budget, scorer) in arms.items()}
        for eng in engines.values():
            eng.generate(prompts[:1], cfg.group_size, seed=1)  # warm-up, untimed (no clock)
        res = {}
        for _ in range(1 if quick else 3):  # the arms take turns; the same seed, the same tokens
            for name, eng in engines.items():
                eng.clock = clock = {"attn": 0.0, "select": 0.0}
                t = eng.generate(prompts, cfg.group_size, seed=0).timings
                eng.clock = None
                if name not in res or t["decode_s"] < res[name]["decode"]:  # each arm's fastest
                    res[name] = dict(tok=t["new_tokens"], decode=t["decode_s"], attn=clock["attn"],
                                     select=clock["select"],
                                     read=t["pages_read"] / max(1, t["pages_dense"]))
        for name, r in res.items():
            print(name, r, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    d = res["dense"]
    share = d["attn"] / d["decode"]
    ms = lambda r, k: 1e3 * r[k] / r["tok"]
    rows = [f"Hardware: {hw}. Command: `{cmd}`. {n} prompts x {cfg.group_size} rollouts of the "
            f"long-CoT warm start, sampled, up to {cfg.max_new_tokens} new tokens, pages of "
            f"{cfg.page_size}, first {cfg.dense_layers} layer(s) dense. Dense decode spends "
            f"{share:.0%} of its time in attention.", "",
            "| decode | KV pages read (of dense) | decode ms per token | attention (gather + "
            "SDPA) | page selection | the rest | speedup vs dense (per token) | ceiling at this "
            "read fraction, selection free |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        rest = ms(r, "decode") - ms(r, "attn") - ms(r, "select")
        rows.append(f"| {name} | {r['read']:.2f} | {ms(r, 'decode'):.3f} | {ms(r, 'attn'):.3f} | "
                    f"{ms(r, 'select'):.3f} | {rest:.3f} | "
                    f"{ms(d, 'decode') / ms(r, 'decode'):.2f}x | "
                    f"{1 / ((1 - share) + share * r['read']):.2f}x |")
    return rows
