"""
calibrate.py: stage 2, the budget schedule. Sparrow's idea: the KV pages a decode step reads grow
with the cached length, bin by bin, so that the tail of the sparse-to-dense mismatch stays at a
threshold. Set offline by a sweep, kept on target online by a controller.

    python calibrate.py configs/longcot.py  # -> out/longcot/kv_schedule.json, and the command:
    python train.py configs/longcot.py --kv_budget=schedule:out/longcot/kv_schedule.json
    python calibrate.py configs/longcot.py --kv_target=0.9 --calib_prompts=32
    python train.py configs/longcot.py --kv_budget=calibrate  # the same sweep, at the run's start
    python calibrate.py --help  # this, then every key (train.py's) with this run's value

What is held per bin (config key kv_hold):
    position  Sparrow's: the 5th percentile (kv_quantile) of the per-position alpha >= kv_target
    rollout   the rollout-level figure: each rollout's summed TV, sum_t (1 - alpha_t), the expected
              number of positions at which sparse and dense sampling part. Per bin, the tail rate
              of TV over the rollouts, scaled to a rollout of mean length (tv_bin_stats),
              <= kv_tv_target. On long exact chains this is the one that sees a failure: a mean
              1 - alpha of 0.009 over 1,000 tokens is 9 partings a rollout while p5 stays high.

A run reads a written schedule only through kv_budget=schedule:PATH: a config whose kv_budget is
calibrate (configs/longcot.py's) sweeps again at its start (and rewrites out_dir/kv_schedule.json),
so calibrate.py ends by printing the train.py command that reuses its file (reuse_command): the
same config file and overrides, with --kv_budget=schedule:PATH and the controller on.

What is here:
    Schedule          pages to read per bin of cached length; an engine budget function
                      (Engine(sparse=...))
    calibrate         the sweep: one uniform table per candidate budget, and per bin the first that
                      holds
    calibrate_engine  calibrate on a real model: sparse rollouts, a dense forward over the same
                      tokens, p5 alpha per bin
    tv_bin_stats      the rollout-level figure per bin (each rollout's summed TV, its tail)
    read_fraction     the pages decode really read, per layer and per bin of cached length
    Controller        online: each step's held figure per bin raises a failing bin at once and
                      lowers a calm one slowly
    observe           one step's tail (mean and p5 alpha, overall and per bin; the rollout TV
                      beside it) for the log, and the controller's move
    kv_budget         the engine's budget from config key kv_budget (dense, fraction, fixed, table,
                      schedule file, or the sweep at the start of the run)
    main              the CLI above: build the policy the run would start from, sweep, write the
                      JSON, print the command that trains on it (reuse_command)

Simplifications:
    1. Calibration sweeps one uniform table per candidate and lets each bin pick from it, as if the
       bins were independent (see `calibrate`).
    2. The controller does not model how p5 moves with budget: it steps and remembers the last
       budget that failed (see `Controller`).
    3. A bin that no candidate satisfies is an error that names it: add larger candidates (a
       candidate at least as large as the bin's cached pages reads it densely, so it always passes).
"""

import json
import math
import os
import shlex
import sys
import time

import torch

from config import cli, parse_config, split_args
from kvcache import KVPool
from parallel import setup_dist
from report import help_text
from rollout import Engine
from sparsity import (alpha_k, bin_index, bin_stats, dense_alpha, fixed_budget,
                      fraction_budget)
from tasks import encode_pool, load_problems
from warmstart import build_policy


# --------------------------------------------------------------- the schedule: pages per length bin


class Schedule:
    """Sparrow's schedule: read table[i] pages while the cached length is in bin i (bins of
    `bin_pages` pages; the last entry holds beyond the table). It is an engine budget function,
    `Engine(sparse=schedule)`; the engine keeps the object, so a Controller that edits the table
    steers the next `generate` call.

    threshold  the target the table was calibrated for (the Controller's default target): a p5
               alpha with hold "position", a rollout's summed TV with hold "rollout"
    min_pages, max_pages  bounds for every entry (max None: unbounded; the engine reads at most what
                          is cached). min_pages is the floor of pages every step reads anyway
                          (keep_first + keep_recent): an entry below it would read the floor
    Save `state_dict()` with the checkpoint and `load_state_dict()` it on resume."""

    def __init__(self, table, bin_pages, threshold=0.86, min_pages=1, max_pages=None,
                 hold="position"):
        if not (isinstance(bin_pages, int) and bin_pages >= 1):
            raise ValueError(f"Schedule: bin_pages must be an int >= 1, got {bin_pages!r}")
        if hold not in HOLDS:
            raise ValueError(f"Schedule: hold must be one of {HOLDS}, got {hold!r}")
        if not (0 <= threshold <= 1 if hold == "position" else threshold > 0):
            raise ValueError(f"Schedule: threshold is a p5 alpha in [0, 1] (hold position) or a "
                             f"summed TV > 0 (hold rollout), got {threshold}")
        self.hold = hold
        if min_pages < 1 or (max_pages is not None and max_pages < min_pages):
            raise ValueError(f"Schedule: want 1 <= min_pages <= max_pages, got {min_pages}, "
                             f"{max_pages}")
        self.bin_pages, self.threshold = bin_pages, threshold
        self.min_pages, self.max_pages = min_pages, max_pages
        self.table = [int(x) for x in table]
        if not self.table:
            raise ValueError("Schedule: the table is empty")
        bad = [(i, x) for i, x in enumerate(self.table) if x != self.clamp(x)]
        if bad:
            raise ValueError(f"Schedule: table entries (bin, pages) {bad} lie outside "
                             f"[min_pages={min_pages}, max_pages={max_pages}] (min_pages: the "
                             f"pages every step reads anyway)")

    # no __len__: the engine tests `sparse or None`, and an object with a length could read as False

    def __call__(self, n_pages):
        return self.table[bin_index(n_pages, self.bin_pages, len(self.table))]

    budget = __call__

    def clamp(self, pages):
        pages = max(self.min_pages, int(pages))
        return pages if self.max_pages is None else min(self.max_pages, pages)

    def extend(self, n_bins):
        """Give the bins up to n_bins their own entries, each a copy of the last (which already held
        there)."""
        self.table += [self.table[-1]] * (n_bins - len(self.table))

    def state_dict(self):
        return {"table": list(self.table), "bin_pages": self.bin_pages, "threshold": self.threshold,
                "min_pages": self.min_pages, "max_pages": self.max_pages, "hold": self.hold}

    def load_state_dict(self, sd):
        missing = {"table", "bin_pages", "threshold", "min_pages", "max_pages"} - set(sd)
        if missing:
            raise KeyError(f"Schedule.load_state_dict: missing keys {sorted(missing)}")
        self.__init__(sd["table"], sd["bin_pages"], sd["threshold"], sd["min_pages"],
                      sd["max_pages"], sd.get("hold", "position"))  # older files: Sparrow's

    def __repr__(self):
        return (f"Schedule(table={self.table}, bin_pages={self.bin_pages}, "
                f"threshold={self.threshold}, hold={self.hold!r})")


HOLDS = ("position", "rollout")  # what a schedule holds per bin (config key kv_hold)


def passes(x, target, hold):
    """Whether a bin's held figure meets its target: alpha's tail from above (position), the
    rollout-level TV from below (rollout)."""
    return x >= target if hold == "position" else x <= target


def calibrate(measure, bins, candidates, threshold=0.86, monotone=True, hold="position"):
    """Offline calibration: the smallest candidate budget per bin whose held figure meets
    `threshold` (p5 alpha >= threshold, or with hold "rollout" the rollout-level TV <= it).

    measure(table) -> the held figure per bin: `bins` floats, NaN for a bin without tokens (see
    calibrate_engine).
    The sweep measures one uniform table, [c] * bins, per candidate c in ascending order, and each
    bin keeps the first c at which its own p5 passes: len(candidates) measurements instead of one
    per (bin, candidate). That treats the bins as independent. They are not quite: a token's
    mismatch comes mostly from its own step's budget, but earlier steps' budgets reach it through
    the keys and values that sparse layers wrote and through the tokens sampled. The online
    Controller corrects what this leaves.
    The sweep stops at the first candidate at which every bin with tokens has passed. A bin without
    tokens at any candidate copies the bin before it; one that failed while it had tokens and has
    none at the largest candidate (sparse rollouts that ran long where dense ones stop) gets the
    largest candidate; `monotone` lifts each bin to at least the one before it (the tail worsens
    with length; lifting never breaks a bin's threshold).
    A bin that no candidate satisfies is an error: include a candidate at least as large as the
    bin's cached pages, which reads it densely."""
    cands = sorted({int(c) for c in candidates})
    if not cands or cands[0] < 1:
        raise ValueError(f"calibrate: candidates must be page counts >= 1, got {candidates}")
    chosen, best, seen = [None] * bins, [float("nan")] * bins, [False] * bins
    better = max if hold == "position" else min
    last = [True] * bins  # whether the bin had tokens at the latest candidate
    for c in cands:
        p5 = [float(x) for x in measure([c] * bins)]
        if len(p5) < bins:
            raise ValueError(f"calibrate: measure returned {len(p5)} bins, expected {bins}")
        for b in range(bins):
            last[b] = not math.isnan(p5[b])
            if not last[b]:
                continue
            best[b] = better(best[b], p5[b]) if seen[b] else p5[b]
            seen[b] = True
            if chosen[b] is None and passes(p5[b], threshold, hold):
                chosen[b] = c
        if all(ch is not None or not s for ch, s in zip(chosen, seen)) and any(seen):
            break
    for b in range(bins):
        # failed while it had tokens, then lost them (rollouts got shorter): the safe side
        if seen[b] and chosen[b] is None and not last[b]:
            chosen[b] = cands[-1]
    fail = [(b, round(best[b], 4)) for b in range(bins) if seen[b] and chosen[b] is None]
    if fail:
        raise ValueError(f"calibrate: bins (bin, best {hold} figure) {fail} miss {threshold} at "
                         f"the largest candidate {cands[-1]} pages: add larger candidates")
    if not any(seen):
        raise ValueError("calibrate: measure returned no tokens in any bin")
    # bins before the first measured one copy it
    first = next(ch for ch in chosen if ch is not None)
    table = []
    for ch in chosen:
        prev = table[-1] if table else first
        if ch is None:
            ch = prev
        table.append(max(ch, prev) if monotone else ch)
    return table


def sparse_tail(model, tokenizer, prompt_ids, schedule, n_bins, group_size=1, seed=0, min_count=1,
                max_new_tokens=256, temperature=1.0, page_size=16, topk=20, q=0.05,
                hold="position", **engine_kw):
    """One sparse rollout of `prompt_ids` at `schedule` -> (the rollout, the held figure in each
    of `n_bins` bins, NaN where a bin has fewer than `min_count` tokens): the q-quantile of
    Sparrow's per-position alpha (hold "position"), or the rollout-level TV of
    tv_bin_stats (hold "rollout"). alpha is taken against a dense full forward
    (dense_alpha: exact over a small vocabulary, else from the top-`topk` lists: sparsity.alpha_k);
    engine_kw go to rollout.Engine."""
    engine = Engine(model, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature,
                    page_size=page_size, sparse=schedule,
                    topk_logprobs=alpha_k(model.config.vocab_size, topk), **engine_kw)
    ro = engine.generate(prompt_ids, group_size=group_size, seed=seed)
    alpha = dense_alpha(model, prompt_ids, ro, temperature)
    if hold == "rollout":
        # host, as ro.mask is
        rows = torch.arange(len(ro), device="cpu")[:, None].expand(ro.mask.shape)[ro.mask]
        st = tv_bin_stats(alpha[ro.mask], ro.budget_dense[ro.mask], rows, schedule.bin_pages,
                          n_bins, q)
        held = st["held"]
    else:
        st = bin_stats(alpha, ro.mask, ro.budget_dense, schedule.bin_pages, n_bins, q=q)
        held = st["p5"]
    return ro, torch.where(st["count"] >= max(1, min_count), held, float("nan")).tolist()


def calibrate_engine(model, tokenizer, prompt_ids, candidates, bin_pages, n_bins=None, group_size=1,
                     threshold=0.86, seed=0, min_count=1, max_new_tokens=256, temperature=1.0,
                     page_size=16, topk=20, q=0.05, hold="position", min_pages=1, **engine_kw):
    """`calibrate` on a real model: measure(table) is `sparse_tail` at that table, the held figure
    per bin (hold "position": the q-quantile, p5 by default, of Sparrow's per-position alpha;
    "rollout": the rollout-level TV), bins of pages cached, aligned with the schedule; bins with
    fewer than `min_count` tokens count as empty. Every candidate samples with the same seed.
    engine_kw go to rollout.Engine (scorer, keep_recent, dense_layers, ...). Returns a Schedule
    whose entries are at least min_pages (the pages every step reads anyway)."""
    if n_bins is None:  # enough bins for the longest prompt plus max_new_tokens
        longest = max(len(p) for p in prompt_ids) + max_new_tokens
        n_bins = -(-longest // page_size) // bin_pages + 1

    def measure(table):
        return sparse_tail(model, tokenizer, prompt_ids, Schedule(table, bin_pages), n_bins,
                           group_size, seed, min_count, max_new_tokens, temperature, page_size,
                           topk, q, hold, **engine_kw)[1]

    table = calibrate(measure, n_bins, candidates, threshold, hold=hold)
    return Schedule(table, bin_pages, threshold, min_pages=min_pages, hold=hold)


# ------------------------------------------------ the held figures: rollout TV, pages read per bin


def tv_bin_stats(alpha, pages, rows, bin_pages, n_bins=None, q=0.05):
    """The rollout-level statistic per bin of cached length, in the units a Schedule holds.

    alpha, pages, rows (M,) flat: each generated token's alpha, the pages cached at its step and
    the rollout it belongs to (any ids). For each bin b, over the rollouts that have tokens in it:
    the rollout's TV rate there, sum_{t in b} (1 - alpha_t) / n_b, and its (1 - q)-quantile (the
    tail, 95th percentile at q = 0.05), scaled by the mean rollout length: "held", the summed TV a
    rollout of mean length would carry if every bin were at this bin's tail rate. Holding every
    bin's "held" at a target holds the rollouts' summed TV near it, bin by bin, which is what lets
    the per-bin Controller and calibration hold a rollout-level figure.
    -> {"count": tokens (n_bins,), "rollouts": rollouts with tokens (n_bins,), "held" (n_bins,),
    NaN where empty; "tv" (R,) each rollout's summed TV; "tv_tail" its (1 - q)-quantile; "tv_mean";
    "len_mean"}."""
    if not alpha.shape == pages.shape == rows.shape or alpha.dim() != 1:
        raise ValueError(f"tv_bin_stats: alpha {tuple(alpha.shape)}, pages {tuple(pages.shape)} "
                         f"and rows {tuple(rows.shape)} must be one flat shape")
    _, r = torch.unique(rows.cpu(), return_inverse=True)  # rollout ids -> 0..R-1
    R, tv = int(r.max()) + 1 if r.numel() else 0, (1 - alpha.float().cpu())
    b = (pages.cpu().long() // bin_pages)
    n_bins = n_bins or (int(b.max()) + 1 if b.numel() else 1)
    b = b.clamp(max=n_bins - 1)
    cell = r * n_bins + b  # (rollout, bin) of every token
    tv_cell = torch.zeros(R * n_bins, device="cpu").index_add_(0, cell, tv).view(R, n_bins)
    n_cell = torch.bincount(cell, minlength=R * n_bins).view(R, n_bins)
    total, lens = tv_cell.sum(1), n_cell.sum(1).float()
    held = torch.full((n_bins,), float("nan"), device="cpu")  # host figures, like the inputs
    for j in range(n_bins):
        here = n_cell[:, j] > 0
        if here.any():
            rate = tv_cell[here, j] / n_cell[here, j]
            held[j] = rate.quantile(1 - q) * lens.mean()
    nan = torch.tensor(float("nan"), device="cpu")
    return {"count": n_cell.sum(0), "rollouts": (n_cell > 0).sum(0), "held": held, "tv": total,
            "tv_tail": total.quantile(1 - q) if R else nan, "tv_mean": total.mean() if R else nan,
            "len_mean": lens.mean() if R else nan}


def read_fraction(budget, dense, mask, bin_pages, n_layers, dense_layers, n_bins=None):
    """What decode really read, per layer and per bin of cached length, from a rollout's per-token
    counts: budget (N, T) pages each sparse layer read at a token's step (ro.budget, the clamped
    budget: the selection reads exactly that many, kept pages included), dense (N, T) pages cached
    (ro.budget_dense). The first `dense_layers` of `n_layers` read every page.
    A row's first token comes from prefill, not from a decode step: it is left out, as the
    engine's own counts (ro.timings pages_read, pages_dense) leave it out.
    -> {"layers": (n_layers,) fraction read, "bins": (n_bins,) fraction over all layers, "all"}."""
    m = mask.bool().clone()
    m[:, 0] = False
    rd, dn = budget[m].double(), dense[m].double()
    b = (dn.long() // bin_pages)
    n_bins = n_bins or (int(b.max()) + 1 if b.numel() else 1)
    b = b.clamp(max=n_bins - 1)
    sparse = n_layers - dense_layers
    per_tok = (rd * sparse + dn * dense_layers) / n_layers  # pages a layer reads, on average
    num = torch.zeros(n_bins, dtype=torch.double, device=b.device).index_add_(0, b, per_tok)
    den = torch.zeros(n_bins, dtype=torch.double, device=b.device).index_add_(0, b, dn)
    sp = (rd.sum() / dn.sum()).item() if dn.sum() > 0 else float("nan")
    layers = [1.0] * dense_layers + [sp] * sparse
    return {"layers": layers, "bins": (num / den).tolist(),
            "all": (per_tok.sum() / dn.sum()).item() if dn.sum() > 0 else float("nan")}


# ---------------------------------------------------------------- the controller: online correction


class Controller:
    """Online: after every step's rollouts, `observe(held, count)` moves each bin's budget toward
    the smallest one whose held figure meets `target`: p5 alpha (bin_stats) >= target with hold
    "position" (the schedule's), the rollout-level TV (tv_bin_stats) <= target with "rollout".
    Below, "fails" and "p5 < target" mean either one's miss.

    - p5 < target: raise the bin by step_pages at once (a collapse costs more than a slow step), and
      remember that the old budget failed: the bin's floor becomes the new budget.
    - p5 >= target for `patience` observations in a row: lower it by step_pages, unless that would
      go below the floor (a budget known to fail). This probing goes on inside the deadband, so
      started from too large a table the controller still walks down to the minimal one; a rule that
      only lowered above target + deadband would stop anywhere inside the band.
    - The floor is the hysteresis: once a bin has failed one step down, it holds instead of
      oscillating. It is forgotten (back to min_pages) after 5 * patience observations in a row at
      least `deadband` above the target: the policy has drifted to a place where the tail has room,
      so a lower budget is worth a probe. (If one step of budget moves p5 by more than the deadband,
      that probe recurs every so often.)
    - Bins with fewer than `min_count` tokens (or NaN) are left alone: a 5th percentile needs
      tokens.
    - The deadband is in alpha with hold "position" (0.02), a fraction of the target with
      "rollout" (0.2: room when the TV is at most 0.8 of the target).
    - Entries stay within the schedule's [min_pages, max_pages]; bins past the table get their own
      entries.
    Noise that drops the minimal budget's p5 below target leaves the bin a step high: the safe
    side."""

    def __init__(self, schedule, target=None, step_pages=None, deadband=None, patience=3,
                 min_count=64, hold=None):
        if not isinstance(schedule, Schedule):
            raise TypeError(f"Controller wants a Schedule, got {type(schedule).__name__}")
        self.schedule, self.hold = schedule, hold or schedule.hold
        if self.hold not in HOLDS:
            raise ValueError(f"Controller: hold must be one of {HOLDS}, got {self.hold!r}")
        self.target = schedule.threshold if target is None else target
        if deadband is None:
            deadband = 0.02 if self.hold == "position" else 0.2
        self.step = step_pages if step_pages is not None else max(1, schedule.bin_pages // 8)
        if self.step < 1 or patience < 1 or deadband < 0:
            raise ValueError(f"Controller: want step_pages >= 1, patience >= 1, deadband >= 0, got "
                             f"{self.step}, {patience}, {deadband}")
        self.deadband, self.patience, self.min_count = deadband, patience, min_count
        n = len(schedule.table)
        self.floor, self.calm, self.room = [schedule.min_pages] * n, [0] * n, [0] * n

    def margin(self, x):
        """How far a bin's held figure is inside the target (< 0: it fails)."""
        if self.hold == "position":
            return x - self.target
        return (self.target - x) / self.target

    def observe(self, p5, count=None):
        """p5 (n_bins,) the held figure per bin (per-bin 5th percentile of alpha, or the
        rollout-level TV); count (n_bins,) tokens per bin. Returns {"raised": bins raised,
        "lowered": bins lowered}."""
        p5 = [float(x) for x in p5]
        count = [int(x) for x in count] if count is not None else [self.min_count] * len(p5)
        s, moved = self.schedule, {"raised": 0, "lowered": 0}
        if len(p5) > len(s.table):
            s.extend(len(p5))
        for lst, fill in ((self.floor, s.min_pages), (self.calm, 0), (self.room, 0)):
            lst += [fill] * (len(s.table) - len(lst))
        for b, (x, n) in enumerate(zip(p5, count)):
            if math.isnan(x) or n < self.min_count:
                continue
            pages, m = s.table[b], self.margin(x)
            if m < 0:
                s.table[b] = self.floor[b] = s.clamp(pages + self.step)
                self.calm[b] = self.room[b] = 0
                moved["raised"] += s.table[b] != pages
                continue
            self.calm[b] += 1
            self.room[b] = self.room[b] + 1 if m >= self.deadband else 0
            if self.room[b] >= 5 * self.patience:
                self.floor[b], self.room[b] = s.min_pages, 0
            lower = s.clamp(pages - self.step)
            if self.calm[b] >= self.patience and self.floor[b] <= lower < pages:
                s.table[b], self.calm[b] = lower, 0
                moved["lowered"] += 1
        return moved

    def state_dict(self):
        return {"target": self.target, "floor": list(self.floor), "calm": list(self.calm),
                "room": list(self.room), "hold": self.hold}

    def load_state_dict(self, sd):
        self.target, self.hold = sd["target"], sd.get("hold", "position")
        self.floor, self.calm, self.room = list(sd["floor"]), list(sd["calm"]), list(sd["room"])


def observe(alpha, pages, bin_pages, schedule=None, controller=None, q=0.05, rows=None):
    """One step's mismatch: Sparrow's per-position alpha of every generated token (all ranks'), the
    pages cached when each was generated and (rows) the rollout each belongs to -> the figures for
    the log: mean and p5 alpha overall, the mean and q-quantile per bin of `bin_pages`, and with
    rows the rollout-level figures beside them (tv_mean, tv_tail: each rollout's summed TV, its mean
    and (1 - q)-quantile; tv_bins: the held rollout TV per bin). The controller, if any, moves the
    schedule's table toward the smallest budgets whose held figure meets its target."""
    if alpha.numel() == 0:
        return {}
    every = torch.ones(1, alpha.numel(), dtype=torch.bool, device=alpha.device)
    st = bin_stats(alpha[None], every, pages[None], bin_pages, q=q)
    rec = {"alpha_mean": alpha.mean().item(), "alpha_p5": alpha.quantile(0.05).item(),
           "alpha_bins": {**{k: st[k].tolist() for k in ("count", "mean", "p5")}, "q": q}}
    held = st["p5"]
    if rows is not None:
        tv = tv_bin_stats(alpha, pages, rows, bin_pages, len(held), q)
        rec.update(tv_mean=tv["tv_mean"].item(), tv_tail=tv["tv_tail"].item(),
                   tv_bins=tv["held"].tolist())
        held = tv["held"] if controller is not None and controller.hold == "rollout" else held
    if controller is not None:
        if controller.hold == "rollout" and rows is None:
            raise ValueError("observe: a controller that holds the rollout TV needs rows")
        rec["kv_moved"] = controller.observe(held, st["count"])
    if schedule is not None:
        rec["kv_table"] = list(schedule.table)
    return rec


def read_figures(ro, bin_pages, n_layers, dense_layers):
    """The pages a rollout's decode really read, for the log: per layer (counted in the cache)
    and per bin of cached length (read_fraction over its tokens), as fractions of
    dense."""
    t = ro.timings
    per_layer = t["pages_dense"] / n_layers
    return {"kv_read_layers": [round(x / max(1e-9, per_layer), 4) for x in t["pages_read_layer"]],
            "kv_read_bins": [round(x, 4) for x in read_fraction(
                ro.budget, ro.budget_dense, ro.mask, bin_pages, n_layers, dense_layers)["bins"]]}


# ----------------------------------------------------------------------------- from a config


def kv_budget(cfg, model=None, tok=None, pool_ids=None, log=print, rank=0):
    """The rollout engine's KV budget from the config: False (dense) or a function of the cached
    page count. kv_budget=calibrate runs the sweep on `model` and (rank 0) saves the table to
    out_dir/kv_schedule.json."""
    kind, _, arg = cfg.kv_budget.partition(":")
    floor = cfg.kv_keep_first + cfg.kv_keep_recent  # what every sparse step reads anyway
    target = cfg.kv_target if cfg.kv_hold == "position" else cfg.kv_tv_target
    if kind == "schedule":
        return load_schedule(arg, cfg.page_size, floor)
    if kind == "calibrate":
        sched = calibrated_schedule(cfg, model, tok, pool_ids, log)
        if rank == 0:
            save_schedule(sched, os.path.join(cfg.out_dir, "kv_schedule.json"), cfg)
        return sched
    try:
        if kind == "dense":
            return False
        if kind == "fraction":
            return fraction_budget(float(arg))
        if kind == "fixed":
            return fixed_budget(int(arg))
        if kind == "table":
            return Schedule([int(x) for x in arg.split(",")], cfg.kv_bin_pages, target,
                            min_pages=floor, hold=cfg.kv_hold)
    except ValueError as e:
        raise ValueError(f"config key 'kv_budget': {e}") from None
    raise ValueError(f"config key 'kv_budget' must be dense, fraction:F, fixed:N, table:N1,N2,..., "
                     f"schedule:PATH or calibrate, got {cfg.kv_budget!r}")


def calibrated_schedule(cfg, model, tok, pool_ids, log=print):
    """The sweep on the run's own settings -> a Schedule."""
    prompt_ids = pool_ids[:cfg.calib_prompts]
    if not prompt_ids:
        raise ValueError("calibrate: no training prompts to calibrate on")
    t0 = time.perf_counter()
    position = cfg.kv_hold == "position"
    held = (f"p5 alpha >= {cfg.kv_target}" if position
            else f"rollout TV tail <= {cfg.kv_tv_target}")
    log(f"calibrating the KV schedule: {len(prompt_ids)} prompts x {cfg.group_size} rollouts, "
        f"candidates {list(cfg.kv_candidates)} pages, bins of {cfg.kv_bin_pages} pages, {held}")
    sched = calibrate_engine(model, tok, prompt_ids, cfg.kv_candidates, cfg.kv_bin_pages,
                             group_size=cfg.group_size, seed=cfg.seed, hold=cfg.kv_hold,
                             threshold=cfg.kv_target if position else cfg.kv_tv_target,
                             min_pages=cfg.kv_keep_first + cfg.kv_keep_recent,
                             keep_first=cfg.kv_keep_first, keep_recent=cfg.kv_keep_recent,
                             min_count=20, max_new_tokens=cfg.max_new_tokens,
                             temperature=cfg.temperature, page_size=cfg.page_size,
                             topk=cfg.alpha_topk, q=cfg.kv_quantile, scorer=cfg.kv_scorer,
                             dense_layers=cfg.dense_layers, rescore_every=cfg.kv_rescore_every,
                             stop=[cfg.stop] if cfg.stop else [], kv_dtype=cfg.kv_dtype,
                             pool=KVPool())  # the run's KV dtype; one pool for every candidate
    log(f"calibrated in {time.perf_counter() - t0:.0f} s: table {sched.table} (pages read per bin "
        f"of {cfg.kv_bin_pages} pages)")
    return sched


def save_schedule(sched, path, cfg):
    with open(path + ".tmp", "w") as f:
        json.dump({**sched.state_dict(), "calibrated_on": {k: getattr(cfg, k) for k in (
            "model", "task", "difficulty", "page_size", "kv_scorer", "kv_rescore_every",
            "dense_layers", "calib_prompts", "group_size", "temperature", "max_new_tokens",
            "kv_candidates", "kv_keep_first", "kv_keep_recent", "kv_hold")}},
            f, indent=1)
    os.replace(path + ".tmp", path)


def load_schedule(path, page_size=None, floor=1):
    """A schedule written by save_schedule -> Schedule. A page size other than the one it was
    calibrated for is refused: its bins and budgets count pages; so is an entry below `floor`, the
    pages every sparse step reads anyway (it would read the floor, not what it says)."""
    try:
        with open(path) as f:
            sd = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"kv_budget=schedule:{path}: no such file (write one with python "
                                f"calibrate.py CONFIG)") from None
    made = sd.get("calibrated_on", {}).get("page_size")
    if page_size is not None and made is not None and made != page_size:
        raise ValueError(f"{path} was calibrated for page_size={made}, the run has "
                         f"page_size={page_size}")
    small = [(i, x) for i, x in enumerate(sd.get("table", [])) if x < floor]
    if small:
        raise ValueError(f"{path}: entries (bin, pages) {small} are below the {floor} pages every "
                         f"sparse step reads (kv_keep_first + kv_keep_recent): they would read "
                         f"{floor}; recalibrate, or lower kv_keep_recent")
    sched = Schedule([1], 1)
    sched.load_state_dict({**sd, "min_pages": max(floor, sd.get("min_pages", 1))})
    return sched


def main(argv):
    cfg = parse_config(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    _, _, dev = setup_dist(cfg)
    os.makedirs(cfg.out_dir, exist_ok=True)
    model, tok = build_policy(cfg, dev, print)
    problems, _ = load_problems(cfg)
    _, pool_ids = encode_pool(tok, problems, cfg, model.config.max_position_embeddings, print)
    sched = calibrated_schedule(cfg, model.eval(), tok, pool_ids)
    path = os.path.join(cfg.out_dir, "kv_schedule.json")
    save_schedule(sched, path, cfg)
    again = (" (its kv_budget=calibrate would sweep again at the run's start)"
             if cfg.kv_budget == "calibrate" else "")
    print(f"wrote {path}; to train on it{again}:\n    {reuse_command(argv, path, cfg)}")
    return sched


def reuse_command(argv, path, cfg):
    """The train.py command line that trains on the schedule at `path`: calibrate.py's own
    arguments (config file, overrides), kv_budget=schedule:PATH, and the controller on."""
    files, keys = split_args(argv)  # every key as --key=value, whichever form was typed
    args = files + [f"--{k}={v}" for k, v in keys.items() if k != "kv_budget"]
    args.append(f"--kv_budget=schedule:{path}")
    if not cfg.kv_controller:
        args.append("--kv_controller=true")
    return "python train.py " + " ".join(shlex.quote(a) for a in args)


if __name__ == "__main__":
    sys.exit(cli(main, sys.argv[1:], lambda argv: help_text(argv, __doc__)))
