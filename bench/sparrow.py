"""
bench/sparrow.py: stage 2 in the loop, the miniature Sparrow experiment on the CPU long-CoT task
(configs/longcot.py). Five training runs from the same warm start, seed and step count:
    (a) dense, (b) a fixed aggressive budget (8 pages a step), (c) the p5-held schedule (calibrated
    at the start, then held by the controller), (d) (c) + DistillSparse, (e) (b) + DistillSparse:
    what the adapter does to the tail at a budget that misses the threshold.
Per run: training reward, held-out accuracy, mean and p5 alpha over all tokens and per bin of cached
length, the KV pages read, rollout time per token, and the in-run speedup (a dense rollout of the
same prompts, same weights and seed, every 5 steps). Writes assets/sparrow.png (reward, accuracy and
alpha per bin).

Simplifications:
    1. alpha is Sparrow's per-position acceptance rate that the run logs (1 - TV between the
       sparse rollout's and the dense policy's next-token distributions, exact over this small
       vocabulary), over every generated row; p5 is its 5th percentile, per bin and over all tokens.
    2. The warm start that `python train.py configs/longcot.py` cached in out/longcot is reused when
       present; otherwise the first run builds it and the others copy it.
    3. The runs' policies differ (each trains on its own rollouts), so per-bin figures across runs
       are noisy; tests/test_distill.py checks DistillSparse on a fixed batch.

    python -m bench sparrow --threads 1       # about 15 minutes at 1 thread
    python -m bench sparrow --quick           # 4 steps, a short warm start: a smoke run
"""

import dataclasses
import os
import shutil
import tempfile

import train
from bench.common import hardware
from config import parse_config
from warmstart import cache_path

FIXED = 8  # pages of 8 tokens a decode step for run (b): below what calibration asks of later bins


def arms(fixed):
    """{run name: its command-line overrides}."""
    held = ["--kv_budget=calibrate", "--kv_controller=true", "--kv_compare_every=5"]
    table = [f"--kv_budget=table:{fixed}", "--kv_controller=false", "--kv_compare_every=5"]
    return {"(a) dense": ["--kv_budget=dense", "--kv_controller=false"],
            f"(b) fixed {fixed} pages": table,
            "(c) p5-held schedule": held,
            "(d) (c) + DistillSparse": held + ["--distill_r=8"],
            "(e) (b) + DistillSparse": table + ["--distill_r=8"]}


def summary(history):
    """One run's figures from its per-step records."""
    recs = history["records"]

    def nanmean(xs):  # the mean of the values that are not NaN (empty bins, unmeasured steps)
        v = [x for x in xs if x == x]
        return sum(v) / len(v) if v else float("nan")

    bins = [r["alpha_bins"] for r in recs if "alpha_bins" in r]
    nb = max((len(b["p5"]) for b in bins), default=0)
    per_bin = {k: [nanmean([b[k][i] for b in bins if i < len(b[k])]) for i in range(nb)]
               for k in ("mean", "p5")}
    k = max(1, len(recs) // 5)
    speed = [r["rollout_speedup"] for r in recs if "rollout_speedup" in r]
    return {"reward0": nanmean([r["reward"] for r in recs[:k]]),
            "reward1": nanmean([r["reward"] for r in recs[-k:]]),
            "acc0": history["acc0"], "acc": [r["acc"] for r in recs if "acc" in r][-1],
            "alpha": nanmean([r.get("alpha_mean", float("nan")) for r in recs]),  # dense: none
            "p5": nanmean([r.get("alpha_p5", float("nan")) for r in recs]),
            "bins": per_bin, "kv_read": nanmean([r["kv_read"] for r in recs]),
            "gen_s": sum(r["gen_s"] for r in recs), "tokens": sum(r["new_tokens"] for r in recs),
            "speedup": nanmean(speed), "n_speed": len(speed), "table": recs[-1].get("kv_table"),
            "curve": [(r["step"], r["reward"], r.get("acc")) for r in recs]}


def plot(results, path, threshold):
    """Three panels, one colour per run: training reward, held-out accuracy, alpha per bin."""
    # imported here: matplotlib draws only this picture, and Agg must be set before pyplot loads
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for i, (name, s) in enumerate(results.items()):
        c = f"C{i}"
        steps = [x[0] for x in s["curve"]]
        ax[0].plot(steps, [x[1] for x in s["curve"]], color=c, label=name)
        ev = [(x[0], x[2]) for x in s["curve"] if x[2] is not None]
        ax[1].plot([-1] + [e[0] for e in ev], [s["acc0"]] + [e[1] for e in ev], color=c,
                   marker="o", label=name)
        if s["bins"]["p5"]:
            ax[2].plot(range(len(s["bins"]["p5"])), s["bins"]["p5"], color=c, marker="o",
                       label=f"{name}: p5")
            ax[2].plot(range(len(s["bins"]["mean"])), s["bins"]["mean"], color=c, ls="--",
                       label=f"{name}: mean")
    ax[2].axhline(threshold, color="k", lw=0.8, ls=":")
    titles = ("training reward", "held-out greedy accuracy", "alpha per bin of cached length")
    for a, t in zip(ax, titles):
        a.set_title(t)
        a.legend(fontsize=7)
    ax[0].set_xlabel("step"), ax[1].set_xlabel("step (-1: the warm start)")
    ax[2].set_xlabel("bin of cached length; dotted: the threshold")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(quick, cmd):
    """-> the table, its own head included (its columns differ from the other sections')."""
    hw = hardware()
    small = ["--steps=4", "--sft_steps=40", "--n_eval=16", "--eval_every=2", "--calib_prompts=4"]
    args = ["configs/longcot.py", "--plot=false"] + (small if quick else [])
    root = tempfile.mkdtemp(prefix="zeros-bench-sparrow-")
    cfg = parse_config(args)
    results = {}
    cached = cache_path(cfg)  # built by `python train.py configs/longcot.py`, if it ran
    try:
        if os.path.isdir(cached):  # the arms' folders share root's cache: one warm start for all
            shutil.copytree(cached, cache_path(dataclasses.replace(cfg, out_dir=f"{root}/arm0")))
        for i, (name, extra) in enumerate(arms(FIXED).items()):
            out = f"{root}/arm{i}"
            print(f"--- {name}", flush=True)
            results[name] = summary(train.main(args + extra + [f"--out_dir={out}"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs("assets", exist_ok=True)
    plot(results, "assets/sparrow.png", cfg.kv_target)
    dense_ms = 1e3 * results["(a) dense"]["gen_s"] / results["(a) dense"]["tokens"]
    fmt_bins = lambda xs: " ".join("-" if x != x else f"{x:.2f}" for x in xs) or "-"
    rows = []
    for name, s in results.items():
        ms = 1e3 * s["gen_s"] / s["tokens"]
        speed = f"{s['speedup']:.2f}x ({s['n_speed']} steps)" if s["n_speed"] else "-"
        tail = "-" if s["alpha"] != s["alpha"] else f"{s['alpha']:.3f} / {s['p5']:.3f}"  # dense
        rows.append(f"| {name} | {s['reward0']:.3f} -> {s['reward1']:.3f} | "
                    f"{s['acc0']:.3f} -> {s['acc']:.3f} | {tail} | "
                    f"{fmt_bins(s['bins']['mean'])} | {fmt_bins(s['bins']['p5'])} | "
                    f"{s['kv_read']:.2f} | {ms:.2f} ms ({dense_ms / ms:.2f}x) | {speed} | "
                    f"{s['table'] or '-'} |")
    head = [f"Hardware: {hw}. Command: `{cmd}`. {cfg.steps} steps, {cfg.prompts_per_step} x "
            f"{cfg.group_size} rollouts per step, threshold p5 alpha >= {cfg.kv_target}, bins of "
            f"{cfg.kv_bin_pages} pages of {cfg.page_size} tokens, first {cfg.dense_layers} "
            f"layer(s) dense.", "",
            "| run | reward, first -> last fifth of the steps | held-out accuracy, start -> end | "
            "alpha mean / p5 (all tokens) | mean alpha per bin | p5 alpha per bin | KV pages read "
            "(of dense) | rollout time per token (vs the dense run) | rollout speedup vs dense, "
            "same step, same weights | table at the end |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    return head + rows
