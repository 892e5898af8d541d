"""
bench/sparrow.py: stage 2 in the loop, the miniature Sparrow experiment on the long-CoT config
(configs/lagged.py: 1,000-1,800 generated tokens a rollout). Five training runs from one warm start,
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

    4. Each run is its own process (python -m bench.sparrow RECORD ARGS...) that writes its summary
       and arguments to bench/sparrow_runs/armI-seedS.json (its log beside it, not kept in git).
       A full bench skips the runs already recorded with the same arguments, so one that stopped
       part way resumes, and --jobs 0 tabulates the records without running anything. A change
       of code is not seen: delete the records to rerun them.

    python -m bench sparrow --threads 1 --jobs 2   # hours: 15 runs, 2 at a time, 1 thread each
    python -m bench sparrow --jobs 0               # the table and plot of the runs recorded so far
    python -m bench sparrow --quick                # 2 steps, a short warm start: a smoke run
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import train
from bench.common import hardware
from config import parse_config
from warmstart import build_policy

CONFIG = "configs/lagged.py"
SEEDS = (0, 1, 2)
# pages a decode step for run (b): with pages of 64, only the pages every step reads (the first, the
# last full one and the partial one), so no page 256 tokens back unless it is one of those
FIXED = 3
# each full run's record (its arguments and summary): the table and plot are rebuilt from these,
# and a bench that stopped part way resumes at the first run not recorded
RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sparrow_runs")


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


def one(path, args):
    """One training run, train.main(args); its summary, with its arguments, written to path."""
    hist = train.main(args)
    with open(path + ".tmp", "w") as f:
        json.dump({"args": args, "summary": summary(hist)}, f)
    os.replace(path + ".tmp", path)  # a run killed mid-write leaves no record, so it reruns


def path_of(args, flag):
    """The value of `flag` (e.g. "--out_dir=") in a list of command-line arguments."""
    return next(x[len(flag):] for x in args if x.startswith(flag))


def same_run(a, b):
    """Two runs' arguments agree on all that shapes the result (not out_dir or threads)."""
    keep = lambda args: [x for x in args if not x.startswith(("--out_dir=", "--threads="))]
    return keep(a) == keep(b)


def plan_runs(args, seeds, records, root):
    """[(arm, seed, its record's path, its train.py arguments)], seed by seed."""
    return [(name, seed, f"{records}/arm{i}-seed{seed}.json",
             args + extra + [f"--seed={seed}", f"--out_dir={root}/sparrow-arm{i}-seed{seed}"])
            for seed in seeds for i, (name, extra) in enumerate(arms(FIXED).items())]


def recorded(path, args):
    """The summary recorded at path by a run of the same arguments (same_run), else None."""
    try:
        with open(path) as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    return rec["summary"] if same_run(rec["args"], args) else None


def run(quick, cmd, jobs=1):
    """-> the table, its own head included (its columns differ from the other sections')."""
    hw = hardware()
    small = ["--steps=2", "--sft_steps=10", "--sft_init=", "--n_eval=4", "--eval_every=1",
             "--calib_prompts=2", "--prompts_per_step=2", "--group_size=2", "--max_new_tokens=96",
             "--difficulty=(1,2)"]
    seeds = SEEDS[:2] if quick else SEEDS
    threads = f"--threads={torch.get_num_threads()}"
    args = [CONFIG, "--plot=false", "--sft_seed=0", threads] + (small if quick else [])
    cfg = parse_config(args)
    # a full run keeps each run's record in RUNS and skips the runs recorded with the same
    # arguments: the 15 runs take hours, and an interrupted bench resumes where it stopped
    tmp, live = tempfile.mkdtemp(prefix="zeros-bench-sparrow-"), []
    records, root = (tmp, tmp) if quick else (RUNS, os.path.dirname(cfg.out_dir) or ".")
    os.makedirs(records, exist_ok=True)
    plan = plan_runs(args, seeds, records, root)
    todo = [p for p in plan if recorded(p[2], p[3]) is None] if jobs else []
    print(f"{len(plan) - len(todo)} of {len(plan)} runs recorded in {os.path.relpath(records)}; "
          f"running {len(todo)}, {jobs} at a time (each one's log beside its record)", flush=True)
    try:
        if todo and jobs > 1:  # the runs share one warm start: build it before they start
            tok_dir = f"{root}/sparrow-warmstart"  # build_policy writes a tokenizer there
            build_policy(dataclasses.replace(cfg, out_dir=tok_dir), torch.device("cpu"), print)
            shutil.rmtree(tok_dir, ignore_errors=True)
        waiting, t0 = list(todo), time.time()
        while waiting or live:
            while waiting and len(live) < jobs:
                name, seed, path, a = waiting.pop(0)
                log = open(path[:-5] + ".log", "w")
                proc = subprocess.Popen([sys.executable, "-m", "bench.sparrow", path] + a,
                                        stdout=log, stderr=subprocess.STDOUT)
                live.append((proc, name, seed, path, a, log, time.time()))
            time.sleep(1)
            for item in [x for x in live if x[0].poll() is not None]:
                proc, name, seed, path, a, log, t = item
                live.remove(item)
                log.close()
                if proc.returncode:
                    raise RuntimeError(f"{name}, seed {seed} failed (exit {proc.returncode}): "
                                       f"see {path[:-5]}.log")
                shutil.rmtree(path_of(a, "--out_dir="), ignore_errors=True)  # its checkpoints
                print(f"[{len(todo) - len(waiting) - len(live)}/{len(todo)}] {name}, seed "
                      f"{seed}: {(time.time() - t) / 60:.1f} min ({(time.time() - t0) / 60:.0f} "
                      f"min in all)", flush=True)
        runs = {name: [r for n, _, path, a in plan if n == name
                       for r in [recorded(path, a)] if r is not None] for name in arms(FIXED)}
    finally:
        for proc, *_ in live:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    results = {name: aggregate(r) for name, r in runs.items() if r}  # --jobs 0: maybe not all
    os.makedirs("assets", exist_ok=True)
    plot(results, "assets/sparrow.png", cfg.kv_target)
    pm = lambda m_sd, f=".3f": "-" if m_sd[0] != m_sd[0] else f"{m_sd[0]:{f}} ± {m_sd[1]:{f}}"
    fmt_bins = lambda xs: " ".join("-" if x != x else f"{x:.2f}" for x in xs) or "-"
    dense_ms = results["(a) dense"]["ms"][0] if "(a) dense" in results else float("nan")
    rows = []
    for name, a in results.items():
        rows.append(f"| {name} | {len(runs[name])} | {pm(a['reward0'])} -> {pm(a['reward1'])} | "
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
            "| run | seeds | reward, first -> last fifth of the steps | held-out accuracy, start -> end | "
            "alpha mean (all tokens) | alpha p5 (all tokens) | mean alpha per bin | p5 alpha per "
            "bin | KV pages read (of dense) | rollout time per token (vs the dense runs) | rollout "
            "speedup vs dense, same step, same weights | table at the end (first seed) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    return head + rows


if __name__ == "__main__":  # one run, in its own process: python -m bench.sparrow RECORD ARGS...
    one(sys.argv[1], sys.argv[2:])
