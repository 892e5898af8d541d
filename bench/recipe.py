"""
bench/recipe.py: which RL recipe finishes sharpening on the embedded default? Each variant is the
default (configs/tiny.py) with a few keys changed, run over 3 seeds from the same warm starts (one
per seed, cached by its settings, so every variant of a seed starts from the same weights) at the
default's step budget unless the variant is about steps. The figure that ranks them: RL's sampled
pass@1 on the difficulties past SFT's range and inside RL's (5-8 terms), against the warm start's
pass@k there (k = eval_k, 64): has RL turned what the warm start could sample into what it does?

    python -m bench recipe --threads 1                     # every variant, 3 seeds (hours)
    python -m bench recipe --threads 1 --variants baseline,lr4e-4   # some of them
    python -m bench recipe --threads 1 --jobs 3            # 3 runs at a time, each its own process
    python -m bench recipe --jobs 0 --write-results        # only the table of the runs recorded
    python -m bench recipe --quick                         # seed 0, two variants, 2 steps
    python -m bench recipe --records ws-1b2c3d4e ...       # another set of warm starts, apart

The variants (VARIANTS) change only keys config.py has: lr and its schedule (min_lr_ratio 1: no
decay), group size and prompts per step, rollout temperature, steps, clip-higher (clip_high 0.28
against clip_low's 0.2), the advantage's normalisation (adv_norm std: GRPO; none: Dr. GRPO), the
growth-zone sampler against uniform sampling, and a KL penalty to the warm start (kl_coef). Every
run logs an entropy figure (train.py: the mean -log p of the sampled tokens, nats a token), shown
at the start and the end.

Simplifications:
    1. Each run's figures go to bench/recipe_runs/<variant>-s<seed>.json with its arguments and
       its whole config (--quick: to a temporary folder); a run recorded with the same arguments
       and config is not run again, so a sweep can be run in parts, and the table holds every
       variant recorded so far, losers included. A record of the same arguments under another
       config (the default has moved since) is refused, not overwritten: its folder belongs to
       that default. A change of code is not seen: delete the records to rerun them. The records
       of earlier defaults are kept apart, outside the table (RESULTS.md keeps their tables):
       bench/recipe_runs/earlier-120/ (120 steps, pass@k on 20 a bin) and earlier-sft0.005/ (SFT
       to loss 0.005 in at most 3,000 steps, one optimizer step a batch; its "mb4" is today's
       baseline and its baseline today's mb1; ws-e291f640/ is of that default too). Another CPU
       builds other warm starts from the same settings (the last bits of its sums differ), and
       what RL does moves with them: --records NAME keeps such a set's runs in
       bench/recipe_runs/NAME/ (named ws-<the seed-0 warm start's weight checksum>), in a table
       and a RESULTS block of its own, so that variants are compared on one set of warm starts.
    4. --jobs N starts the runs variant by variant, seed after seed, so the first N runs are of
       different seeds and each builds its seed's warm start; a later run of that seed finds it
       cached (two runs that build one warm start at once would share its progress file).
    2. "5-8" is the difficulties above the SFT data's top (sft_rg_kwargs) up to the pool's top
       (rg_kwargs); each difficulty weighs alike in the mean. Mean and spread (sample standard
       deviation) are over seeds.
    3. Wall seconds are the RL run's (rollouts, updates and held-out evaluation), not the warm
       start's, on whatever else the machine was running: a guide, not a benchmark.
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import train
from bench.common import hardware
from config import parse_config

RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipe_runs")
SEEDS = (0, 1, 2)
# name: (what it changes, the keys). Names are what --variants lists
VARIANTS = {
    "baseline": ("the default as configs/tiny.py has it", []),
    "lr4e-4": ("twice the learning rate", ["--lr=4e-4"]),
    "lr1e-3": ("five times the learning rate", ["--lr=1e-3"]),
    "lr4e-4-flat": ("twice the rate, no decay (min_lr_ratio 1)", ["--lr=4e-4",
                                                                   "--min_lr_ratio=1.0"]),
    "g16p8": ("group 16, 8 prompts a step (the same rollouts)", ["--group_size=16",
                                                                  "--prompts_per_step=8"]),
    "g16": ("group 16, 16 prompts a step (twice the rollouts)", ["--group_size=16"]),
    "p32": ("32 prompts a step (twice the rollouts)", ["--prompts_per_step=32"]),
    "t0.7": ("rollout temperature 0.7", ["--temperature=0.7"]),
    "t1.3": ("rollout temperature 1.3", ["--temperature=1.3"]),
    "steps200": ("twice the steps", ["--steps=200"]),
    "clip0.2": ("no clip-higher (clip_high = clip_low = 0.2)", ["--clip_high=0.2"]),
    # the default takes 4 optimizer steps a batch (minibatches 4; the earlier folders' "mb4"). One
    # step a batch leaves the ratio at 1 and the clip idle (update.py's simplification 1)
    "mb1": ("one optimizer step a batch: the clip idle (the earlier default)", ["--minibatches=1"]),
    "lr4e-4-mb1": ("twice the learning rate, one step a batch", ["--lr=4e-4", "--minibatches=1"]),
    "mb8": ("8 optimizer steps a batch (minibatches 8)", ["--minibatches=8"]),
    "drgrpo": ("Dr. GRPO: advantages not divided by the group's std", ["--adv_norm=none"]),
    "uniform": ("uniform prompt sampling, not the growth zone", ["--sampler=uniform"]),
    "pooled-prior": ("each prompt's prior: its number of terms' pooled pass rate",
                     ["--zone_prior=difficulty"]),
    "kl0.01": ("a KL penalty to the warm start, 0.01 (k2)", ["--kl_coef=0.01"]),
}
QUICK = ["--steps=2", "--n_train=200", "--sft_steps=10", "--sft_loss=0", "--eval_per_bin=2",
         "--eval_k=2", "--eval_k_per_bin=1", "--prompts_per_step=2", "--group_size=2",
         "--refill_tries=0", "--max_new_tokens=24", "--eval_every=2", "--save_every=100"]
QUICK_VARIANTS = ("baseline", "lr4e-4")


def band(cfg):
    """The difficulties the ranking reads: above the SFT data's top, up to the pool's."""
    top = lambda kw: kw.get("max_terms")  # noqa: E731  (chain_sum's knob)
    return top({**cfg.rg_kwargs, **cfg.sft_rg_kwargs}) + 1, top(cfg.rg_kwargs)


def mean_over(col, lo, hi):
    """The mean of a {difficulty: figure} column over lo..hi (None if it lacks one of them)."""
    xs = [col.get(d, col.get(str(d))) for d in range(lo, hi + 1)]
    return None if any(x is None for x in xs) else sum(xs) / len(xs)


def figures(history, cfg):
    """One run's figures: over the band, the warm start's pass@k and greedy accuracy, RL's pass@1,
    pass@k and greedy accuracy; past the SFT range (every held-out difficulty above it), the
    greedy gain; the entropy of the first and last tenth of the steps; the run's seconds and
    verifier calls."""
    lo, hi = band(cfg)
    start, end, recs = history["start"], history.get("end") or {}, history["records"]
    k = max((c for c in start if c.startswith("pass@")), key=lambda c: int(c[5:]))
    top = max(int(d) for d in start["greedy"])
    tenth = max(1, len(recs) // 10)
    ent = [statistics.mean(r["entropy"] for r in part) for part in (recs[:tenth], recs[-tenth:])]
    return {"k": k, "start_passk": mean_over(start[k], lo, hi),
            "start_greedy": mean_over(start["greedy"], lo, hi),
            "rl_pass1": mean_over(end.get("pass@1", {}), lo, hi),
            "rl_passk": mean_over(end.get(k, {}), lo, hi),
            "rl_greedy": mean_over(end.get("greedy", {}), lo, hi),
            "gain_past_sft": (mean_over(end.get("greedy", {}), lo, top)
                              - mean_over(start["greedy"], lo, top)),
            "entropy": ent, "band": [lo, hi], "steps": len(recs),
            "seconds": sum(r.get("collect_s", 0) + r.get("train_s", 0) + r.get("eval_s", 0)
                           for r in recs),
            "verifier_calls": sum(r["rollouts"] for r in recs)}


def settings(argv):
    """A run's whole config as the record keeps it (JSON's types; out_dir aside): what decides
    whether a record still stands for a variant once the default (configs/tiny.py) has moved."""
    cfg = dataclasses.asdict(parse_config(argv))
    cfg.pop("out_dir")
    return json.loads(json.dumps(cfg))


def one_run(name, seed, quick, root, runs):
    """Run (or read the record of) one variant on one seed -> its figures. A record made under
    other settings (an earlier default) is not overwritten: its folder is that default's."""
    argv = [f"--seed={seed}", "--plot=false"] + (QUICK if quick else []) + VARIANTS[name][1]
    path = os.path.join(runs, f"{name}-s{seed}.json")
    if os.path.exists(path):
        with open(path) as f:
            rec = json.load(f)
        if rec["argv"] == argv and rec.get("settings") == settings(argv):
            print(f"recipe: {name} seed {seed}: recorded in {os.path.relpath(path)}")
            return rec["figures"]
        if rec["argv"] == argv:
            raise ValueError(f"bench recipe: {os.path.relpath(path)} was run under other settings "
                             f"(an earlier default): run into a folder of its own, --records NAME")
    print(f"recipe: {name} seed {seed}: python train.py {' '.join(argv)}", flush=True)
    history = train.main(argv + [f"--out_dir={root}/{name}-s{seed}"])
    rec = {"variant": name, "seed": seed, "argv": argv, "settings": settings(argv),
           "figures": {**figures(history, parse_config(argv)), "hardware": hardware()}}
    os.makedirs(runs, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(path + ".tmp", path)
    return rec["figures"]


def spread(xs):
    """mean ± sample sd over seeds ("-" where a figure is missing)."""
    if not xs or any(x is None for x in xs):
        return "-"
    m = statistics.mean(xs)
    return f"{m:.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{m:.3f}"


def recorded(runs, quick):
    """{variant: {seed: figures}} of every run recorded in `runs` with its variant's current
    arguments (the table's rows: this sweep's and earlier ones')."""
    out = {}
    for f in sorted(os.listdir(runs)) if os.path.isdir(runs) else []:
        if not f.endswith(".json"):
            continue
        with open(os.path.join(runs, f)) as fh:
            rec = json.load(fh)
        name, seed = rec["variant"], rec["seed"]
        want = [f"--seed={seed}", "--plot=false"] + (QUICK if quick else []) + \
            VARIANTS.get(name, ("", [None]))[1]
        if rec["argv"] == want:
            out.setdefault(name, {})[seed] = rec["figures"]
    return out


def table(results, cmd):
    """The ranked table, head included: variants by RL pass@1 minus the warm start's pass@k over
    the band, the mean over seeds."""
    any_fig = next(iter(next(iter(results.values())).values()))
    (lo, hi), k = any_fig["band"], any_fig["k"]
    margin = lambda figs: statistics.mean(  # noqa: E731
        f["rl_pass1"] - f["start_passk"] for f in figs.values()
        if f["rl_pass1"] is not None and f["start_passk"] is not None) if figs else -1
    where = sorted({f.get("hardware", "?") for fs in results.values() for f in fs.values()})
    lines = [f"Hardware (the runs'): {'; '.join(where)}. Command: `{cmd}`. Each variant from the "
             f"same warm start per seed; figures are means over {lo}-{hi} terms (past SFT's range, "
             f"inside RL's), then mean ± spread over seeds. Ranked by RL's pass@1 minus the warm "
             f"start's {k} there. 'wins': seeds where RL's pass@1 is at or above the warm start's "
             f"{k}. Entropy: mean -log p of a sampled token (nats), the first and last tenth of "
             f"the steps. Seconds: the RL run's, on a shared machine.", "",
             f"| variant | keys | seeds | warm start {k} | RL pass@1 | wins | RL {k} | greedy, "
             f"start | greedy, after RL | greedy gain past SFT's range | entropy, first -> last "
             f"| steps | RL s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in sorted(results, key=lambda n: -margin(results[n])):
        figs = results[name]
        col = lambda key: spread([f[key] for f in figs.values()])  # noqa: E731
        wins = sum(f["rl_pass1"] is not None and f["rl_pass1"] >= f["start_passk"]
                   for f in figs.values())
        ent = [statistics.mean(f["entropy"][i] for f in figs.values()) for i in (0, 1)]
        keys = " ".join(VARIANTS[name][1]) or "-"
        lines.append(f"| {name} | `{keys}` | {','.join(map(str, sorted(figs)))} | "
                     f"{col('start_passk')} | {col('rl_pass1')} | {wins} of {len(figs)} | "
                     f"{col('rl_passk')} | {col('start_greedy')} | {col('rl_greedy')} | "
                     f"{col('gain_past_sft')} | {ent[0]:.3f} -> {ent[1]:.3f} | "
                     f"{statistics.mean(f['steps'] for f in figs.values()):.0f} | "
                     f"{statistics.mean(f['seconds'] for f in figs.values()):.0f} |")
    return lines


def run(quick, cmd, variants="", runs=RUNS, jobs=1):
    """Run the variants asked for (every one by default; --quick: two, seed 0) over the seeds,
    each run once per arguments, then -> the table of every variant recorded. jobs > 1: that many
    runs at a time, each its own process (python -m bench.recipe VARIANT SEED) at this process's
    torch threads; jobs 0: run none, only tabulate the records."""
    names = [v for v in variants.split(",") if v] or list(QUICK_VARIANTS if quick else VARIANTS)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"bench recipe: no variant {', '.join(unknown)}; the variants: "
                         f"{', '.join(VARIANTS)}")
    root = tempfile.mkdtemp(prefix="zeros-bench-recipe-")
    runs = os.path.join(root, "records") if quick else runs  # a smoke run's records: not kept
    seeds = SEEDS[:1] if quick else SEEDS
    if jobs > 1 and not quick:  # simplification 4
        waiting, live = [(n, s) for n in names for s in seeds], []
        while waiting or live:
            for p, f in [x for x in live if x[0].poll() is not None]:
                f.close()
                live.remove((p, f))
            if waiting and len(live) < jobs:
                (name, seed), f = waiting.pop(0), None
                f = open(os.path.join(root, f"{name}-s{seed}.log"), "w")
                live.append((subprocess.Popen(
                    [sys.executable, "-m", "bench.recipe", name, str(seed),
                     f"--threads={torch.get_num_threads()}", runs], stdout=f,
                    stderr=subprocess.STDOUT,
                    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), f))
                print(f"recipe: {name} seed {seed} started, log {f.name}", flush=True)
            time.sleep(1)
    elif jobs:  # seed by seed: one warm start built at a time
        for name, seed in [(n, s) for s in seeds for n in names]:
            one_run(name, seed, quick, root, runs)
    results = recorded(runs, quick)
    return table(results, cmd) if results else ["(no runs recorded yet)"]


if __name__ == "__main__":  # one run: python -m bench.recipe VARIANT SEED --threads=N [RECORDS]
    torch.set_num_threads(int(sys.argv[3].split("=")[1]))
    one_run(sys.argv[1], int(sys.argv[2]), False, tempfile.mkdtemp(prefix="zeros-bench-recipe-"),
            sys.argv[4] if sys.argv[4:] else RUNS)
