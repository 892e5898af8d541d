"""
report.py: what a person reads of a run. The step's log lines, the summary table at the end, and
out_dir/run.png. train.py calls these; every figure they show is also in out_dir/metrics.jsonl.

The step lines, one stage after another (the README explains each label):
    step   12  kept 14/16 in 2 tries | rollout 0.65s len 34 kv 1.00 | reward 0.858 verify 0.00
               p5 alpha 0.912 | loss +0.0123 gn 0.92 1.8s | acc 1.000
               rollout vs dense 1.52x | kv table [3, 4] | ...  (only what this run has)

Simplifications:
    1. Every line stays within 100 columns; a figure a run does not have is left out, not zeroed.
    2. The plot is reward per step and greedy held-out accuracy at each evaluation, nothing more.
"""

import matplotlib

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
    learn = (g("alpha_p5", "p5 alpha {:.3f}"),
             g("loss", "loss {:+.4f}") + g("grad_norm", " gn {:.2f}") + g("train_s", " {:.1f}s"),
             g("acc", "acc {:.3f}"))
    bins = rec.get("alpha_bins", {}).get("p5")
    extra = (g("rollout_speedup", "rollout vs dense {:.2f}x"), g("kv_table", "kv table {}"),
             f"p5 alpha per bin {[round(x, 2) for x in bins]}" if bins else "",
             g("distill_kl", "distill kl {:.4f}"), nz("errors", "reward errors {}"),
             nz("timeouts", "reward timeouts {}"), nz("truncated", "truncated {}"),
             nz("skipped_nonfinite", "NONFINITE steps skipped {}"),
             g("sync_bytes", "sync {:,} bytes") + g("sync_ratio", " ({:.3f} of full)"))
    lines = [" | ".join(p for p in part if p) for part in (collect, learn, extra)]
    return f"step {rec['step']:4d}  " + "\n           ".join(line for line in lines if line)


def summary(history, seconds):
    """The table that ends a run, as text."""
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
    w = max(len(k) for k, _ in rows)
    return "\n".join(["", "summary", "-" * (w + 12)] + [f"{k:<{w}}  {v}" for k, v in rows])


def plot(history, path):
    """Training reward per step and held-out accuracy over the run, side by side, to `path`."""
    recs = history["records"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot([r["step"] for r in recs], [r["reward"] for r in recs], lw=1)
    ax[0].set(xlabel="step", ylabel="mean reward", title="training reward")
    pts = [(0, history["acc0"])] if history["acc0"] is not None else []
    pts += [(r["step"] + 1, r["acc"]) for r in recs if "acc" in r]
    if pts:
        ax[1].plot(*zip(*pts), marker="o")
    ax[1].set(xlabel="step", ylabel="greedy accuracy", title="held-out accuracy", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
