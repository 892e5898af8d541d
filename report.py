"""
report.py: what a person reads of a run. The step's log lines, the summary table at the end,
out_dir/run.png, out_dir/summary.json (the start's and the end's figures for a script: held-out
accuracy per difficulty before and after RL, each figure beside its problem count, the summary's
rows, the examples and ledger.py's ledger), the hardware line every measured figure names, and the
experiment tracker (`tracker` in config.py) that gets the same figures. train.py calls these; every
per-step figure they show is also in out_dir/metrics.jsonl. Besides: `python train.py --help`
(help_text: every key by stage), and the notes a run logs at its start for the keys it sets that
do nothing in it (idle_keys: `--stop_at=80` with steps=80, an overlong_buffer with
overlong_penalty 0, ...; kv_reads_all: a sparse kv_budget that drops no page at any length the
run reaches).

The step lines, one stage after another (the README explains each label):
    step   12  kept 14/16 in 2 tries | rollout 0.65s len 34 kv 1.00 | reward 0.858 verify 0.00
               p5 alpha 0.912 tv q0.95 0.41 mean 0.12 | loss +0.0123 gn 0.92 1.8s | acc 1.000
               rollout vs dense 1.52x, reward gap -0.031 (dense 0.640) | kv table [3, 4] | ...
               (only what this run has)

Simplifications:
    1. Every line stays within 100 columns; a figure a run does not have is left out, not zeroed.
    2. The plot is reward per step and greedy held-out accuracy at each evaluation, nothing more,
       on one x: the optimizer steps the policy had taken (a step's reward at its step, held-out
       accuracy after step s at s + 1). A figure that has no value (an empty bin's NaN) shows as
       "-" in the tables and null in summary.json.
    3. The tracker gets metrics.jsonl's records as they are (nested dicts and lists included), the
       config and summary.json's figures at the start, and at the end the end's figures, run.png
       and ledger.png; summary.json's figures go flat, numbers only. No system metrics.

    python train.py --tracker=trackio --out_dir=out/tracked   # then `trackio show --project zeros`
    python train.py --tracker=wandb                            # offline; `wandb sync` uploads it
"""

import dataclasses
import importlib
import inspect
import json
import math
import os
import platform
import re
import textwrap

import matplotlib
import torch

from config import Config, parse_config
from sparsity import fixed_budget, fraction_budget, pages_to_read, table_budget

matplotlib.use("Agg")  # the plot is a file: no display needed
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import MaxNLocator  # noqa: E402


def step_lines(rec):
    """The step's log lines: stages 1-3, then the mismatch and the update, then what only some
    runs have (a sparse budget, DistillSparse, errors, the shipped bytes of a disaggregated run)."""
    g = lambda k, f: f.format(rec[k]) if rec.get(k) is not None else ""
    nz = lambda k, f: g(k, f) if rec.get(k) else ""  # only when nonzero
    collect = (g("groups_kept", "kept {}") + g("groups", "/{}") + g("tries", " in {} tries")
               + (" SHORT" if rec.get("short") else ""),
               g("gen_s", "rollout {:.2f}s") + g("len_mean", " len {:.0f}")
               + g("entropy", " ent {:.2f}")
               + g("kv_read", " kv {:.2f}"),
               g("reward", "reward {:.3f}") + g("reach_verify", " verify {:.2f}"))
    tq = f"tv q{1 - rec.get('alpha_bins', {}).get('q', 0.05):.2f}"  # the rollout TV's tail
    learn = (g("alpha_p5", "p5 alpha {:.3f}") + g("tv_tail", f" {tq} {{:.2f}}")
             + g("tv_mean", " mean {:.2f}") + g("mismatch", "mismatch {}")
             + g("spec_k", " k {}") + g("spec_accept", " accept {:.3f}")
             + g("spec_per_verify", " {:.2f} a verify"),
             g("loss", "loss {:+.4f}") + g("grad_norm", " gn {:.2f}") + g("train_s", " {:.1f}s"),
             g("acc", "acc {:.3f}"))
    bins, q = rec.get("alpha_bins", {}).get("p5"), rec.get("alpha_bins", {}).get("q", 0.05)
    tail = "p5" if q == 0.05 else f"q{q:g}"  # the quantile kv_quantile holds (p5: Sparrow's)
    kv = (g("rollout_speedup", "rollout vs dense {:.2f}x") + g("reward_gap", ", reward "
          "gap {:+.3f}") + g("dense_reward", " (dense {:.3f})"), g("kv_table", "kv table {}"))
    per_bin = ((f"kv read per bin {per_bin_list(rec['kv_read_bins'])}"
                if rec.get("kv_read_bins") else ""),
               f"{tail} alpha per bin {per_bin_list(bins)}" if bins else "")
    extra = (g("distill_kl", "distill kl {:.4f}"), nz("errors", "reward errors {}"),
             g("moe_diff", "moe routes differ {:.3f}") + g("moe_diff_tok", " (tokens {:.2f})")
             + g("alpha_own_p5", ", p5 alpha own {:.3f}") + g("alpha_replay_p5", " replay {:.3f}"),
             nz("timeouts", "reward timeouts {}"), nz("truncated", "truncated {}"),
             nz("skipped_nonfinite", "NONFINITE steps skipped {}"),
             g("sync_bytes", "sync {:,} bytes") + g("sync_ratio", " ({:.3f} of full)"))
    lines = [" | ".join(p for p in part if p) for part in (collect, learn, kv, per_bin, extra)]
    return f"step {rec['step']:4d}  " + "\n           ".join(line for line in lines if line)


def cell(x, digits=3):
    """A figure to `digits` decimals, or "-" where there is none (None, or the NaN of an empty
    bin)."""
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def per_bin_list(xs):
    """A figure per bin, 2 decimals, "-" for a bin that no position reached: [0.91, -]."""
    return "[" + ", ".join(cell(x, 2) for x in xs) + "]"


def figure(x, fmt="{:.3f}"):
    """A number as the summary prints it; None as n/a, anything else as it is."""
    return "n/a" if x is None else fmt.format(x) if isinstance(x, (int, float)) else str(x)


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


def summary_rows(history, seconds):
    """The summary's rows: [(name, text, value)], the value a number (None where there is none)
    for out_dir/summary.json, the text as the table prints it."""
    recs = history["records"]
    accs, n, tenth = [r["acc"] for r in recs if "acc" in r], len(recs), max(1, len(recs) // 10)
    mean = lambda k: sum(r.get(k, 0.0) for r in recs) / n
    total = lambda k: sum(r.get(k, 0) for r in recs)
    first = sum(r["reward"] for r in recs[:tenth]) / tenth
    last = sum(r["reward"] for r in recs[-tenth:]) / tenth
    after = accs[-1] if accs else None
    ent = [sum(r["entropy"] for r in part) / len(part) for part in (recs[:tenth], recs[-tenth:])
           if all("entropy" in r for r in part)]
    ent = ent if len(ent) == 2 else None
    return [("steps", f"{n}", n),
            ("held-out accuracy before RL", figure(history["acc0"]), history["acc0"]),
            ("held-out accuracy after RL", figure(after), after),
            ("reward, first 10% of steps", f"{first:.3f}", first),
            ("reward, last 10% of steps", f"{last:.3f}", last),
            ("groups kept / step", f"{mean('groups_kept'):.1f} of {recs[0]['groups']}",
             mean("groups_kept")),
            ("steps trained short", f"{total('short')}", total("short")),
            ("reward calls that errored / timed out", f"{total('errors')} / {total('timeouts')}",
             [total("errors"), total("timeouts")]),
            ("rollout time / step", f"{mean('gen_s'):.2f}s", mean("gen_s")),
            ("train time / step", f"{mean('train_s'):.2f}s", mean("train_s")),
            ("non-finite steps skipped", f"{total('skipped_nonfinite')}",
             total("skipped_nonfinite")),
            ("RL wall time", f"{seconds:.0f}s", seconds)] + ([
            ("entropy (-log p a sampled token), first / last 10%", f"{ent[0]:.3f} / {ent[1]:.3f}",
             ent)] if ent else [])


def summary(history, seconds, k=8):
    """The table that ends a run, as text: the figures of the steps, then (a task with difficulties)
    held-out accuracy per difficulty before and after RL, then the example completions before and
    after."""
    recs = history["records"]
    if not recs:
        return "no step ran"
    rows = summary_rows(history, seconds)
    w = max(len(name) for name, _, _ in rows)
    out = ["", "summary", "-" * (w + 12)] + [f"{name:<{w}}  {v}" for name, v, _ in rows]
    last = [r for r in recs if "acc" in r][-1:]
    return "\n".join(out + per_difficulty(history, last and last[0], k) + shown(history))


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
    n = {side: {int(d): c for d, c in cs.items()}
         for side, cs in (history.get("counts") or {}).items()}  # problems behind each figure
    nk = ([("n", n.get("greedy", {}))] + ([("n@k", n.get("sampled", {}))] if len(names) > 1
                                          else [])) if n else []
    w = 9
    rows = ["", "held-out accuracy by difficulty (start: the warm start; after RL: the end): right "
                "answers only;", "n: the problems of each difficulty, n@k: those pass@k samples",
            "difficulty " + " " * 6 * len(nk) + "".join(f"{side[:w - 1]:>{w}}"
                                                      for side, _, _ in cols),
            " " * 11 + "".join(f"{name:>6}" for name, _ in nk)
            + "".join(f"{name:>{w}}" for _, name, _ in cols)]
    for d in sorted(start["greedy"], key=int):  # "-": no figure for that difficulty
        rows.append(f"{d:>10} " + "".join(f"{c.get(int(d), '-'):>6}" for _, c in nk)
                    + "".join(f"{cell(c.get(int(d))):>{w}}" for _, _, c in cols))
    return rows


def difficulty_table(history, counts):
    """Held-out accuracy per difficulty before and after RL, as out_dir/summary.json holds it:
    {"before RL": {"greedy": {d: {"value": x, "n": problems}}, "pass@1": {...}, ...}, "after RL":
    {...}}, n the held-out problems behind that figure (counts: {difficulty: problems}; pass@k's,
    where it samples a subset: history["counts"]["sampled"]). After RL, before the end's pass@k:
    the last evaluation's greedy column."""
    last = next((r for r in reversed(history["records"]) if "acc_by_difficulty" in r), {})
    sides = {"before RL": history.get("start") or {},
             "after RL": history.get("end") or ({"greedy": last["acc_by_difficulty"]}
                                                 if last else {})}
    sampled = {int(d): c for d, c in (history.get("counts") or {}).get("sampled", counts).items()}
    n = lambda name, d: (sampled if name.startswith("pass@") else counts).get(int(d))  # noqa: E731
    return {side: {name: {str(d): {"value": plain(v), "n": n(name, d)}
                          for d, v in sorted(col.items(), key=lambda x: int(x[0]))}
                   for name, col in cols.items()}
            for side, cols in sides.items()}


def plain(x):
    """x with every NaN or infinity (an empty bin's figure) as None: JSON has no NaN."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def run_figures(history, problems, seconds=None, ledger=None):
    """What out_dir/summary.json holds: at the start (seconds None), the held-out set's counts per
    difficulty, the warm start's accuracy and its per-difficulty table; at the end, the same with
    the figures after RL, the summary's rows, the examples and the ledger."""
    counts = {}
    for p in problems:
        d = p.meta.get("difficulty")
        if d is not None:
            counts[d] = counts.get(d, 0) + 1
    out = {"finished": seconds is not None,
           "held_out": {"problems": len(problems), "by_difficulty": dict(sorted(counts.items()))},
           "accuracy_before_rl": history.get("acc0"),
           "by_difficulty": difficulty_table(history, counts)}
    if (history.get("counts") or {}).get("sampled"):  # pass@k's problems, where a subset
        out["held_out"]["sampled_by_difficulty"] = dict(sorted(
            history["counts"]["sampled"].items()))
    if seconds is not None and history["records"]:
        rows = summary_rows(history, seconds)
        out.update(accuracy_after_rl=rows[2][2], summary={name: v for name, _, v in rows},
                   examples=history.get("examples", []))
    if ledger is not None:
        out["ledger"] = ledger
    return plain(out)


def write_summary(out_dir, figures):
    """out_dir/summary.json, written whole (a new file renamed over the old): a reader never sees
    half of it."""
    path = os.path.join(out_dir, "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(figures, f, indent=1, allow_nan=False)
    os.replace(path + ".tmp", path)
    return path


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


# what a task's difficulty counts (tasks.py: the generator's first knob), for run.png's legend
DIFFICULTY_NAMES = {"synthetic": "terms", "reasoning_gym:chain_sum": "terms",
                    "reasoning_gym:countdown": "numbers",
                    "reasoning_gym:string_splitting": "initial machines"}


def difficulty_name(cfg):
    """What the difficulty d counts in this run's task ("terms"), or "" where it is not known."""
    if cfg.task == "synthetic" and cfg.order == "lagged":
        return "lines"
    return DIFFICULTY_NAMES.get(cfg.task, "")


def plot_series(history):
    """run.png's lines, on one x: the optimizer steps the policy had taken when it was measured.
    A step's reward sits at its step number (0-based: its rollouts come before its update), the
    held-out accuracy measured after step s at s + 1, the warm start's at 0. -> {"reward": (xs,
    ys), "all": [(x, acc)], difficulty: [(x, acc)]}."""
    recs = history["records"]
    evals = [r for r in recs if "acc" in r]
    start = {int(d): a for d, a in ((history.get("start") or {}).get("greedy") or {}).items()}
    out = {"reward": ([r["step"] for r in recs], [r["reward"] for r in recs])}
    for d in sorted({int(d) for r in evals for d in r.get("acc_by_difficulty", {})}):
        by = lambda r: r["acc_by_difficulty"].get(str(d), r["acc_by_difficulty"].get(d))
        out[d] = ([(0, start[d])] if d in start else []) + [(r["step"] + 1, by(r)) for r in evals]
    out["all"] = ([(0, history["acc0"])] if history.get("acc0") is not None else []) + [
        (r["step"] + 1, r["acc"]) for r in evals]
    return out


def plot(history, path, name=""):
    """Training reward per step and held-out accuracy over the run (overall, and per difficulty
    when the task has them; `name`: what a difficulty counts, "terms"), side by side, to `path`.
    Both panels share plot_series's x (optimizer steps done) and integer ticks. The difficulties'
    lines differ in colour (turbo, easy to hard), line style and marker, so that lines that meet
    (at 1.0, say) stay apart; the legend sits outside, right of the plot."""
    series = plot_series(history)
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    ax[0].plot(*series["reward"], lw=1)
    xlabel = "optimizer steps done (the policy after x RL steps)"
    ax[0].set(xlabel=xlabel, ylabel="mean reward", title="training reward (a step's rollouts)")
    diffs = [d for d in series if isinstance(d, int)]
    for i, d in enumerate(diffs):
        label = f"{d} {name}" if name else f"difficulty {d}"
        ax[1].plot(*zip(*series[d]), lw=1.2, label=label, ls=("-", "--", ":", "-.")[i % 4],
                   marker="os^vD<>ph*"[i % 10], ms=4, mfc="none",
                   color=plt.cm.turbo(0.05 + 0.9 * i / max(1, len(diffs) - 1)))
    if series["all"]:
        ax[1].plot(*zip(*series["all"]), lw=2.5, marker="o", color="black", label="all",
                   zorder=1.5)
    ax[1].set(xlabel=xlabel, ylabel="greedy accuracy", title="held-out accuracy (0: the warm "
              "start)", ylim=(-0.05, 1.05))  # a margin: lines at 0 or 1 stay visible
    for a in ax:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 0.5
    if series["all"] or diffs:
        ax[1].legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
                     ncol=1 + (len(diffs) > 12), title=f"number of {name}" if name else None)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return fig


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


# ----------------------------------------------------------------------------- keys that do nothing

# (keys, when they do nothing, why): each such key that a run sets away from Config's default gets a
# line in the log at the start. Only what is certain from the config alone.
TINY_KEYS = ("n_layer n_embd n_head n_kv_head ffn n_expert n_expert_active moe_ffn sft_steps "
             "sft_batch sft_lr sft_noise sft_slip sft_max_lines sft_difficulty sft_init sft_seed "
             "sft_rg_kwargs")
IDLE = [("stop_at", lambda c: c.stop_at >= c.steps, "steps={c.steps} ends the run first"),
        ("overlong_buffer", lambda c: not c.overlong_penalty, "overlong_penalty is 0"),
        ("overlong_penalty", lambda c: not c.overlong_buffer, "overlong_buffer is 0"),
        ("refill_tries", lambda c: not c.dynamic_sampling, "dynamic_sampling is false"),
        ("judge_timeout_s", lambda c: not c.judge, "no judge is set"),
        ("kl_loss", lambda c: not c.kl_coef, "kl_coef is 0"),
        ("is_cap", lambda c: c.is_correction != "tis", "is_correction is {c.is_correction}"),
        ("mis_low mis_high", lambda c: c.is_correction != "mis",
         "is_correction is {c.is_correction}"),
        ("lora_alpha lora_dropout", lambda c: not c.lora_r, "lora_r is 0"),
        ("spec_k", lambda c: c.rollout_mode != "speculative", "rollout_mode is {c.rollout_mode}"),
        ("distill_lr distill_coef distill_pg", lambda c: not c.distill_r, "distill_r is 0"),
        ("kv_scorer kv_rescore_every dense_layers kv_keep_first kv_keep_recent",
         lambda c: c.kv_budget == "dense", "kv_budget is dense: every layer reads every page"),
        ("max_staleness", lambda c: not c.rollout_ranks, "colocated (rollout_ranks is 0)"),
        ("eval_k", lambda c: not c.eval_sampled, "eval_sampled is false"),
        ("n_expert_active moe_ffn", lambda c: not c.n_expert, "n_expert is 0"),
        (TINY_KEYS, lambda c: bool(c.model), "model is set, and they shape only the tiny model "
                                             "and its warm start")]


def idle_keys(cfg):
    """A log line for each group of keys this run sets that do nothing in it (IDLE), "" if none: a
    probe that would measure nothing says so before the warm start."""
    base, out = Config(), []
    for keys, idle, why in IDLE:
        moved = [k for k in keys.split() if getattr(cfg, k) != getattr(base, k)]
        if moved and idle(cfg):
            out.append(f"note: {', '.join(f'{k}={show(getattr(cfg, k))}' for k in moved)} "
                       f"{'has' if len(moved) == 1 else 'have'} no effect in this run: "
                       + why.format(c=cfg))
    return "\n".join(out)


def kv_reads_all(cfg, model, train_ids):
    """A log line when a sparse kv_budget cannot drop a page in this run ("" otherwise): every layer
    of `model` is one of the dense_layers, or at every context length the run can reach (its
    longest training prompt plus max_new_tokens) the budget, with the pages every step keeps,
    covers every page. Calibrated, scheduled and controlled budgets are left out: their tables are
    not known yet."""
    kind, _, arg = cfg.kv_budget.partition(":")
    if kind not in ("fraction", "fixed", "table") or cfg.kv_controller:
        return ""
    n_layers, longest_prompt = model.config.num_hidden_layers, max(map(len, train_ids), default=0)
    if cfg.dense_layers >= n_layers:
        return (f"note: kv_budget={cfg.kv_budget} has no effect: the model's {n_layers} layers are "
                f"all among the first dense_layers={cfg.dense_layers}, which read every page")
    budget = (fraction_budget(float(arg)) if kind == "fraction" else fixed_budget(int(arg))
              if kind == "fixed" else table_budget(arg.split(","), cfg.kv_bin_pages))
    tokens = longest_prompt + cfg.max_new_tokens
    pages = -(-tokens // cfg.page_size)
    if any(pages_to_read(budget, n, n, cfg.kv_keep_first, cfg.kv_keep_recent) < n
           for n in range(1, pages + 1)):
        return ""
    return (f"note: kv_budget={cfg.kv_budget} reads every page: contexts of at most {tokens} "
            f"tokens are {pages} pages of {cfg.page_size}, and it keeps kv_keep_first + "
            f"kv_keep_recent = {cfg.kv_keep_first + cfg.kv_keep_recent} of them anyway")


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

    def figures(self, figures, step=0):
        """summary.json's figures (report.run_figures) at `step`: the numbers only, flat, their
        keys the path to them ("by_difficulty/before RL/greedy/5/value")."""
        if self.lib:
            self.lib.log(flat(figures), step=step)

    def finish(self, png, figures=None):
        """run.png and ledger.png beside it (those out_dir has), and the end's figures (flat, as
        `figures`), at the last step; then close the tracker's run."""
        if not self.lib:
            return
        logged = {os.path.basename(p): self.lib.Image(p)
                  for p in (png, os.path.join(os.path.dirname(png), "ledger.png"))
                  if os.path.exists(p)}
        logged.update(flat(figures or {}))
        if logged:
            self.lib.log(logged, step=self.step)
        self.lib.finish()


def flat(x, key=""):
    """{"a": {"b": 1.0, "c": [{"what": "x", "done": 2}]}} -> {"a/b": 1.0, "a/c/x/done": 2}: a
    nested figure's numbers under the path to them (list items under their "what", else their
    index); strings and None are left out."""
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            out.update(flat(v, f"{key}/{k}" if key else str(k)))
        return out
    if isinstance(x, (list, tuple)):
        return flat({(v.get("what") if isinstance(v, dict) and "what" in v else i): v
                     for i, v in enumerate(x)}, key)
    return {key: x} if isinstance(x, (int, float)) and not isinstance(x, bool) else {}


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


# ----------------------------------------------------------------------------- --help

# --help lists every key under the stage it acts in (a test checks that each key is in one)
STAGES = {
    "run": "out_dir seed device dtype autocast resume resume_override overwrite threads "
           "eval_every save_every "
           "plot tracker fsdp",
    "model": "model chat_template chat_thinking n_layer n_embd n_head n_kv_head ffn n_expert "
             "n_expert_active moe_ffn",
    "task (the data and the held-out set)": "task rg_kwargs sft_rg_kwargs eval_rg_kwargs "
        "rg_prompt data difficulty order n_train n_eval eval_difficulty eval_sampled eval_k "
        "eval_per_bin eval_k_per_bin",
    "warm start (the tiny model's SFT)": "sft_steps sft_batch sft_lr sft_loss sft_noise sft_slip "
        "sft_max_lines sft_difficulty sft_init sft_seed",
    "1 signal (which prompts)": "prompts_per_step sampler zone zone_prior explore dynamic_sampling "
        "refill_tries min_spread",
    "2 rollout (sparse KV, speculative decoding, DistillSparse)": "group_size max_new_tokens "
        "temperature top_p stop page_size kv_dtype kv_pool_tokens kv_budget kv_bin_pages kv_scorer kv_rescore_every "
        "dense_layers kv_keep_first kv_keep_recent kv_controller kv_hold kv_target kv_tv_target "
        "kv_quantile rollout_mode spec_k spec_k_max spec_draft decode_step alpha_topk "
        "kv_candidates calib_prompts "
        "kv_compare_every distill_r distill_lr distill_coef distill_pg",
    "3 rewards (the verifier cascade)": "math_verify max_chars judge judge_timeout_s "
        "overlong_buffer overlong_penalty overlong_filter",
    "4 update": "steps stop_at lr min_lr_ratio warmup_steps weight_decay grad_clip passes "
        "minibatches micro_batch logp_chunk share_prompt clip_low clip_high kl_coef kl_loss "
        "adv_norm "
        "max_skipped nm lora_r lora_alpha lora_dropout is_correction is_cap mis_low mis_high "
        "router_replay moe_aux_coef adv_eps pack",
    "5 sync (the rollout copy and the ranks that only generate)": "rollout_copy "
        "rollout_copy_mask rollout_ranks max_staleness",
}
# Config's section titles: comments above a key that describe the section, not the key
SECTION = re.compile(r"(run|data|rollout|warm start .*|stage \d: .*|evaluation, .*)")


def key_comments():
    """{key: its description}, read from Config's source: a key's comment on its line, after the
    comment lines just above it."""
    out, block = {}, []
    for line in inspect.getsource(Config).splitlines():
        code, _, inline = line.strip().partition("# ")
        key = re.match(r"(\w+): \w+ = ", code)
        if not code and not SECTION.fullmatch(inline):
            block.append(inline.strip())
        elif key:
            out[key.group(1)] = " ".join(block + [inline.strip()]).strip()
        if code:
            block = []
    return out


def show(v):
    """A value as --key= takes it."""
    return str(v).lower() if isinstance(v, bool) else v if isinstance(v, str) and v else repr(
        v).replace(" ", "")


def help_text(argv, usage=""):
    """--help: usage's first two paragraphs, then every key by stage with its type, the value this
    run would use (argv's config file, configs/tiny.py without one, and overrides applied; * where
    that is not Config's default) and what it does (its comments in Config)."""
    cfg, base, about = parse_config(argv), Config(), key_comments()
    files = ", ".join(a for a in argv if not a.startswith("-")) or "configs/tiny.py"
    out = ["\n\n".join(usage.strip("\n").split("\n\n")[:2]), ""] + textwrap.wrap(
        f"Every key, as --key=value: the value this run would use ({files}, then the command "
        f"line; * where it is not Config's default), its type and what it does.", 100)
    for stage, keys in STAGES.items():
        out += ["", stage]
        for k in keys.split():
            v = getattr(cfg, k)
            head = (f" {'*' if v != getattr(base, k) else ' '}--{k}={show(v)} "
                    f"({type(v).__name__})")
            text = textwrap.wrap(about.get(k, ""), 62) or [""]
            if len(head) > 36:
                out.append(head)
                head = ""
            out += [f"{head:<37}{text[0]}".rstrip()] + [" " * 37 + t for t in text[1:]]
    return "\n".join(out)
