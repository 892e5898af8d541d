"""
bench/sparrow.py: stage 2 in the loop, the miniature Sparrow experiment on the long-CoT config
(configs/lagged.py: 1,000-1,800 generated tokens a rollout). Training runs from one warm start,
per seed, one per arm:
    (a) dense
    (b) the floor: only the pages every step reads (1 sink + 2 recent pages of 64): the fastest
        a lossy schedule can be here, the speed ceiling the other arms are measured against
    (c) the per-position p5-held schedule (Sparrow's statistic: calibrated, then held)
    (d), (e) the rollout-level-held schedule (each rollout's summed TV, its 95th percentile held
        at TV_TARGETS[0] and [1]: the expected number of positions where sparse and dense part)
    (f) (d) + DistillSparse
    (g) (d) with the oracle scorer (the true attention mass per page): what the best possible
        page ranking needs to hold the same target, the ceiling of any scorer
    (h) speculative: the sparse policy drafts, the dense one verifies; exact dense samples
    (i) (h) + DistillSparse as the draft: its adapter trains toward the dense policy and only
        drafts, so the samples stay exact; what it can move is the acceptance and the speed
    (j) (h) drafting from the group's own text instead (spec_draft=suffix, drafts.py): a suffix
        index over the sibling rows, the prompt and its earlier rollouts; no draft forward
    (k) (h) and (j) mixed (spec_draft=mix): per round and row, the drafter with more expected
        tokens a second; the table gives each drafter's acceptance and its share of the drafts
Per arm, mean and standard deviation over the runs: the read fraction actually read, the in-loop
speedup at matched lengths (the dense engine decodes the sparse rollout's own tokens, every 5
steps) and as a fraction of (b)'s, the paired reward gap (sparse minus dense on the same prompts
and seed) at step 0 and at the end, held-out accuracy, p5 alpha and the rollout TV tail. Then the
question the seeds leave open: over arms x seeds, which statistic predicts the held-out gap to the
dense run of the same seed? Spearman's rank correlation of each (per-position p5, the rollout TV
tail, the paired reward gap at step 0) with it. Writes assets/sparrow.png (reward, accuracy and
alpha per bin; mean over seeds, a band of one sd) and assets/sparrow_predict.png (the three
scatters); --quick writes them under out/bench_sparrow_quick/ instead.

Simplifications:
    1. alpha is Sparrow's per-position acceptance rate that the run logs (1 - TV between the
       sparse rollout's and the dense policy's next-token distributions, exact over this small
       vocabulary), over every generated row.
    2. Every run starts from one warm start (sft_seed 0): the seed varies the RL run, its pool,
       held-out set and sampling. The warm start that `python train.py configs/lagged.py` cached in
       out/ is reused when present; otherwise the first run builds it (about 30 minutes on 2 cores).
       Another CPU or thread count builds another warm start from the same config (other float
       sums over 1,350 SFT steps), so the records are kept per warm start: the family's folder
       holds the first one's (its warmstart.json names it), ws-<checksum>/ each other's. A run is
       one seed of one warm start, paired with the dense run of the same warm start and seed;
       the table's mean and sd are over those runs.
    3. The runs' policies differ (each trains on its own rollouts), so per-bin figures across runs
       are noisy; tests/test_distill.py checks DistillSparse on a fixed batch.
    4. Each run is its own process (python -m bench.sparrow RECORD ARGS...) that writes its summary
       and arguments to bench/sparrow_runs/[ws-<id>/]armI-seedS.json (its log beside it, not
       kept in git).
       A full bench skips the runs already recorded with the same arguments, so one that stopped
       part way resumes, and --jobs 0 tabulates the records without running anything. A change
       of code is not seen: delete the records to rerun them.
    5. The oracle arm's speed is not a speed: its scorer reads every key. Its read fraction is the
       figure: the pages a perfect ranking needs at the same target.

A second task family, so that the answer is not one task's: `--config configs/splitting.py`,
reasoning-gym's string_splitting (900-1,800 generated tokens, every line computed from the one
above it: local, where lagged's copy tokens look 256 back), from a teacher that drops Z's carry
from 9 to 10 half the time, a slip dense RL can remove (with an exact teacher dense RL did not move
held-out accuracy, so no sparse arm could be judged against it). The same arms from its own warm
start; its records in bench/sparrow_runs/splitting/, its plots assets/sparrow-splitting*.png, its
table the RESULTS block sparrow-splitting.

    python -m bench sparrow --threads 1 --jobs 2   # hours: 33 runs, 2 at a time, 1 thread each
    python -m bench sparrow --threads 1 --variants a,h   # only those arms' runs
    python -m bench sparrow --config configs/splitting.py --jobs 2   # the second family
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
# pages a decode step for arm (b): with pages of 64, only the pages every step reads (the first, the
# last full one and the partial one), so no page 256 tokens back unless it is one of those
FIXED = 3
# arms (d) and (e): the 95th percentile of each rollout's summed TV held at these; the first is
# also (f)'s and (g)'s
TV_TARGETS = (0.5, 2.0)
SPEC_K = 8  # arm (h): tokens a draft
# each full run's record (its arguments and summary): the table and plot are rebuilt from these,
# and a bench that stopped part way resumes at the first run not recorded
RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sparrow_runs")


def arms(fixed):
    """{run name: its command-line overrides}."""
    cmp = ["--kv_compare_every=5"]
    held = ["--kv_budget=calibrate", "--kv_controller=true"] + cmp
    tv = lambda t: held + ["--kv_hold=rollout", f"--kv_tv_target={t}"]
    t0, t1 = TV_TARGETS
    spec = [f"--kv_budget=table:{fixed}", "--kv_controller=false", "--rollout_mode=speculative",
            f"--spec_k={SPEC_K}"] + cmp
    return {"(a) dense": ["--kv_budget=dense", "--kv_controller=false"],
            f"(b) floor, {fixed} pages": [f"--kv_budget=table:{fixed}", "--kv_controller=false"]
            + cmp,
            "(c) p5-held": held,
            f"(d) TV-held <= {t0}": tv(t0),
            f"(e) TV-held <= {t1}": tv(t1),
            "(f) (d) + DistillSparse": tv(t0) + ["--distill_r=8"],
            "(g) (d), oracle scorer": tv(t0) + ["--kv_scorer=oracle"],
            f"(h) speculative, k={SPEC_K}": spec,
            "(i) (h) + DistillSparse draft": spec + ["--distill_r=8"],
            "(j) (h), suffix drafts": spec + ["--spec_draft=suffix"],
            "(k) (h), sparse or suffix per row": spec + ["--spec_draft=mix"]}


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
    gaps = [r["reward_gap"] for r in recs if "reward_gap" in r]  # every kv_compare_every steps
    nan = float("nan")
    return {"reward0": nanmean([r["reward"] for r in recs[:k]]),
            "reward1": nanmean([r["reward"] for r in recs[-k:]]),
            "acc0": history["acc0"], "acc": [r["acc"] for r in recs if "acc" in r][-1],
            "alpha": nanmean([r.get("alpha_mean", float("nan")) for r in recs]),  # dense: none
            "p5": nanmean([r.get("alpha_p5", float("nan")) for r in recs]),
            "bins": per_bin, "kv_read": nanmean([r["kv_read"] for r in recs]),
            "gen_s": sum(r["gen_s"] for r in recs), "tokens": sum(r["new_tokens"] for r in recs),
            "speedup": nanmean(speed), "n_speed": len(speed), "table": recs[-1].get("kv_table"),
            "gap0": gaps[0] if gaps else nan, "gap1": gaps[-1] if gaps else nan,
            "tv": nanmean([r.get("tv_tail", nan) for r in recs]),
            "accept": nanmean([r.get("spec_accept", nan) for r in recs]),
            # speculative: the decode time's share in the draft steps (the rest: the verifies)
            "draft_share": (lambda d, v: d / (d + v) if d + v else nan)(
                sum(r.get("spec_draft_s", 0.0) for r in recs),
                sum(r.get("spec_verify_s", 0.0) for r in recs)),
            "per_verify": nanmean([r.get("spec_per_verify", nan) for r in recs]),
            # per drafter (spec_draft suffix or mix): drafts accepted, and the suffix's share
            **{f"accept_{d}": nanmean([r[f"spec_accept_{d}"] for r in recs
                                       if r.get(f"spec_drafted_{d}")])
               for d in ("sparse", "suffix")},
            "suffix_share": (lambda a, b: a / (a + b) if a + b else nan)(
                sum(r.get("spec_drafted_suffix", 0) for r in recs),
                sum(r.get("spec_drafted_sparse", 0) for r in recs)),
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
    keys = ("reward0", "reward1", "acc0", "acc", "alpha", "p5", "kv_read", "speedup", "gap0",
            "gap1", "tv", "accept", "draft_share", "per_verify", "accept_sparse",
            "accept_suffix", "suffix_share")
    # .get: a record made before a figure existed (a dense run needs none of the sparse ones)
    out = {k: spread([r.get(k, float("nan")) for r in runs]) for k in keys}
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


def spearman(x, y):
    """Spearman's rank correlation of two lists (ties get their mean rank); NaN under 3 pairs."""
    pairs = [(a, b) for a, b in zip(x, y) if a == a and b == b]
    if len(pairs) < 3:
        return float("nan")

    def ranks(v):
        order, r = sorted(range(len(v)), key=v.__getitem__), [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks([a for a, _ in pairs]), ranks([b for _, b in pairs])
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx, sy = sum((a - mx) ** 2 for a in rx) ** 0.5, sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


PREDICTORS = (("p5", "per-position p5 alpha"), ("tv", "rollout TV, 95th percentile"),
              ("gap0", "paired reward gap at step 0"))


def predictors(runs, path=None):
    """runs {arm: {seed: summary}} -> [(predictor, rho, points)]: over the lossy arms x seeds,
    each predictor against the held-out gap (the run's final accuracy minus the dense run's of
    the same seed). Writes the three scatters to `path`."""
    dense = runs.get("(a) dense", {})
    lossless = ("(a)", "(h)", "(i)")  # dense and the speculative arms: no mismatch to predict with
    pts = [(s, dense[seed]["acc"]) for arm, by in runs.items() if arm[:3] not in lossless
           for seed, s in by.items() if seed in dense]
    out = [(label, spearman([s[k] for s, _ in pts], [s["acc"] - d for s, d in pts]),
            [(s[k], s["acc"] - d) for s, d in pts]) for k, label in PREDICTORS]
    if path:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
        for a, (label, rho, xy) in zip(ax, out):
            a.scatter([p[0] for p in xy], [p[1] for p in xy], s=14)
            a.set_xlabel(label), a.set_title(f"Spearman rho {rho:+.2f}")
        ax[0].set_ylabel("held-out accuracy minus dense's (same seed)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    return out


def one(path, args):
    """One training run, train.main(args); its summary, with its arguments, written to path. A
    folder left by a killed attempt is overwritten (its record was never written)."""
    hist = train.main(args + ["--overwrite=true"])
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


def plan_runs(args, seeds, records, root, tag=""):
    """[(arm, seed, its record's path, its train.py arguments)], seed by seed; tag names the task
    family in the runs' folders ("" for configs/lagged.py)."""
    return [(name, seed, f"{records}/arm{i}-seed{seed}.json",
             args + extra + [f"--seed={seed}", f"--out_dir={root}/sparrow{tag}-arm{i}-seed{seed}"])
            for seed in seeds for i, (name, extra) in enumerate(arms(FIXED).items())]


def recorded(path, args):
    """The summary recorded at path by a run of the same arguments (same_run), else None."""
    try:
        with open(path) as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    return rec["summary"] if same_run(rec["args"], args) else None


def family(config):
    """A config's tag: "" for configs/lagged.py (the first family, whose records, plots and
    RESULTS block keep their names), else "-<its file name>" ("-splitting")."""
    stem = os.path.splitext(os.path.basename(config))[0]
    return "" if os.path.abspath(config) == os.path.abspath(CONFIG) else f"-{stem}"


def run(quick, cmd, jobs=1, config=CONFIG, variants=""):
    """-> the table, its own head included (its columns differ from the other sections'). config:
    the task family the arms train on; variants: the arms to run, by letter ("a,h"; "": all)."""
    small = ["--steps=2", "--sft_steps=10", "--sft_init=", "--n_eval=4", "--eval_every=1",
             "--calib_prompts=2", "--prompts_per_step=2", "--group_size=2", "--max_new_tokens=96",
             "--difficulty=(1,2)"]
    seeds = SEEDS[:2] if quick else SEEDS
    threads = f"--threads={torch.get_num_threads()}"
    args = [config, "--plot=false", "--sft_seed=0", threads] + (small if quick else [])
    cfg, tag = parse_config(args), family(config)
    # a full run keeps each run's record in RUNS and skips the runs recorded with the same
    # arguments: the runs take hours, and an interrupted bench resumes where it stopped
    tmp, live = tempfile.mkdtemp(prefix="zeros-bench-sparrow-"), []
    family_runs = os.path.join(RUNS, tag[1:]) if tag else RUNS  # configs/lagged.py's: RUNS itself
    root = tmp if quick else os.path.dirname(cfg.out_dir) or "."
    records = tmp if quick else family_runs
    if jobs and (jobs > 1 or not quick):  # the runs share one warm start: build it first
        ws = warmstart_id(cfg, root)
        records = records if quick else records_for(family_runs, ws)
    os.makedirs(records, exist_ok=True)
    plan = plan_runs(args, seeds, records, root, tag)
    missing = [p for p in plan if recorded(p[2], p[3]) is None]
    todo = chosen(missing, variants) if jobs else []
    print(f"{len(plan) - len(missing)} of {len(plan)} runs recorded in {os.path.relpath(records)}; "
          f"running {len(todo)}, {jobs} at a time (each one's log beside its record)", flush=True)
    try:
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
        sets = [(records, "this run")] if quick else record_sets(family_runs)
        # {arm: {(warm start, seed): summary}}: a replicate is a seed of one warm start
        by_seed = {name: {(label, seed): r for d, label in sets
                          for n, seed, path, a in plan_runs(args, seeds, d, root, tag) if n == name
                          for r in [recorded(path, a)] if r is not None} for name in arms(FIXED)}
    finally:
        for proc, *_ in live:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    runs = {name: list(by.values()) for name, by in by_seed.items()}
    results = {name: aggregate(r) for name, r in runs.items() if r}  # --jobs 0: maybe not all
    dense = by_seed.get("(a) dense", {})
    for name, a in results.items():  # held-out gap to the dense run of its warm start and seed
        a["gap_acc"] = spread([r["acc"] - dense[k]["acc"] for k, r in by_seed[name].items()
                               if k in dense])
    art = "out/bench_sparrow_quick" if quick else "assets"  # a smoke run leaves the repo alone
    os.makedirs(art, exist_ok=True)
    plot(results, f"{art}/sparrow{tag}.png", cfg.kv_target)
    pred = predictors(by_seed, f"{art}/sparrow{tag}_predict.png")
    reps = {label: sorted({seed for by in by_seed.values() for (lab, seed) in by if lab == label})
            for _, label in sets}
    return table(results, runs, pred, cfg, reps, cmd, config)


def chosen(plan, variants):
    """The runs of plan whose arm's letter is among variants ("a,h" or "(a),(h)"; "": all)."""
    letters = {v.strip().strip("()") for v in variants.split(",") if v.strip()}
    unknown = letters - {name[1] for name in arms(FIXED)}
    if unknown:
        raise ValueError(f"bench sparrow: no arm {', '.join(sorted(unknown))}; the arms are "
                         f"{', '.join(name[1] for name in arms(FIXED))}")
    return [p for p in plan if not letters or p[0][1] in letters]


def warmstart_id(cfg, root):
    """The warm start's fingerprint (the first 8 hex digits of its weights' checksum), built or
    found in the cache: the same config can build different warm starts on another CPU or thread
    count (other float sums), and each one's runs are paired only with its own dense runs."""
    from model import weight_checksum
    tok_dir = f"{root}/sparrow-warmstart"  # build_policy writes a tokenizer there
    model, _ = build_policy(dataclasses.replace(cfg, out_dir=tok_dir), torch.device("cpu"), print)
    shutil.rmtree(tok_dir, ignore_errors=True)
    return weight_checksum(model)[:8]


def records_for(family_runs, ws):
    """The folder for the records of warm start ws, made if new, its warmstart.json written: the
    family's folder itself when that is new or its warmstart.json names ws, else
    family_runs/ws-<ws>."""
    def claim(d):  # d's records are ws's from now on
        with open(os.path.join(d, "warmstart.json"), "w") as f:
            json.dump({"id": ws, "hardware": hardware()}, f)
    os.makedirs(family_runs, exist_ok=True)
    meta = os.path.join(family_runs, "warmstart.json")
    if not os.listdir(family_runs):
        claim(family_runs)
    if os.path.exists(meta):
        with open(meta) as f:
            if json.load(f)["id"] == ws:
                return family_runs
    d = os.path.join(family_runs, f"ws-{ws}")
    os.makedirs(d, exist_ok=True)
    if not os.path.exists(os.path.join(d, "warmstart.json")):
        claim(d)
    return d


def record_sets(family_runs):
    """[(folder, label)]: the family's records, one set per warm start: the folder itself (its
    warmstart.json says which warm start and where it was built), then each ws-<id> folder."""
    def label(d):
        try:
            with open(os.path.join(d, "warmstart.json")) as f:
                m = json.load(f)
            return f"warm start {m['id']} ({m['hardware']})"
        except FileNotFoundError:
            return f"warm start {os.path.basename(d)[3:]}"
    subs = sorted(os.path.join(family_runs, d) for d in os.listdir(family_runs)
                  if d.startswith("ws-")) if os.path.isdir(family_runs) else []
    return [(family_runs, label(family_runs))] + [(d, label(d)) for d in subs]


def table(results, runs, pred, cfg, seeds, cmd, config=CONFIG):
    """The arms' table, then the predictors' rank correlations."""
    pm = lambda m_sd, f=".3f": "-" if m_sd[0] != m_sd[0] else f"{m_sd[0]:{f}} ± {m_sd[1]:{f}}"
    spec = lambda a: ("" if a["draft_share"][0] != a["draft_share"][0] else
                      f"; {a['per_verify'][0]:.1f} tokens a verify, draft "
                      f"{a['draft_share'][0]:.0%} of decode" + (
                          "" if not a["suffix_share"][0] > 0 else
                          f"; suffix drafts {a['suffix_share'][0]:.0%} of the drafts, accepted "
                          f"{a['accept_suffix'][0]:.2f} (sparse {a['accept_sparse'][0]:.2f})"))
    ceiling = next((a["speedup"][0] for n, a in results.items() if n.startswith("(b)")), None)
    rows = []
    for name, a in results.items():
        of = (f" ({a['speedup'][0] / ceiling:.2f} of (b))" if ceiling and a["speedup"][0] == a[
            "speedup"][0] else "")
        rows.append(f"| {name} | {len(runs[name])} | {pm(a['kv_read'], '.2f')} | "
                    f"{pm(a['speedup'], '.2f')}{of} | {pm(a['gap0'])} | {pm(a['gap1'])} | "
                    f"{pm(a['acc0'])} -> {pm(a['acc'])} | {pm(a['gap_acc'])} | "
                    f"{pm(a['reward0'])} -> "
                    f"{pm(a['reward1'])} | {pm(a['p5'])} | {pm(a['tv'], '.2f')} | "
                    f"{pm(a['accept'])}{spec(a)} | {a['tables'][0] or '-'} |")
    sets = "; ".join(f"{label}: seeds {', '.join(map(str, s))}" for label, s in seeds.items()
                     if s)
    head = [f"Hardware: {hardware()}. Command: `{cmd}`. {config}, sft_seed 0; {sets}. A run is "
            f"one seed of one warm start (the seed varies the pool, the held-out set and the "
            f"sampling; the same config builds another warm start on another CPU), paired with "
            f"the dense run of its warm start and seed; {cfg.steps} steps of "
            f"{cfg.prompts_per_step} x {cfg.group_size} rollouts, bins of {cfg.kv_bin_pages} "
            f"pages of {cfg.page_size} tokens, first {cfg.dense_layers} layer(s) dense; p5 held "
            f"at {cfg.kv_target}, the "
            f"rollout TV's 95th percentile at the arm's target. Mean ± standard deviation over "
            f"the runs.", "",
            "| arm | runs | KV pages read (of dense) | rollout speedup vs dense at matched lengths "
            "(of the floor's) | reward gap vs dense, step 0 | reward gap, last comparison | "
            "held-out accuracy, start -> end | held-out gap vs dense (paired) | training reward, "
            "first -> last fifth | p5 alpha | rollout TV, 95th pct | draft tokens accepted | "
            "table at the end (first seed) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    corr = ["", "Which statistic predicts the held-out gap (final accuracy minus the dense run's "
            "of the same warm start and seed), over the lossy runs; Spearman's rho "
            f"(assets/sparrow{family(config)}_predict.png):", "",
            "| predictor | rho | runs |", "|---|---|---|"]
    corr += [f"| {label} | {rho:+.2f} | {len(xy)} |" for label, rho, xy in pred]
    return head + rows + dense_gain(runs.get("(a) dense", [])) + corr + at_scale(results, cfg)


def dense_gain(dense_runs):
    """Does dense RL move held-out accuracy enough that a sparse arm's gap can be measured? Its
    gain (end minus start, per run) against the runs' sample standard deviation of that gain: a
    family is fit to judge the sparse arms when the mean gain is at least 3 of those sds."""
    gains = [r["acc"] - r["acc0"] for r in dense_runs]
    if not gains:
        return []
    m, sd = spread(gains)
    if len(gains) == 1:
        line = f"Dense RL's held-out gain: {m:+.3f} on one run (no spread over seeds yet)" + (
            "." if m > 0 else ": dense RL does not move held-out accuracy here, so this family "
            "cannot judge a sparse arm against dense.")
        return ["", line]
    ratio = m / sd if sd > 0 else float("nan")
    verdict = ("at least 3 of its sds: a sparse arm's gap is measurable here" if ratio >= 3 else
               "under 3 of its sds: this family cannot judge a sparse arm against dense yet")
    return ["", f"Dense RL's held-out gain, end minus start per run: {m:+.3f} ± {sd:.3f} over "
            f"{len(gains)} run(s) ({', '.join(f'{g:+.3f}' for g in gains)}); the mean gain is "
            f"{ratio:.1f} sds, {verdict}."]


def winner(results):
    """The lossy arm to carry to scale: the fastest that trains like dense (held-out accuracy and
    training reward in the last fifth of the steps each within one dense sd of dense's mean: an
    arm whose rollouts all fail trains on nothing and keeps its warm start's accuracy), else the
    most accurate of those that keep the reward, else the most accurate (None without dense or
    lossy arms)."""
    dense = results.get("(a) dense")
    lossy = {n: a for n, a in results.items() if n[:3] in ("(c)", "(d)", "(e)", "(f)")}
    if dense is None or not lossy:
        return None
    near = lambda a, k: a[k][0] >= dense[k][0] - dense[k][1]
    ok = {n: a for n, a in lossy.items() if near(a, "acc") and near(a, "reward1")}
    if ok:
        return max(ok, key=lambda n: ok[n]["speedup"][0] if ok[n]["speedup"][0] == ok[n][
            "speedup"][0] else 0)
    trained = {n: a for n, a in lossy.items() if near(a, "reward1")} or lossy
    return max(trained, key=lambda n: trained[n]["acc"][0])


def at_scale(results, cfg):
    """The cost model's prediction for the winning arm at Sparrow's shape (Qwen3-1.7B, 32K new
    tokens, H200 datasheet rates), at the fraction of pages its sparse layers read here: beside
    Sparrow's published 2.21x. A prediction, nothing is run; the fraction is the miniature's (1-2k
    tokens), which a 32K context would need less of, so it is the conservative side."""
    name = winner(results)
    if name is None:
        return []
    from bench.cost import model_shape, rollout_cost
    from model import ModelConfig
    from sparsity import fraction_budget
    L, dl = cfg.n_layer, cfg.dense_layers
    f = (results[name]["kv_read"][0] * L - dl) / (L - dl)  # the sparse layers' share
    qwen = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True)
    P, layers, kv_heads, head_dim = model_shape(qwen)
    c = rollout_cost(P, layers, 8, 16 // kv_heads, 2 * layers * kv_heads * head_dim, 1024, 32768,
                     989e12, 4.8e12, schedule=fraction_budget(min(1.0, max(1e-3, f))),
                     page_size=16, dense_layers=2, kv_bytes=2, param_bytes=2)
    return ["", f"Cost model PREDICTION (not measured) for {name}, which reads {f:.0%} of the "
            f"pages in its sparse layers here: Qwen3-1.7B, 8 rollouts of a 1,024-token prompt, "
            f"32,768 new tokens, that fraction past 2 dense layers, bf16, H200 datasheet rates "
            f"(989 TFLOP/s, 4.8 TB/s, weights' traffic included): {c['speedup']:.2f}x decode "
            f"speedup, against Sparrow's published 2.21x."]


if __name__ == "__main__":  # one run, in its own process: python -m bench.sparrow RECORD ARGS...
    one(sys.argv[1], sys.argv[2:])
