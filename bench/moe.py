"""
bench/moe.py: router replay (R3) in the loop, on the tiny MoE (configs/tiny_moe.py). Two arms from
the same warm start, each over seeds 0, 1 and 2, with a low-precision rollout copy that generates
and records its experts:
    replay     router_replay = "update": logp_old's pass and the training forwards route through the
               rollout's experts (the gate weights from the trainer's router)
    no replay  router_replay = "off": the trainer routes by its own top-k
Every step, both arms measure the same things on the first try's rollouts (update.replay_mismatch):
the routing disagreement between the rollout and the trainer's forward (share of expert picks, share
of tokens with a different set in some layer), and the per-position mismatch (alpha = 1 - TV, exact
over the whole vocabulary; KL(rollout || trainer)) with the trainer's own routing and with
replay. The table reports, per arm, what its training forward saw (own routing for no replay,
replayed for replay), the IS weights cut, the reward curve and held-out accuracy. Writes
assets/moe.png (full run) or out/bench_moe.png (--quick): reward, disagreement, alpha p5, KL per
step, means over the seeds.

Simplifications:
    1. One warm start (seed 0's SFT, cached) for every run; the seed sets the RL run (sampling,
       prompts), not the SFT. A warm start built by `python train.py configs/tiny_moe.py` is reused.
    2. The runs stop at step `stop_at` of configs/tiny_moe.py's schedule, and are `train.main` calls
       in this process, one after another; wall time counts the runs, not the warm start.
    3. The quick run is a smoke run of a one-layer MoE with a 3-step warm start: its figures mean
       nothing.

    python -m bench moe --threads 1 --write-results    # about 25 minutes on 2 cores
    python -m bench moe --quick                         # one seed, 2 steps: a smoke run
"""

import json
import os
import shutil
import tempfile
import time

import torch

import train
from bench.common import TABLE_HEAD, hardware
from config import parse_config
from warmstart import build_policy, cache_path, sft_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_moe.py")
ARMS = {"replay": ["--router_replay=update"], "no replay": ["--router_replay=off"]}
COPY = "fp8"  # the rollout copy of both arms
ARGS = {True: ["--n_layer=1", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--n_expert=4",
               "--moe_ffn=16", "--sft_steps=3", "--n_train=64", "--n_eval=8", "--stop_at=2",
               "--prompts_per_step=4", "--group_size=4", "--max_new_tokens=12",
               "--difficulty=(1,2)", "--micro_batch=8"],
        False: ["--stop_at=10", "--n_eval=200"]}


def share_warm_start(cfg, seed_cfg):
    """Seed `seed_cfg`'s run reads `cfg`'s warm start: a copy in its cache folder, under its key."""
    src, dst = cache_path(cfg), cache_path(seed_cfg)
    if not os.path.isdir(dst):
        shutil.copytree(src, dst)
        with open(os.path.join(dst, "sft_key.json"), "w") as f:
            json.dump(sft_key(seed_cfg), f)


def run_summary(history, wall):
    """One run's curves and figures from its per-step records."""
    recs = history["records"]
    k = max(1, len(recs) // 4)
    def mean(key, rs=recs):  # over the steps that have the figure (a step that kept no group
        v = [r[key] for r in rs if key in r]  # has no update figures)
        return sum(v) / len(v) if v else float("nan")

    return {"curve": {key: [r.get(key, float("nan")) for r in recs] for key in (
                "reward", "moe_diff", "moe_diff_replay", "alpha_own_p5", "alpha_replay_p5",
                "kl_own", "kl_replay")},
            "reward0": mean("reward", recs[:k]), "reward1": mean("reward", recs[-k:]),
            "acc0": history["acc0"], "acc": [r["acc"] for r in recs if "acc" in r][-1],
            "is_cut": mean("is_cut"), "wall": wall,
            **{key: mean(key) for key in ("moe_diff", "moe_diff_tok", "moe_diff_replay",
                                          "moe_diff_tok_replay", "alpha_own_mean", "alpha_own_p5",
                                          "alpha_replay_mean", "alpha_replay_p5", "kl_own",
                                          "kl_replay")}}


def seen(s, arm):
    """What the arm's training forward met: own routing without replay, the replayed one with."""
    sfx = "_replay" if arm == "replay" else ""
    own = "replay" if arm == "replay" else "own"
    return {"diff": s[f"moe_diff{sfx}"], "diff_tok": s[f"moe_diff_tok{sfx}"],
            "alpha": s[f"alpha_{own}_mean"], "p5": s[f"alpha_{own}_p5"], "kl": s[f"kl_{own}"]}


def plot(results, path):
    """Four panels per step, each arm's mean over the seeds: reward, the disagreement its training
    forward met, p5 alpha, KL."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    panels = (("reward", "reward", "reward"), ("routing disagreement (picks)", "moe_diff",
                                               "moe_diff_replay"),
              ("p5 alpha (per position)", "alpha_own_p5", "alpha_replay_p5"),
              ("KL(rollout || trainer)", "kl_own", "kl_replay"))
    for i, (arm, runs) in enumerate(results.items()):
        for a, (title, off_key, on_key) in zip(ax, panels):
            key = on_key if arm == "replay" else off_key
            curves = [r["curve"][key] for r in runs]
            n = min(len(c) for c in curves)
            a.plot(range(n), [sum(c[j] for c in curves) / len(curves) for j in range(n)],
                   color=f"C{i}", label=arm)
            a.set_title(title)
            a.set_xlabel("step")
            a.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)


def run(quick, cmd):
    """-> the table, head included."""
    hw, seeds = hardware(), (0,) if quick else (0, 1, 2)
    args = [CONFIG, "--plot=false", "--eval_every=1000", "--eval_sampled=false",
            f"--rollout_copy={COPY}"] + ARGS[quick]
    root = tempfile.mkdtemp(prefix="zeros-bench-moe-")
    cfg = parse_config(args + [f"--out_dir={root}/warm"])
    results = {arm: [] for arm in ARMS}
    try:
        build_policy(cfg, torch.device("cpu"), print)  # built here if not: outside the timing
        for seed in seeds:
            share_warm_start(cfg, parse_config(args + [f"--seed={seed}",
                                                       f"--out_dir={root}/warm"]))
            for arm, extra in ARMS.items():
                print(f"--- seed {seed}, {arm}", flush=True)
                out = f"{root}/{seed}-{arm}".replace(" ", "_")
                t = time.perf_counter()
                history = train.main(args + extra + [f"--seed={seed}", f"--out_dir={out}"])
                results[arm].append(run_summary(history, time.perf_counter() - t))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plot(results, os.path.join(ROOT, "out", "bench_moe.png") if quick
         else os.path.join(ROOT, "assets", "moe.png"))
    return table(results, seeds, parse_config(args).stop_at, hw, cmd)


def table(results, seeds, steps, hw, cmd):
    """Rows of the seven-column table: replay (ours) against no replay, means over seeds (each
    seed). A figure is f(run summary, arm)."""

    def cell(arm, f, fmt):
        vals = [f(r, arm) for r in results[arm]]
        each = " (" + ", ".join(format(v, fmt) for v in vals) + ")" if len(vals) > 1 else ""
        return format(sum(vals) / len(vals), fmt) + each, sum(vals) / len(vals)

    def line(figure, f, fmt, target=""):
        (co, mo), (cb, mb) = cell("replay", f, fmt), cell("no replay", f, fmt)
        ratio = f"{mo / mb:.2f}x" if mb else "-"
        return f"| {figure} | {co} | {cb} | {ratio} | {target} | {hw} | `{cmd}` |"

    def paired(figure, key, fmt, target=""):  # replayed vs own routing, same step: every run
        runs = results["replay"] + results["no replay"]
        on, off = ([r[k] for r in runs] for k in (key.format("replay"), key.format("own")))
        mo, mb = sum(on) / len(on), sum(off) / len(off)
        return (f"| {figure} | {mo:{fmt}} | {mb:{fmt}} | {mo / mb:.2f}x | {target} | {hw} | "
                f"`{cmd}` |")

    per = (f"mean over seeds {', '.join(map(str, seeds))} (each seed)" if len(seeds) > 1
           else f"seed {seeds[0]}")
    met = lambda key: (lambda r, arm: seen(r, arm)[key])  # what the training forward met
    own = lambda key: (lambda r, arm: r[key])
    rows = [line(f"routing disagreement, rollout ({COPY} copy) vs the training forward: share of "
                 f"expert picks ({per}; {steps} steps each)", met("diff"), ".4f", "0 with replay"),
            line("tokens routed differently in at least one layer, training forward",
                 met("diff_tok"), ".3f", "0 with replay"),
            line("the trainer's own routing vs the rollout's, measured in both arms (share of "
                 "picks): what replay removes", own("moe_diff"), ".4f"),
            line("per-position alpha (1 - TV), mean over tokens, training forward", met("alpha"),
                 ".4f", "higher"),
            line("per-position alpha, 5th percentile, training forward", met("p5"), ".4f",
                 "higher"),
            line("KL(rollout || trainer) per position, training forward", met("kl"), ".2e",
                 "lower"),
            paired("the same rollouts and weights, every step of every run of both arms: "
                   "per-position alpha mean, replayed (ours) vs own routing (baseline)",
                   "alpha_{}_mean", ".4f", "higher"),
            paired("the same: per-position alpha, 5th percentile", "alpha_{}_p5", ".4f",
                   "higher"),
            paired("the same: KL(rollout || trainer) per position", "kl_{}", ".2e", "lower"),
            line("share of sampled tokens whose IS weight is truncated (tis, cap 2)",
                 own("is_cut"), ".4f"),
            line("training reward, first quarter of the steps", own("reward0"), ".3f"),
            line("training reward, last quarter of the steps", own("reward1"), ".3f",
                 "at least as good"),
            line(f"held-out greedy accuracy at the end (warm start "
                 f"{results['replay'][0]['acc0']:.3f})", own("acc"), ".3f", "at least as good"),
            line("wall time of a run, warm start not counted", own("wall"), ".0f")]
    for r in rows:
        print(r, flush=True)
    return TABLE_HEAD + rows
