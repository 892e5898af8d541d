"""
bench/signal.py: stages 1 and 3. Growth-zone sampling with dynamic sampling (ours) against uniform
sampling that trains on every group (the baseline), at the same number of rollouts, from the same
warm start, for seeds 0 to 4 (a seed sets the warm start, the pools and the sampling). Per arm: the
rollouts generated, the share of trained groups with zero advantage, the completions that reach the
expensive verifier, those the cascade settles as integers, held-out greedy accuracy, wall time.

Ours runs twice, as the default (dropped groups refilled up to refill_tries = 2 times) and without
refills (refill_tries = 0: groups without spread are dropped and the step trains short), each
against its own baseline, which runs as many steps as ours' rollouts make.

Simplifications:
    1. configs/sharpen.py (the earlier default, a fixed workload), stopped at step 12 of its
       60-step schedule (`stop_at`: the learning rate of those 12 steps is the real run's) and
       scored on 500 held-out problems: at 60 steps both arms reach 0.98-1.00, which compares
       nothing. The baseline stops earlier or later on the
       same schedule.
    2. Each seed's warm start (SFT) is built once, outside the timing, in the cache that every run
       of that seed then reads (the runs' folders share a parent); wall time counts the RL runs.
    3. The runs are `train.main` calls in this process, one after another.

    python -m bench signal --threads 1        # about 30 minutes on 2 cores
    python -m bench signal --quick            # seed 0, 6 steps, 50 held-out problems: a smoke run
"""

import shutil
import tempfile
import time

import torch

import train
from bench.common import TABLE_HEAD, hardware
from config import parse_config
from warmstart import build_policy

VARIANTS = {"with refills": [], "without refills": ["--refill_tries=0"]}  # ours' dynamic sampling
ARGS = {True: ["configs/sharpen.py", "--stop_at=6", "--sft_steps=60", "--n_eval=50"],  # quick: a smoke run
        False: ["configs/sharpen.py", "--stop_at=12", "--n_eval=500"]}  # both on its full LR schedule


def run_summary(history):
    """What one training run spent and kept, from its per-step records."""
    recs = history["records"]
    n = sum(r["rollouts"] for r in recs)
    trained = sum(r["groups_kept"] for r in recs)
    share = lambda k: sum(r.get(k, 0.0) * r["rollouts"] for r in recs) / max(1, n)  # of completions
    return {"rollouts": n, "zero_adv": sum(r["zero_adv_groups"] for r in recs) / max(1, trained),
            "verify": share("reach_verify"), "by_value": share("by_value"), "acc0": history["acc0"],
            "acc": [r["acc"] for r in recs if "acc" in r][-1], "steps": len(recs)}


def run(quick, cmd):
    """-> the table, head included: six rows per variant of ours."""
    hw = hardware()
    seeds = (0,) if quick else (0, 1, 2, 3, 4)
    args = ARGS[quick] + ["--plot=false", "--eval_every=1000"]
    rows = []
    root = tempfile.mkdtemp(prefix="zeros-bench-signal-")
    try:
        for seed in seeds:  # each seed's warm start (SFT), shared by its runs, outside the timing
            cfg = parse_config(args + [f"--seed={seed}", f"--out_dir={root}/{seed}"])
            build_policy(cfg, torch.device("cpu"), print)
        for variant, ours_args in VARIANTS.items():
            runs, wall = {"ours": [], "base": []}, {"ours": 0.0, "base": 0.0}
            for seed in seeds:
                a = args + [f"--seed={seed}"]
                for arm in ("ours", "base"):
                    if arm == "ours":
                        extra = ours_args
                    else:  # as many steps as ours' rollouts make: the same number of rollouts
                        per_step = cfg.prompts_per_step * cfg.group_size
                        same = max(1, round(runs["ours"][-1]["rollouts"] / per_step))
                        extra = ["--sampler=uniform", "--dynamic_sampling=false",
                                 f"--stop_at={same}"]
                    out = f"{root}/{seed}-{variant}-{arm}".replace(" ", "_")  # shares root's cache
                    t = time.perf_counter()
                    runs[arm].append(run_summary(train.main(a + [f"--out_dir={out}"] + extra)))
                    wall[arm] += time.perf_counter() - t
            rows += signal_rows(runs, wall, seeds, parse_config(args).stop_at, variant, hw, cmd)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        print(r, flush=True)
    return TABLE_HEAD + rows


def signal_rows(runs, wall, seeds, steps, variant, hw, cmd):
    """The six rows of one variant: means over seeds, then each seed's value."""
    o, b = runs["ours"], runs["base"]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)

    def cell(rs, k, f):  # the mean over seeds, then each seed's value
        each = " (" + ", ".join(format(r[k], f) for r in rs) + ")" if len(rs) > 1 else ""
        return format(mean(rs, k), f) + each

    def spent(rs):  # one phrase when every seed spent the same
        each = [f"{r['rollouts']} in {r['steps']} steps" for r in rs]
        if len(set(each)) > 1:
            return "; ".join(each)
        return each[0] + (" per seed" if len(rs) > 1 else "")

    n_o, n_b = sum(r["rollouts"] for r in o), sum(r["rollouts"] for r in b)
    sub = f"growth zone + dynamic sampling {variant} vs uniform, every group trained"
    per = (f"mean over seeds {', '.join(map(str, seeds))} (each seed)" if len(seeds) > 1
           else f"seed {seeds[0]}")
    v, end = f"[{variant}] ", f"{hw} | `{cmd}` |"
    return [f"| {v}rollouts generated ({sub}; {per}) | {spent(o)} | {spent(b)} | "
            f"{n_o / n_b:.2f}x | equal | " + end,
            f"| {v}trained groups with zero advantage | {cell(o, 'zero_adv', '.1%')} | "
            f"{cell(b, 'zero_adv', '.1%')} | | <= 5% | " + end,
            f"| {v}completions that reach the expensive verifier (math-verify) | "
            f"{cell(o, 'verify', '.1%')} | {cell(b, 'verify', '.1%')} | | <= 50% | " + end,
            f"| {v}completions whose answer fails the string match but is settled as an integer "
            f"(without that rule, they would reach the verifier) | {cell(o, 'by_value', '.1%')} | "
            f"{cell(b, 'by_value', '.1%')} | | | " + end,
            f"| {v}held-out greedy accuracy after ours' {steps} steps, warm start "
            f"{cell(o, 'acc0', '.3f')} | {cell(o, 'acc', '.3f')} | {cell(b, 'acc', '.3f')} | "
            f"{mean(o, 'acc') - mean(b, 'acc'):+.3f} | at least as good | " + end,
            f"| {v}wall time, warm starts not counted | {wall['ours']:.0f} s | "
            f"{wall['base']:.0f} s | {wall['ours'] / wall['base']:.2f}x | | " + end]
