"""
bench/lowalpha.py: where low alpha falls on the long-CoT task (configs/lagged.py), by token type,
so that the scorer, the page size and the kept pages are chosen from it. A lagged completion is
lines of 32 pairs "v t" and a newline: v copies the digit written 256 tokens back (it needs a page
far behind), t adds v to the t before it (it needs the last 3 tokens), and the chain ends with "#"
and the answer. Per token type and per sparse setting: how many tokens, mean and p5 alpha, the
share of all tokens below 0.99, and the share of the summed TV sum_t (1 - alpha_t), the expected
partings, that the type carries.

Settings, one seeded sparse rollout each of the same prompts (the config's calibration prompts,
its group size), alpha against a dense forward of the same weights (exact: the vocabulary is
small):
    the floor (1 sink + 2 recent pages of 64, nothing else: no page left for a scorer to pick)
    4 pages (one picked) with the centroid, Quest and oracle scorers; 6 pages, centroid
    9 pages with 8 recent pages of 64 kept: 512 tokens, past the 256-token lag

Simplifications:
    1. One seeded rollout per setting: the rows differ between settings once a token differs, so
       the counts per type differ a little.
    2. The warm start `python train.py configs/lagged.py` cached is reused; otherwise it is built
       (about 30 minutes on 2 cores).

    python -m bench lowalpha --threads 1   # a few minutes, the warm start cached
    python -m bench lowalpha --quick       # a short warm start, short rollouts: a smoke run
"""

import dataclasses
import os
import shutil
import tempfile

import torch

from bench.common import hardware
from config import parse_config
from rollout import Engine
from sparsity import alpha_k, dense_alpha, fixed_budget
from tasks import LAG_WIDTH, encode_pool, load_problems
from warmstart import build_policy

TYPES = ("copy v (256 back)", "sum t (local)", "newline", "end (# and answer)")
# (name, pages a step, scorer, recent pages kept); the floor (1 sink + 2 recent) leaves the scorer
# nothing to pick, so the scorers are compared one page above it
SETTINGS = (("floor: 3 pages", 3, "centroid", 2),
            ("4 pages, centroid", 4, "centroid", 2),
            ("4 pages, quest", 4, "quest", 2),
            ("4 pages, oracle", 4, "oracle", 2),
            ("6 pages, centroid", 6, "centroid", 2),
            ("8 recent pages kept (9 read)", 9, "centroid", 8))


def token_types(text, n):
    """The type (an index into TYPES) of each of a completion's n tokens (one character each, the
    EOS last): by its column in a 65-token line, or the end once "#" is written."""
    out, end = [], text.find("#")
    for i in range(n):
        if end >= 0 and i >= end:
            out.append(3)
        else:
            col = i % (2 * LAG_WIDTH + 1)
            out.append(2 if col == 2 * LAG_WIDTH else col % 2)
    return out


def measure(model, tok, prompt_ids, cfg, pages, scorer, recent, seed=0):
    """One sparse rollout at a fixed budget -> {type: alpha values (tensor)}."""
    eng = Engine(model, tok, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                 page_size=cfg.page_size, sparse=fixed_budget(pages), scorer=scorer,
                 dense_layers=cfg.dense_layers, rescore_every=cfg.kv_rescore_every,
                 keep_recent=recent, topk_logprobs=alpha_k(model.config.vocab_size))
    ro = eng.generate(prompt_ids, cfg.group_size, seed=seed)
    alpha = dense_alpha(model, prompt_ids, ro, cfg.temperature)
    by = {t: [] for t in range(len(TYPES))}
    for i in range(len(ro)):
        n = int(ro.mask[i].sum())
        for j, t in enumerate(token_types(ro.texts[i], n)):
            by[t].append(alpha[i, j].item())
    return {t: torch.tensor(v) for t, v in by.items()}, ro.timings


def run(quick, cmd):
    args = ["configs/lagged.py", "--sft_seed=0", f"--threads={torch.get_num_threads()}"]
    tmp = tempfile.mkdtemp(prefix="zeros-bench-lowalpha-")
    if quick:
        args += ["--sft_steps=10", "--sft_init=", "--max_new_tokens=200", "--calib_prompts=1",
                 "--group_size=2", f"--out_dir={tmp}/run"]
    cfg = parse_config(args)
    # the warm start is cached in warmstart.cache_root() (out/warmstart-cache): build_policy writes its
    # tokenizer to the out_dir it is given, a folder of its own removed at the end
    tok_dir = f"{os.path.dirname(cfg.out_dir) or '.'}/lowalpha-tok"
    try:
        model, tok = build_policy(dataclasses.replace(cfg, out_dir=tok_dir), torch.device("cpu"),
                                  print)
        problems, _ = load_problems(cfg)
        _, ids = encode_pool(tok, problems[:cfg.calib_prompts], cfg,
                             model.config.max_position_embeddings, print)
        rows = []
        for name, pages, scorer, recent in SETTINGS:
            by, t = measure(model.eval(), tok, ids, cfg, pages, scorer, recent, cfg.seed)
            tv = sum(float((1 - v).sum()) for v in by.values())
            read = t["pages_read"] / max(1, t["pages_dense"])
            for k, label in enumerate(TYPES):
                v = by[k]
                if not len(v):
                    continue
                rows.append(f"| {name} | {read:.2f} | {label} | {len(v)} | {v.mean():.4f} | "
                            f"{v.quantile(0.05):.3f} | {(v < 0.99).float().mean():.3f} | "
                            f"{float((1 - v).sum()) / max(1e-9, tv):.2f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tok_dir, ignore_errors=True)
    head = [f"Hardware: {hardware()}. Command: `{cmd}`. configs/lagged.py's warm start, "
            f"{cfg.calib_prompts} prompts x {cfg.group_size} rollouts per setting (seed "
            f"{cfg.seed}), pages of {cfg.page_size} tokens, first {cfg.dense_layers} layer(s) "
            f"dense, scored once in {cfg.kv_rescore_every} steps; alpha exact against a dense "
            f"forward.", "",
            "| setting | KV pages read (of dense) | token type | tokens | mean alpha | p5 alpha | "
            "share below 0.99 | share of the summed TV |", "|---|---|---|---|---|---|---|---|"]
    return head + rows
