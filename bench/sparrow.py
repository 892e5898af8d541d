"""
bench/sparrow.py: stage 2 in the loop, the miniature Sparrow experiment on the long-CoT config
(configs/lagged.py: 1,000-3,100 generated tokens a rollout). Five training runs from one warm start,
per seed:
    (a) dense, (b) a fixed aggressive budget (FIXED pages a step), (c) the p5-held schedule
    (calibrated at the start, then held by the controller), (d) (c) + DistillSparse, (e) (b) +
    DistillSparse: what the adapter does to the tail at a budget that misses the threshold.
Per arm, mean and standard deviation over the seeds: training reward, held-out accuracy, mean and p5
alpha over all tokens, and per bin of cached length, the KV pages read, rollout time per token, and
the in-run speedup (a dense rollout of the same prompts, same weights and seed, every 5 steps).
Writes assets/sparrow.png (reward, accuracy and alpha per bin; mean over seeds, a band of one
standard deviation).

Simplifications:
    1. alpha is Sparrow's per-position acceptance rate that the run logs (1 - TV between the
       sparse rollout's and the dense policy's next-token distributions, exact over this small
       vocabulary), over every generated row; p5 is its 5th percentile, per bin and over all tokens.
    2. Every run starts from one warm start (sft_seed 0): the seed varies the RL run, its pool,
       held-out set and sampling. The warm start that `python train.py configs/lagged.py` cached in
       out/ is reused when present; otherwise the first run builds it (about 20 minutes on 2 cores).
    3. The runs' policies differ (each trains on its own rollouts), so per-bin figures across runs
       are noisy; tests/test_distill.py checks DistillSparse on a fixed batch.

    python -m bench sparrow --threads 1       # hours at 1 thread: 15 runs of 1,000-3,000 tokens
    python -m bench sparrow --quick           # 2 steps, a short warm start: a smoke run
"""

import dataclasses
import os
import shutil
import tempfile

import train
from bench.common import hardware
from config import parse_config
from warmstart import cache_path

CONFIG = "configs/lagged.py"
SEEDS = (0, 1, 2)
# pages a decode step for run (b): with pages of 64, only the pages every step reads (the first, the
# last full one and the partial one), so no page 256 tokens back unless it is one of those
FIXED = 3


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


def spread(xs):
    """(mean, sample standard deviation) of the values that are not NaN; (NaN, NaN) for none."""
    v = [x for x in xs if x == x]
    if not v:
        return float("nan"), float("nan")
    m = sum(v) / len(v)
    return m, (sum((x - m) ** 2 for x in v) / (len(v) - 1)) ** 0.5 if len(v) > 1 else 0.0


def aggregate(runs):
    """One arm's seeds (summaries) -> {figure: (mean, sd)}, per-bin means, and the mean curve."""
    keys = ("reward0", "reward1", "acc0", "acc", "alpha", "p5", "kv_read", "speedup")
    out = {k: spread([r[k] for r in runs]) for k in keys}
    out["ms"] = spread([1e3 * r["gen_s"] / r["tokens"] for r in runs])
    nb = max(len(r["bins"]["p5"]) for r in runs)
    out["bins"] = {k: [spread([r["bins"][k][i] for r in runs if i < len(r["bins"][k])])[0]
                       for i in range(nb)] for k in ("mean", "p5")}
    steps = sorted({x[0] for r in runs for x in r["curve"]})
    out["curve"] = [(t, spread([x[1] for r in runs for x in r["curve"] if x[0] == t]),
                     spread([x[2] for r in runs for x in r["curve"] if x[0] == t
                             and x[2] is not None])) for t in steps]
    out["tables"] = [r["table"] for r in runs]
    return out


def plot(results, path, threshold):
    """Three panels, one colour per arm, the mean over seeds with a band of one standard
    deviation: training reward, held-out accuracy, p5 and mean alpha per bin."""
    # imported here: matplotlib draws only this picture, and Agg must be set before pyplot loads
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for i, (name, a) in enumerate(results.items()):
        c = f"C{i}"
        for j, panel in ((1, ax[0]), (2, ax[1])):
            # (step, (mean, sd)) of the reward (j = 1) or the accuracy (j = 2), where measured
            pts = [(t, figs[j - 1]) for t, *figs in a["curve"] if figs[j - 1][0] == figs[j - 1][0]]
            if j == 2:
                pts = [(-1, a["acc0"])] + pts
            xs, m = [p[0] for p in pts], [p[1][0] for p in pts]
            sd = [p[1][1] for p in pts]
            panel.plot(xs, m, color=c, marker="o" if j == 2 else None, label=name)
            panel.fill_between(xs, [x - y for x, y in zip(m, sd)], [x + y for x, y in zip(m, sd)],
                               color=c, alpha=0.15)
        if a["bins"]["p5"]:
            ax[2].plot(range(len(a["bins"]["p5"])), a["bins"]["p5"], color=c, marker="o",
                       label=f"{name}: p5")
            ax[2].plot(range(len(a["bins"]["mean"])), a["bins"]["mean"], color=c, ls="--",
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
    small = ["--steps=2", "--sft_steps=10", "--sft_init=", "--n_eval=4", "--eval_every=1",
             "--calib_prompts=2", "--prompts_per_step=2", "--group_size=2", "--max_new_tokens=96",
             "--difficulty=(1,2)"]
    seeds = SEEDS[:2] if quick else SEEDS
    args = [CONFIG, "--plot=false", "--sft_seed=0"] + (small if quick else [])
    root = tempfile.mkdtemp(prefix="zeros-bench-sparrow-")
    cfg = parse_config(args)
    runs = {name: [] for name in arms(FIXED)}
    cached = cache_path(cfg)  # built by `python train.py configs/lagged.py`, if it ran
    try:
        if os.path.isdir(cached) and not quick:  # every run shares root's cache: one warm start
            shutil.copytree(cached, cache_path(dataclasses.replace(cfg, out_dir=f"{root}/x")))
        for seed in seeds:
            for i, (name, extra) in enumerate(arms(FIXED).items()):
                out = f"{root}/arm{i}-seed{seed}"
                print(f"--- {name}, seed {seed}", flush=True)
                hist = train.main(args + extra + [f"--seed={seed}", f"--out_dir={out}"])
                runs[name].append(summary(hist))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {name: aggregate(r) for name, r in runs.items()}
    os.makedirs("assets", exist_ok=True)
    plot(results, "assets/sparrow.png", cfg.kv_target)
    pm = lambda m_sd, f=".3f": "-" if m_sd[0] != m_sd[0] else f"{m_sd[0]:{f}} ± {m_sd[1]:{f}}"
    fmt_bins = lambda xs: " ".join("-" if x != x else f"{x:.2f}" for x in xs) or "-"
    dense_ms = results["(a) dense"]["ms"][0]
    rows = []
    for name, a in results.items():
        rows.append(f"| {name} | {pm(a['reward0'])} -> {pm(a['reward1'])} | "
                    f"{pm(a['acc0'])} -> {pm(a['acc'])} | {pm(a['alpha'])} | {pm(a['p5'])} | "
                    f"{fmt_bins(a['bins']['mean'])} | {fmt_bins(a['bins']['p5'])} | "
                    f"{pm(a['kv_read'], '.2f')} | "
                    f"{a['ms'][0]:.3f} ms ({dense_ms / a['ms'][0]:.2f}x) | "
                    f"{pm(a['speedup'], '.2f')} | {a['tables'][0] or '-'} |")
    head = [f"Hardware: {hw}. Command: `{cmd}`. {CONFIG}, seeds {', '.join(map(str, seeds))} "
            f"(one warm start, sft_seed 0; the seed varies the pool, the held-out set and the "
            f"sampling), {cfg.steps} steps of {cfg.prompts_per_step} x {cfg.group_size} rollouts, "
            f"threshold p5 alpha >= {cfg.kv_target}, bins of {cfg.kv_bin_pages} pages of "
            f"{cfg.page_size} tokens, first {cfg.dense_layers} layer(s) dense. Mean ± standard "
            f"deviation over the seeds.", "",
            "| run | reward, first -> last fifth of the steps | held-out accuracy, start -> end | "
            "alpha mean (all tokens) | alpha p5 (all tokens) | mean alpha per bin | p5 alpha per "
            "bin | KV pages read (of dense) | rollout time per token (vs the dense runs) | rollout "
            "speedup vs dense, same step, same weights | table at the end (first seed) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    return head + rows
