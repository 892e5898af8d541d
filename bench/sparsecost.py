"""
bench/sparsecost.py: stage 2, where a long-CoT decode step's time goes. The same prompts of the CPU
long-CoT warm start (configs/longcot.py, built if missing) generated four ways: dense, at a fixed
8 pages a step (each also with the eager step, decode.py's reference, beside the default's fused
one on a CPU: what the fused step saves), at the table calibrated for p5 alpha >= kv_target, and at
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
       in page selection); the rest is the decode time less those two: the time outside attention.
    4. The fixed cost per decode token, counted in one more untimed call of each arm
       (`Dispatched`): the PyTorch ops it dispatches (each a kernel launch on a GPU; a C++ kernel
       call is none of them) and its host syncs (reads of device values on the host: .item(),
       .tolist(), ops whose size depends on values; each counted where device work came before
       it, as a GPU would wait there). Per decode step (a forward of all live rows: a dense or
       sparse step, a speculative draft step or verify): the call's counts over its forwards,
       the prefill's ops among them.

    python -m bench sparsecost --threads 1    # about 4 minutes on 2 cores
    python -m bench sparsecost --quick        # 2 prompts, 64 new tokens, a short warm start
"""

import dataclasses
import os
import shutil
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rollout
from bench.common import hardware
from calibrate import Schedule, kv_budget
from config import parse_config
from tasks import encode_pool, load_problems
from warmstart import build_policy

FIXED = 8  # pages of 8 tokens a decode step: below what calibration asks of the later bins
# ops whose result the host reads, or whose output size the data decides: a GPU syncs at each
SYNC_OPS = {"_local_scalar_dense", "nonzero", "unique", "_unique2", "masked_select",
            "unique_consecutive"}


class Dispatched(TorchDispatchMode):
    """Counts what runs inside it: ops, the aten ops dispatched, and syncs, the host's reads of
    device values (.item(), .tolist() and SYNC_OPS) that follow device work, where a GPU would
    block. On a CPU nothing blocks; these are the points that would."""

    def __init__(self):
        super().__init__()
        self.ops = self.syncs = 0
        self.dirty = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNC_OPS:
            self.read()
        self.ops, self.dirty = self.ops + 1, True
        return func(*args, **(kwargs or {}))

    def read(self):
        self.syncs, self.dirty = self.syncs + self.dirty, False

    def __enter__(self):
        tolist, counter = torch.Tensor.tolist, self

        def counted(t, *a):  # no op of its own: the read is counted here
            counter.read()
            return tolist(t, *a)
        self.restore, torch.Tensor.tolist = tolist, counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.restore
        return super().__exit__(*exc)


def dispatch_counts(eng, prompts, G, seed=0):
    """-> (ops, host syncs) per decode step of one generate call of `eng` (untimed): its static
    decode steps and (speculative) verifies."""
    with torch.no_grad(), Dispatched() as d:
        ro = eng.generate(prompts, G, seed=seed)
    t = ro.timings
    steps = t.get("decode_steps")  # an engine that does not count them: one a token of the
    if steps is None:  # longest row but its first, or k a verify
        steps = t["k"] * t["verify_calls"] if "k" in t else int(ro.mask.sum(1).max()) - 1
    steps += t.get("verify_calls", 0)
    return d.ops / max(1, steps), d.syncs / max(1, steps)


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
        fixed = Schedule([FIXED], cfg.kv_bin_pages)
        arms = {"dense": (False, cfg.kv_scorer, "auto"),
                "dense, eager step": (False, cfg.kv_scorer, "eager"),
                f"fixed {FIXED} pages": (fixed, cfg.kv_scorer, "auto"),
                f"fixed {FIXED} pages, eager step": (fixed, cfg.kv_scorer, "eager"),
                f"calibrated table {calib[cfg.kv_scorer].table}": (calib[cfg.kv_scorer],
                                                                   cfg.kv_scorer, "auto"),
                f"oracle scorer (reads every key), its calibrated table {calib['oracle'].table}":
                    (calib["oracle"], "oracle", "auto")}
        engines = {name: rollout.Engine(model, tok, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                                        [cfg.stop], sparse=budget, page_size=cfg.page_size,
                                        scorer=scorer, dense_layers=cfg.dense_layers, step=step)
                   for name, (budget, scorer, step) in arms.items()}
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
        for name, eng in engines.items():  # the fixed cost, untimed
            res[name]["ops"], res[name]["syncs"] = dispatch_counts(eng, prompts, cfg.group_size)
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
            "SDPA) | page selection | outside attention (share) | ops dispatched / step | "
            "host syncs / step | speedup vs dense (per token) | ceiling at this read "
            "fraction, selection free |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        rest = ms(r, "decode") - ms(r, "attn") - ms(r, "select")
        rows.append(f"| {name} | {r['read']:.2f} | {ms(r, 'decode'):.3f} | {ms(r, 'attn'):.3f} | "
                    f"{ms(r, 'select'):.3f} | {rest:.3f} ({rest / ms(r, 'decode'):.0%}) | "
                    f"{r['ops']:.0f} | {r['syncs']:.2f} | "
                    f"{ms(d, 'decode') / ms(r, 'decode'):.2f}x | "
                    f"{1 / ((1 - share) + share * r['read']):.2f}x |")
    return rows
