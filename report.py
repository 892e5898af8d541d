"""
report.py: what a person reads of a run. The step's log lines, the summary table at the end,
out_dir/run.png, the hardware line every measured figure names, and the experiment tracker
(`tracker` in config.py) that gets the same figures. train.py calls these; every figure they show is
also in out_dir/metrics.jsonl.

The step lines, one stage after another (the README explains each label):
    step   12  kept 14/16 in 2 tries | rollout 0.65s len 34 kv 1.00 | reward 0.858 verify 0.00
               p5 alpha 0.912 tv q0.95 0.41 mean 0.12 | loss +0.0123 gn 0.92 1.8s | acc 1.000
               rollout vs dense 1.52x, reward gap -0.031 (dense 0.640) | kv table [3, 4] | ...
               (only what this run has)

Simplifications:
    1. Every line stays within 100 columns; a figure a run does not have is left out, not zeroed.
    2. The plot is reward per step and greedy held-out accuracy at each evaluation, nothing more.
    3. The tracker gets metrics.jsonl's records as they are (nested dicts and lists included), the
       config at the start and run.png at the end: no figures of its own, no system metrics.

    python train.py --tracker=trackio --out_dir=out/tracked   # then `trackio show --project zeros`
    python train.py --tracker=wandb                            # offline; `wandb sync` uploads it
"""

import dataclasses
import importlib
import math
import os
import platform

import matplotlib
import torch

matplotlib.use("Agg")  # the plot is a file: no display needed
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def step_lines(rec):
    """The step's log lines: stages 1-3, then the mismatch and the update, then what only some
    runs have (a sparse budget, DistillSparse, errors, the shipped bytes of a disaggregated run)."""
    g = lambda k, f: f.format(rec[k]) if rec.get(k) is not None else ""
    nz = lambda k, f: g(k, f) if rec.get(k) else ""  # only when nonzero
    collect = (g("groups_kept", "kept {}") + g("groups", "/{}") + g("tries", " in {} tries")
               + (" SHORT" if rec.get("short") else ""),
               g("gen_s", "rollout {:.2f}s") + g("len_mean", " len {:.0f}")
               + g("kv_read", " kv {:.2f}"),
               g("reward", "reward {:.3f}") + g("reach_verify", " verify {:.2f}"))
    tq = f"tv q{1 - rec.get('alpha_bins', {}).get('q', 0.05):.2f}"  # the rollout TV's tail
    learn = (g("alpha_p5", "p5 alpha {:.3f}") + g("tv_tail", f" {tq} {{:.2f}}")
             + g("tv_mean", " mean {:.2f}") + g("mismatch", "mismatch {}")
             + g("spec_k", " k {}") + g("spec_accept", " accept {:.3f}") + g("spec_per_verify", " {:.2f} a verify"),
             g("loss", "loss {:+.4f}") + g("grad_norm", " gn {:.2f}") + g("train_s", " {:.1f}s"),
             g("acc", "acc {:.3f}"))
    bins, q = rec.get("alpha_bins", {}).get("p5"), rec.get("alpha_bins", {}).get("q", 0.05)
    tail = "p5" if q == 0.05 else f"q{q:g}"  # the quantile kv_quantile holds (p5: Sparrow's)
    kv = (g("rollout_speedup", "rollout vs dense {:.2f}x") + g("reward_gap", ", reward "
          "gap {:+.3f}") + g("dense_reward", " (dense {:.3f})"), g("kv_table", "kv table {}"))
    per_bin = ((f"kv read per bin {[round(x, 2) for x in rec['kv_read_bins']]}"
                if rec.get("kv_read_bins") else ""),
               f"{tail} alpha per bin {[round(x, 2) for x in bins]}" if bins else "")
    extra = (g("distill_kl", "distill kl {:.4f}"), nz("errors", "reward errors {}"),
             g("moe_diff", "moe routes differ {:.3f}") + g("moe_diff_tok", " (tokens {:.2f})")
             + g("alpha_own_p5", ", p5 alpha own {:.3f}") + g("alpha_replay_p5", " replay {:.3f}"),
             nz("timeouts", "reward timeouts {}"), nz("truncated", "truncated {}"),
             nz("skipped_nonfinite", "NONFINITE steps skipped {}"),
             g("sync_bytes", "sync {:,} bytes") + g("sync_ratio", " ({:.3f} of full)"))
    lines = [" | ".join(p for p in part if p) for part in (collect, learn, kv, per_bin, extra)]
    return f"step {rec['step']:4d}  " + "\n           ".join(line for line in lines if line)


def examples(problems, shown, n=3):
    """Which held-out problems the run shows before and after RL, from the warm start's greedy
    {index: (completion, reward)}: the easiest, a middle one and the hardest by difficulty among
    those it gets wrong (among all, when fewer than n are wrong), so that a reader sees what RL
    changed; the accuracy tables say how typical they are."""
    wrong = [i for i, (_, r) in shown.items() if r < 1.0]
    pool = wrong if len(wrong) >= n else list(shown)
    order = sorted(pool, key=lambda i: (problems[i].meta.get("difficulty", 0), i))
    return sorted({order[0], order[len(order) // 2], order[-1]})[:n] if order else []


def pass_ks(k):
    """The pass@j a run reports from k samples per problem: j = 1, 8, 64, ... up to k, and k."""
    return sorted({1, k} | {8 ** i for i in range(1, 8) if 8 ** i <= k})


def pass_at(rewards, ks):
    """pass@j for each j in ks from one problem's n sampled rewards (a reward of 1 is correct):
    the unbiased estimate 1 - C(n - c, j) / C(n, j) of the chance that j of them hold a correct
    one (Chen et al., 2021); j = n is whether any of them is correct."""
    n, c = len(rewards), int((rewards >= 1.0).sum())
    return [1.0 - math.comb(n - c, j) / math.comb(n, j) for j in ks]


def by_difficulty(scores, col):
    """[(difficulty, figure, figure, ...)] -> {difficulty: mean of column col}; {} if none has
    one."""
    out = {}
    for row in scores:
        if row[0] is not None:
            out.setdefault(row[0], []).append(row[col])
    return {d: sum(v) / len(v) for d, v in sorted(out.items())}


def summary(history, seconds, k=8):
    """The table that ends a run, as text: the figures of the steps, then (synthetic task) held-out
    accuracy per difficulty before and after RL, then the example completions before and after."""
    recs = history["records"]
    if not recs:
        return "no step ran"
    accs, n, tenth = [r["acc"] for r in recs if "acc" in r], len(recs), max(1, len(recs) // 10)
    mean = lambda k: sum(r.get(k, 0.0) for r in recs) / n
    total = lambda k: sum(r.get(k, 0) for r in recs)
    rows = [("steps", f"{n}"), ("held-out accuracy before RL", f"{history['acc0']}"),
            ("held-out accuracy after RL", f"{accs[-1] if accs else 'n/a'}"),
            ("reward, first 10% of steps", f"{sum(r['reward'] for r in recs[:tenth]) / tenth:.3f}"),
            ("reward, last 10% of steps", f"{sum(r['reward'] for r in recs[-tenth:]) / tenth:.3f}"),
            ("groups kept / step", f"{mean('groups_kept'):.1f} of {recs[0]['groups']}"),
            ("steps trained short", f"{total('short')}"),
            ("reward calls that errored / timed out", f"{total('errors')} / {total('timeouts')}"),
            ("rollout time / step", f"{mean('gen_s'):.2f}s"),
            ("train time / step", f"{mean('train_s'):.2f}s"),
            ("non-finite steps skipped", f"{total('skipped_nonfinite')}"),
            ("RL wall time", f"{seconds:.0f}s")]
    w = max(len(name) for name, _ in rows)
    out = ["", "summary", "-" * (w + 12)] + [f"{name:<{w}}  {v}" for name, v in rows]
    return "\n".join(out + per_difficulty(history, accs and recs[-1], k) + shown(history))


def per_difficulty(history, last, k):
    """Rows of held-out accuracy per difficulty: the warm start's greedy accuracy, and with
    eval_sampled its pass@1 and pass@j at the rollout temperature (j = 8, 64, ... k: the columns
    the history holds); then the same after RL (greedy only, without eval_sampled). Whether RL
    sharpened what the start could already sample (after RL's pass@1 <= the start's pass@k) or went
    past it (above) reads off one row."""
    start = history.get("start") or {}
    end = history.get("end") or {"greedy": (last or {}).get("acc_by_difficulty", {})}
    if not start.get("greedy"):
        return []
    names = ["greedy"] + sorted((c for c in start if c.startswith("pass@")),
                                key=lambda c: int(c[5:]))
    cols = [(side, name, {int(d): a for d, a in h.get(name, {}).items()})
            for side, h in (("start", start), ("after RL", end)) for name in names]
    w = 9
    rows = ["", "held-out accuracy by difficulty (start: the warm start; after RL: the end)",
            "difficulty " + "".join(f"{side[:w - 1]:>{w}}" for side, _, _ in cols),
            " " * 11 + "".join(f"{name:>{w}}" for _, name, _ in cols)]
    for d in sorted(start["greedy"], key=int):
        rows.append(f"{d:>10} " + "".join(f"{c.get(int(d), float('nan')):>{w}.3f}"
                                          for _, _, c in cols))
    return rows


def clip(text, n=300):
    """A text of at most about n characters, on one line: a long one keeps its start and its end
    (a long generation's answer is at the end)."""
    text = text.strip().replace("\n", "\\n")
    return text if len(text) <= n else f"{text[:n // 2]} ... {text[-n // 2:]}"


def shown(history):
    """The example problems, with the completion before and after RL (long texts clipped: the
    history keeps them whole)."""
    out = []
    for ex in history.get("examples", []):
        out += ["", f"problem: {clip(ex['prompt'])}  (answer {ex['answer']})",
                f"  before RL: {clip(ex.get('before', ''))}",
                f"  after RL:  {clip(ex.get('after', ''))}"]
    return out


def plot(history, path):
    """Training reward per step and held-out accuracy over the run (overall, and per difficulty
    when the task has them), side by side, to `path`."""
    recs = history["records"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot([r["step"] for r in recs], [r["reward"] for r in recs], lw=1)
    ax[0].set(xlabel="step", ylabel="mean reward", title="training reward")
    evals = [r for r in recs if "acc" in r]
    start = (history.get("start") or {}).get("greedy") or {}
    diffs = sorted({int(d) for r in evals for d in r.get("acc_by_difficulty", {})})
    for i, d in enumerate(diffs):  # easy to hard: light to dark
        pts = [(0, start[d])] if d in start else []
        pts += [(r["step"] + 1, r["acc_by_difficulty"].get(str(d), r["acc_by_difficulty"].get(d)))
                for r in evals]
        ax[1].plot(*zip(*pts), lw=1, label=f"d={d}",
                   color=plt.cm.viridis_r(0.1 + 0.9 * i / max(1, len(diffs) - 1)))
    pts = [(0, history["acc0"])] if history["acc0"] is not None else []
    pts += [(r["step"] + 1, r["acc"]) for r in evals]
    if pts:
        ax[1].plot(*zip(*pts), marker="o", color="black", label="all")
    ax[1].set(xlabel="step", ylabel="greedy accuracy", title="held-out accuracy", ylim=(0, 1))
    ax[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def hardware(gpu=False):
    """Where a figure was measured: '<cpu model>, <n> cores, <t> threads', or the GPU's name."""
    if gpu:
        return torch.cuda.get_device_name(0)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


# -------------------------------------------------------------------------- experiment tracking

INSTALL = {"trackio": "pip install trackio", "wandb": "pip install wandb"}


def tracker_package(name):
    """The tracker's package, imported only when a run asks for it: both are optional, and both
    take seconds to import. A missing one names the package and the command that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"config key 'tracker' is {name!r}, but {name} does not import ({e}): "
                          f"`{INSTALL[name]}`, or run with --tracker=none") from None


class Tracker:
    """A run as an experiment tracker sees it: the config at the start, each step's metrics.jsonl
    record, run.png at the end. trackio and wandb share these calls (init, log, Image, finish).
    - trackio is local-first: a SQLite database under TRACKIO_DIR (default
      ~/.cache/huggingface/trackio), no account, no network; `trackio show` opens its dashboard.
    - wandb runs offline (WANDB_MODE=offline unless set), into out_dir/wandb; `wandb sync` uploads.
    The run is project "zeros", named after out_dir; a resumed run continues the tracker's run of
    that name (trackio) or starts a new one (wandb). With tracker=none, or on a rank other than 0,
    every call does nothing."""

    def __init__(self, cfg, rank=0):
        self.lib = None
        if cfg.tracker == "none" or rank != 0:
            return
        self.lib = tracker_package(cfg.tracker)
        name = os.path.basename(os.path.normpath(cfg.out_dir))
        kw = dict(project="zeros", name=name, config=dataclasses.asdict(cfg))
        if cfg.tracker == "wandb":
            os.environ.setdefault("WANDB_MODE", "offline")  # a user's WANDB_MODE=online wins
            kw["dir"] = cfg.out_dir
        else:  # no CPU and GPU sampling thread beside the loop: the record has what matters
            kw.update(resume="allow" if cfg.resume else "never", auto_log_cpu=False,
                      auto_log_gpu=False)
        self.lib.init(**kw)
        self.step = 0

    def log(self, rec):
        """One step's record, as metrics.jsonl has it; its "step" goes as the tracker's step
        (trackio reserves the name as a metric)."""
        if self.lib:
            self.step = rec["step"]
            self.lib.log({k: v for k, v in rec.items() if k != "step"}, step=self.step)

    def finish(self, png):
        """run.png (when out_dir has one) at the last step, then close the tracker's run."""
        if not self.lib:
            return
        if os.path.exists(png):
            self.lib.log({"run.png": self.lib.Image(png)}, step=self.step)
        self.lib.finish()


# bench/RESULTS.md: every results table is a marked block that its command rewrites
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench", "RESULTS.md")


def write_block(section, text, path=RESULTS):
    """Replace what lies between `<!-- bench:<section> -->` and `<!-- /bench:<section> -->` in path.
    Returns False (and writes nothing) when the file or a marker is missing."""
    start, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    if not os.path.exists(path):
        return False
    with open(path) as f:
        doc = f.read()
    a, b = doc.find(start), doc.find(end)
    if a < 0 or b < a:
        return False
    with open(path, "w") as f:
        f.write(doc[:a + len(start)] + "\n" + text + "\n" + doc[b:])
    return True
