"""
ledger.py: what each stage of a run skipped, and what that saved. At the end of every run,
train.py prints one row per stage, writes the same figures to out_dir/summary.json (key "ledger")
and to the tracker, and draws out_dir/ledger.png: spent against skipped, per stage.

Each row sets what the run did beside what the same run would have done without that stage's skip
(the other stages as they ran), as counts and as estimated compute:
    1 signal   prompts trained against those drawn (a loop without the filter trains every group
               it generates); the groups with no reward spread, the rollouts spent on the ones
               dropped, the refill tries. Compute: the update's forward and backward over them
    2 rollout  prefill tokens computed against G prefills per prompt; KV pages that decode read
               against every page; lossless mode: draft tokens accepted, and the dense verifies
               run against one dense forward a token (a draft costs a forward too: it can spend
               more FLOPs than it saves, and shows so). Compute: prefill, decode's weights, its
               attention over the pages read
    3 rewards  completions settled by each cheap stage (dedup, the cheap checks, the exact match)
               and sent to the verifier (and judge) against every completion verified. Compute: a
               verifier is a program, not FLOPs: its measured seconds, and the naive side at its
               mean seconds per call
    4 updates  trainable parameters (LoRA; N:M's active weights) against all of them; the optimizer
               state held against AdamW's two fp32 moments of every parameter. Compute: forward,
               backward and the weight gradients of what trains
    5 sync     bytes shipped to the rollout side against the full model at every shipment
And the share of the RL loop's wall time each stage took (measured).

Honest figures: a skip that did not happen shows 0 skipped; a row with nothing to count says why.
FLOPs and seconds of compute are estimates (marked ~), from two rates measured on this machine at
the end of the run (machine_rates: a matmul's FLOP/s, a sum's bytes/s), the way bench/cost.py's
cost model divides: seconds = FLOPs / FLOP/s + bytes / bytes/s. The wall-time shares are measured.

Simplifications:
    1. FLOPs per token are 2 P for a forward, P the parameters a token multiplies through (all of
       them, the embedding lookup aside; an MoE's router and active experts), as bench/cost.py's
       model_shape counts them; prefill's attention over the prompt and the optimizer's own
       arithmetic are left out.
    2. A training token costs 4 P (forward and input gradients) plus 2 P' (P': the parameters that
       get weight gradients: all of them under N:M, whose masks zero the gradients after they are
       computed, so N:M skips no FLOP here) a pass. The tokens are the kept rollouts' prompts and
       completions at the run's mean lengths; the log-prob pass before the updates is left out.
    3. A KV page read costs 4 page_size Hq head_dim FLOPs and 2 page_size Hkv head_dim bytes per
       element a layer, full pages counted; the weights' traffic is left out (bench/cost.py's
       formula leaves it out too).
    4. The reward counts are the step records' fractions times their completions. Exact on one
       process (the default); under torchrun the engine's counts and the cascade's fractions are
       the first collecting rank's, the prompts and completions every rank's.

    python train.py                 # prints the ledger after the summary; out_dir/ledger.png
    python ledger.py out/tiny       # again, from a finished run's out_dir/summary.json
"""

import json
import os
import sys
import textwrap
import time

import matplotlib
import torch

matplotlib.use("Agg")  # the picture is a file: no display needed
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.patches import Patch  # noqa: E402

STAGES = ("signal", "rollout", "rewards", "updates", "sync")


# ----------------------------------------------------------------------- the run's fixed figures


def machine_rates(n=512, nbytes=64 << 20, repeats=3):
    """This machine's fp32 FLOP/s (an n x n matmul) and read bytes/s (summing nbytes of fp32), best
    of `repeats`: the cost model's two rates, as bench/cost.py measures them, smaller (a run's end
    should not wait for them)."""
    a, b, x = torch.randn(n, n), torch.randn(n, n), torch.ones(nbytes // 4)
    best = [float("inf")] * 2
    for _ in range(repeats):
        for i, f in enumerate((lambda: a @ b, lambda: x.sum())):
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    return {"flop_s": 2 * n ** 3 / best[0], "bytes_s": nbytes / best[1],
            "how": f"estimates: {n}x{n} fp32 matmul and a {nbytes >> 20} MiB fp32 sum, best of "
                   f"{repeats}, timed at the end of the run"}


def params_per_token(mc):
    """The parameters a token multiplies through (bench/cost.py's model_shape, restated: a stage
    file does not import the bench): every layer (an MoE's router and active experts only), the
    final norm and the output head; the embedding is a lookup."""
    C, hd, Hq, Hkv = mc.hidden_size, mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads
    attn = 2 * C * Hq * hd + 2 * C * Hkv * hd + 2 * hd
    if getattr(mc, "attention_bias", False):
        attn += Hq * hd + 2 * Hkv * hd + C
    P = C * mc.vocab_size + C
    for i in range(mc.num_hidden_layers):
        moe = getattr(mc, "num_experts", 0) and mc.is_moe_layer(i)
        mlp = (C * mc.num_experts + mc.num_experts_per_tok * 3 * C * mc.moe_intermediate_size
               if moe else 3 * C * mc.intermediate_size)
        P += attn + mlp + 2 * C
    return P


def run_facts(cfg, run):
    """What the ledger needs besides the step records, read off train.py's Run: the model's shape,
    parameter counts (all; trainable: LoRA's adapters, N:M's active weights; with weight
    gradients), the optimizer state held, the model's bytes."""
    full = run.replica or run.model
    mc, params = full.config, list(run.model.parameters())
    grads = sum(p.numel() for p in params if p.requires_grad)
    trainable = grads
    if run.masked is not None:  # N:M: the pruned entries are parameters that never train
        trainable -= sum(int((~m).sum()) for m in run.masked.masks.values())
    state = [t for s in run.opt.state.values() for t in s.values() if torch.is_tensor(t)]
    kv_bytes = 2 if run.dev.type == "cuda" else next(full.parameters()).element_size()
    return {"P": params_per_token(mc), "layers": mc.num_hidden_layers,
            "Hq": mc.num_attention_heads, "Hkv": mc.num_key_value_heads, "hd": mc.head_dim,
            "page_size": cfg.page_size, "kv_bytes": kv_bytes, "group_size": cfg.group_size,
            "passes": cfg.passes, "params": sum(p.numel() for p in full.parameters()),
            "trainable": trainable, "grad_params": grads,
            "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
            "model_bytes": sum(p.numel() * p.element_size() for p in full.parameters()),
            "colocated": not run.role.split, "sender": run.sender is not None}


# ----------------------------------------------------------------------- the ledger


COUNTS = ("groups_drawn", "groups_signal", "groups_kept", "tries", "rollouts", "zero_adv_groups",
          "prefill_tokens", "prefill_tokens_naive", "new_tokens", "pages_read", "pages_dense",
          "drafted", "accepted", "verifies", "sync_bytes", "sync_full_bytes", "gen_s", "alpha_s",
          "t_reward", "t_verify", "t_judge", "collect_s", "train_s", "sync_s", "eval_s",
          "truncated")


def totals(records):
    """The step records summed: the COUNTS, and the cascade's fractions turned into counts
    (fraction x the step's completions)."""
    t = {k: sum(r.get(k) or 0 for r in records) for k in COUNTS}
    n = lambda r, k: r.get(k, 0.0) * r.get("rollouts", 0)
    t["dedup"] = round(sum(n(r, "dedup_saved") for r in records))
    t["cheap"] = round(sum(n(r, "cheap_fail") for r in records)) + t["truncated"]
    t["verify"] = round(sum(n(r, "reach_verify") for r in records))
    t["judge"] = round(sum(n(r, "reach_judge") for r in records))
    t["exact"] = round(sum(max(0.0, r.get("reach_exact", 0.0) - r.get("reach_verify", 0.0))
                           * r.get("rollouts", 0) for r in records))
    t["steps"] = len(records)
    return t


def compute(flops, nbytes, rates):
    """FLOPs and bytes -> estimated seconds on this machine (the cost model's two rates)."""
    return flops / rates["flop_s"] + nbytes / rates["bytes_s"]


def entry(what, done, naive=None, unit=""):
    return {"what": what, "done": done, "naive": naive, "unit": unit}


def signal_row(t, f, rates):
    """Stage 1: the groups the filter kept against all it drew, and the training it skipped."""
    G = f["group_size"]
    drawn = t["groups_drawn"] or t["rollouts"] // G  # records older than groups_drawn
    no_spread = drawn - t["groups_signal"] if t["groups_drawn"] else None
    dropped = drawn - t["groups_kept"]
    tok = (t["prefill_tokens_naive"] + t["new_tokens"]) / max(1, t["rollouts"])  # a rollout's
    per_tok = f["passes"] * (4 * f["P"] + 2 * min(f["P"], f["grad_params"]))
    flops = [n * G * tok * per_tok for n in (t["groups_kept"], drawn)]
    items = [entry("prompts trained, of drawn", t["groups_kept"], drawn, "prompts"),
             entry("groups with no reward spread", no_spread, None, "groups"),
             entry("of them trained anyway", t["zero_adv_groups"], None, "groups"),
             entry("rollouts in dropped groups", dropped * G, None, "rollouts"),
             entry("refill tries", t["tries"] - t["steps"], None, "tries")]
    return {"items": items, "compute": {"what": "training forward and backward", "unit": "FLOP",
                                        "done": flops[0], "naive": flops[1],
                                        "done_s": compute(flops[0], 0, rates),
                                        "naive_s": compute(flops[1], 0, rates)},
            "note": "the dropped groups' rollouts are counted in stage 2's work"}


def rollout_row(t, f, rates):
    """Stage 2: shared prefill, KV pages read, lossless drafts."""
    P, ps = f["P"], f["page_size"]
    page_flops, page_bytes = 4 * ps * f["Hq"] * f["hd"], 2 * ps * f["Hkv"] * f["hd"] * f["kv_bytes"]
    decode = t["new_tokens"] if not t["drafted"] else 2 * t["drafted"] + t["verifies"]
    done = (2 * P * (t["prefill_tokens"] + decode) + page_flops * t["pages_read"],
            page_bytes * t["pages_read"])
    naive = (2 * P * (t["prefill_tokens_naive"] + t["new_tokens"]) + page_flops * t["pages_dense"],
             page_bytes * t["pages_dense"])
    items = [entry("prefill tokens", t["prefill_tokens"], t["prefill_tokens_naive"], "tokens"),
             entry("KV pages read (x layers)", t["pages_read"], t["pages_dense"], "pages")]
    if t["drafted"]:
        items += [entry("draft tokens accepted, of drafted", t["accepted"], t["drafted"],
                        "tokens"),
                  entry("dense verifies, of dense forwards", t["verifies"],  # (a row's first
                        max(0, t["new_tokens"] - t["rollouts"]), "forwards")]  # token: prefill)
    return {"items": items, "compute": {
        "what": "prefill, decode weights and attention", "unit": "FLOP", "done": done[0],
        "naive": naive[0], "done_s": compute(*done, rates), "naive_s": compute(*naive, rates)},
        "note": "" if t["drafted"] else "lossless mode off: no drafts"}


def rewards_row(t, f, rates):
    """Stage 3: what each cheap stage settled, and what reached the verifier."""
    n, spent = t["rollouts"], t["t_verify"] + t["t_judge"]
    per_call = t["t_verify"] / t["verify"] if t["verify"] else None
    items = [entry("completions scored", n, None, "completions"),
             entry("settled by dedup", t["dedup"], None, "completions"),
             entry("by the cheap checks", t["cheap"], None,
                   "completions"),
             entry("by the exact match", t["exact"], None, "completions"),
             entry("verifier calls, of completions", t["verify"], n,
                   "completions")]
    if t["judge"]:
        items.append(entry("judge calls", t["judge"], None, "completions"))
    naive_s = None if per_call is None else n * per_call + t["t_judge"]
    return {"items": items, "compute": {
        "what": "verifier seconds (measured; naive: its mean call x every completion)",
        "unit": "s", "done": spent, "naive": naive_s, "done_s": spent, "naive_s": naive_s},
        "note": "" if per_call else "no completion reached the verifier: no call to time"}


def updates_row(t, f, rates):
    """Stage 4: what trains, the optimizer state, the weight gradients skipped."""
    tok = (t["prefill_tokens_naive"] + t["new_tokens"]) / max(1, t["rollouts"])
    tokens = t["groups_kept"] * f["group_size"] * tok * f["passes"]
    P = f["P"]
    flops = (tokens * (4 * P + 2 * min(P, f["grad_params"])), tokens * 6 * P)
    items = [entry("trainable parameters", f["trainable"], f["params"], "parameters"),
             entry("optimizer state held", f["optimizer_bytes"], 8 * f["params"], "bytes")]
    return {"items": items, "compute": {
        "what": "forward, backward, weight gradients", "unit": "FLOP", "done": flops[0],
        "naive": flops[1], "done_s": compute(flops[0], 0, rates),
        "naive_s": compute(flops[1], 0, rates)},
        "note": "" if f["trainable"] < f["params"] else "full fine-tuning: nothing skipped"}


def sync_row(t, f, rates):
    """Stage 5: bytes shipped against the full model at every shipment."""
    done, naive = t["sync_bytes"], t["sync_full_bytes"]
    note = ("" if naive else "nothing shipped: the rollout engine reads the policy's own "
            f"weights (colocated); a full copy is {f['model_bytes']:,} bytes")
    return {"items": [entry("bytes shipped, of the full model", done, naive, "bytes")],
            "compute": {"what": "bytes moved (at the memory rate; a network is slower)",
                        "unit": "B", "done": done, "naive": naive,
                        "done_s": compute(0, done, rates), "naive_s": compute(0, naive, rates)},
            "note": note}


def wall_time(t, seconds):
    """The RL loop's wall seconds by stage (measured): rollout (with its mismatch figures),
    rewards, signal (the rest of collecting: the sampler, the filter, gathers; and a sparse run's
    paired dense comparison, kv_compare_every), updates, sync, held-out evaluation, and what is
    left (logging, checkpoints)."""
    rollout = t["gen_s"] + t["alpha_s"]
    out = {"signal": max(0.0, t["collect_s"] - rollout - t["t_reward"]), "rollout": rollout,
           "rewards": t["t_reward"], "updates": t["train_s"], "sync": t["sync_s"],
           "held-out eval": t["eval_s"]}
    out["other"] = max(0.0, seconds - sum(out.values()))
    return out


def ledger(records, facts, seconds, rates=None):
    """The ledger of a run: {"stages": {stage: {"items", "compute", "note"}}, "wall_s": {...},
    "rates", "facts" (run_facts: what it was computed from), "about"} from its step records,
    run_facts and its RL wall seconds; rates: machine_rates() when None."""
    rates = rates or machine_rates()
    t = totals(records)
    rows = (signal_row, rollout_row, rewards_row, updates_row, sync_row)
    return {"about": "each stage's work beside the same run without that stage's skip",
            "rates": rates, "steps": t["steps"], "facts": facts,
            "stages": {s: row(t, facts, rates) for s, row in zip(STAGES, rows)},
            "wall_s": wall_time(t, seconds)}


# ----------------------------------------------------------------------- as text and as a picture


def human(x, unit=""):
    """1234567 -> '1.23M'; bytes as KiB/MiB/GiB; seconds to 2 digits (s, ms, us); None -> '-'."""
    if x is None:
        return "-"
    if unit == "s":  # 2 significant digits, in s, ms or us
        for u, scale in (("s", 1), ("ms", 1e-3), ("us", 1e-6)):
            if abs(x) >= scale or u == "us":
                return f"{x / scale:.2g}{u}" if abs(x) < 99.5 * scale else f"{x / scale:.0f}{u}"
    if unit == "bytes":
        for u, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if abs(x) >= 1 << s:
                return f"{x / (1 << s):.2f} {u}"
        return f"{x:.0f} B"
    for u, s in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= s:
            return f"{x / s:.2f}{u}"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def skipped(done, naive):
    """The share of the naive work skipped, as text: '88%', '0%', '+40% more' (spent beyond it)."""
    if done is None or not naive:
        return "-"
    s = 1 - done / naive
    if abs(s) < 0.005:  # AdamW's step counts beside its moments: not a skip either way
        return "0%"
    return f"{s:.0%}" if s > 0 else f"+{-s:.0%} more"


def text(book):
    """The ledger as the log prints it, within 100 columns ("" when no step ran): per stage the
    items that have a naive side as a table, the others on one line, the compute (~: estimated)
    and why a row has nothing to count."""
    if not book["steps"]:
        return ""
    r, wrap = book["rates"], lambda line: textwrap.wrap(line, 100, subsequent_indent=" " * 11)
    out = ["", f"ledger: {book['about']}",
           f"{'stage':<10} {'':<34} {'done':>11} {'naive':>11} {'skipped':>9}"]
    for stage, row in book["stages"].items():
        name = f"{STAGES.index(stage) + 1} {stage}"
        line = lambda what, d, n, u, tail="": f"{name:<10} {what:<34} {human(d, u):>11} " \
                                              f"{human(n, u):>11} {skipped(d, n):>9}{tail}"
        for it in (it for it in row["items"] if it["naive"] is not None):
            out.append(line(it["what"], it["done"], it["naive"], it["unit"]))
            name = ""
        rest = [f"{it['what']} {human(it['done'], it['unit'])}" for it in row["items"]
                if it["naive"] is None]
        if rest:
            out += wrap(f"{name:<10} " + "; ".join(rest))
            name = ""
        c = row["compute"]
        if c["unit"] == "s":  # measured seconds (the verifier's)
            out.append(line("verifier time, s (measured)", c["done"], c["naive"], "s"))
        elif c["unit"] == "B":  # the bytes are counted; only their seconds are estimated
            out.append(line("time to move them, s (estimated)", c["done_s"], c["naive_s"], "s"))
        else:
            secs = f"  ~{human(c['done_s'], 's')} of ~{human(c['naive_s'], 's')}"
            out.append(line(f"compute, {c['unit']} (estimated)", c["done"], c["naive"], "", secs))
        if row["note"]:
            out += wrap(" " * 11 + f"({row['note']})")
    wall = book["wall_s"]
    total = sum(wall.values()) or 1.0
    out += wrap("wall time  " + ", ".join(f"{k} {v / total:.0%}" for k, v in wall.items())
                + f" of {total:.0f}s (measured)")
    out += wrap(f"rates      {r['flop_s'] / 1e9:.1f} GFLOP/s, {r['bytes_s'] / 1e9:.1f} GB/s "
                f"({r['how']})")
    return "\n".join(out)


def plot(book, path):
    """ledger.png: left, each stage's compute as a share of the same run without its skip (spent
    dark, skipped light and hatched, spent beyond it red), beside its main count and its compute
    with their units; right, the measured wall seconds of each stage. Nothing when no step ran."""
    if not book["steps"]:
        return
    fig, ax = plt.subplots(1, 2, figsize=(14, 4.6), gridspec_kw={"width_ratios": [2.3, 1]})
    stages = list(book["stages"].items())
    for y, (stage, row) in zip(range(len(stages) - 1, -1, -1), stages):
        c = row["compute"]
        main = next((it for it in row["items"] if it["naive"] is not None), None)
        count = (f"{main['what']}: {human(main['done'], main['unit'])} of "
                 f"{human(main['naive'], main['unit'])} ({skipped(main['done'], main['naive'])} "
                 f"skipped)" if main else "")
        if c["done"] is None or not c["naive"]:
            why = row["note"] or "nothing done on either side"
            ax[0].text(0.01, y, "\n".join([count] + textwrap.wrap(why, 95)), va="center",
                       fontsize=8)
            continue
        f = c["done"] / c["naive"]
        ax[0].barh(y, min(f, 1), color="#2b6ca3", height=0.6)
        if f < 1:
            ax[0].barh(y, 1 - f, left=f, color="#b9d3ea", height=0.6, hatch="//",
                       edgecolor="white")
        else:
            ax[0].barh(y, f - 1, left=1, color="#d1495b", height=0.6)
        est, unit = ("", "s, measured") if c["unit"] == "s" else ("~", c["unit"] + ", estimated")
        what = (f"{c['what'].split(' (')[0]}: {est}{human(c['done'])} of {est}"
                f"{human(c['naive'])} {unit} ({skipped(c['done'], c['naive'])} skipped)")
        ax[0].text(max(f, 1) + 0.03, y, f"{count}\n{what}", va="center", fontsize=8)
    ax[0].set_yticks(range(len(stages)), [f"{i + 1} {s}" for i, (s, _) in
                                          enumerate(stages)][::-1])
    ax[0].set_ylim(-0.6, len(stages) - 0.4)
    ax[0].set_xlim(0, 2.6)
    ax[0].set_xticks([0, 0.25, 0.5, 0.75, 1], ["0", "25%", "50%", "75%", "100%"])
    ax[0].axvline(1, color="grey", lw=0.8, ls="--")
    ax[0].legend(handles=[Patch(color="#2b6ca3", label="spent"),
                          Patch(facecolor="#b9d3ea", hatch="//", edgecolor="white",
                                label="skipped"),
                          Patch(color="#d1495b", label="spent beyond the naive run")],
                 loc="lower right", fontsize=8)
    ax[0].set(xlabel="compute done, as a share of the same run without the stage's skip",
              title="what each stage spent and skipped (~: estimated from this machine's rates)")
    wall = book["wall_s"]
    names, secs = list(wall)[::-1], list(wall.values())[::-1]
    ax[1].barh(range(len(wall)), secs, color="#555555", height=0.6)
    ax[1].set_yticks(range(len(wall)), names)
    total = sum(secs) or 1.0
    for y, v in enumerate(secs):
        ax[1].text(v, y, f" {v:.1f}s ({v / total:.0%})", va="center", fontsize=8)
    ax[1].set_xlim(0, 1.4 * max(secs) or 1)
    ax[1].set(xlabel="seconds (measured)", title=f"the RL loop's {total:.0f}s of wall time")
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":  # a finished run's ledger again, from its summary.json
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "out/tiny"
    path = os.path.join(out_dir, "summary.json")
    saved = json.load(open(path)).get("ledger") if os.path.exists(path) else None
    if not saved:
        sys.exit(f"{path} holds no ledger: give the out_dir of a run that finished "
                 f"(python ledger.py <out_dir>)")
    print(text(saved))
    plot(saved, os.path.join(out_dir, "ledger.png"))
    print(f"wrote {os.path.join(out_dir, 'ledger.png')}")
