"""
sparsity.py: sparsity primitives that several stages share. This first part is the KV-page selection that
the rollout engine's block-sparse decode uses (Sparrow's "block top-k", with Quest's bound as an option).

    from sparsity import fraction_budget
    engine = Engine(model, tok, sparse=fraction_budget(1 / 8), scorer="centroid", keep_recent=2, dense_layers=2)

How a decode step picks the KV pages it reads, per sequence and per KV head:
    1. Every full page carries metadata, written once when the page fills: its mean key, and for Quest its
       elementwise min and max keys.
    2. A scorer rates each page against the step's query: `centroid_scores` (the query averaged over its
       GQA group, dotted with the mean key) or `quest_scores` (Quest's upper bound on q . k over the page).
    3. A budget function says how many pages to read from how many are cached: `budget(n_pages) -> int`.
       `fixed_budget`, `fraction_budget`, `dense_budget`, the per-bin `table_budget` and `Schedule` all fit.
    4. `select_pages` keeps the first `keep_first` pages (attention sinks), the last `keep_recent` pages and
       the partial last page, then fills the rest of the budget with the best-scored pages. Its output is
       what `kernels.block_sparse_decode.decode_attention` takes: LOGICAL page ids, padded, and a count.

Simplifications:
    1. The budget counts every page read, the always-kept ones included; a budget below the kept count
       reads just the kept pages, one above the cached count reads everything. (Sparrow's published
       table, 29, 61, 93, ..., looks like it counts the top-k pages alone: add the kept pages to use it.)
    2. The budget is per sequence (a function of its own length), shared by all its KV heads and sparse
       layers; which pages fill it differs per KV head.
    3. Quest with GQA: the bound is taken per query head and the group keeps the max, since a page is read
       for the whole group and matters if it matters to any one of its heads.
    4. Scores are fp32 and unscaled (1/sqrt(D) does not change a ranking).

The sparse-to-dense mismatch (Sparrow): alpha, the acceptance rate of speculative decoding, per sampled token.
    alpha_exact(p_logp, q_logp)           sum_v min(p, q) = 1 - TV over two full distributions
    alpha_topk(ro.topk_logp, ro.topk_ids, dense_logp)   a lower bound from what was kept of each side
    alpha_sample(dense_logp, ro.logp)     min(1, p_dense(y) / p_sparse(y)): same expectation, one per token
    bin_stats(alpha, ro.mask, ro.budget_dense, schedule.bin_pages)   count, mean, p5 per bin of cached length
    dense_logprobs(model, prompt_ids, ro)  the dense side: sampled tokens' log-probs from a plain full forward
Collapse shows in the tail, not the mean: Sparrow keeps the 5th percentile per 2,048-token bin above 0.86.

The schedule: pages to read per bin of cached length, set offline and kept on target online.
    schedule = calibrate_engine(model, tok, prompt_ids, candidates=[8, 16, 32, 64, 128], bin_pages=125)
    engine = Engine(model, tok, sparse=schedule)            # a Schedule is a budget function
    ctrl = Controller(schedule, step_pages=16)              # each step: st = bin_stats(...)
    ctrl.observe(st["p5"], st["count"])                     # raises a failing bin at once, lowers slowly
`calibrate(measure, bins, candidates)` is the sweep behind calibrate_engine, for any measurement. Save
schedule.state_dict() and ctrl.state_dict() with checkpoints.

The cost model (after Kinetics): `rollout_cost(P, n_layers, N, r, D, L_in, L_out, flops, bandwidth, schedule)`
predicts seconds dense and sparse and their ratio; `model_shape(cfg)` gives P and the KV shape of a ModelConfig.

More simplifications:
    5. Calibration sweeps one uniform table per candidate and lets each bin pick from it, as if the bins
       were independent (see `calibrate`).
    6. The controller sees only the sampled-token alpha's tail per bin; it does not model how p5 moves with
       budget, it steps and remembers the last budget that failed (see `Controller`).
    7. The cost model counts FLOPs and bytes, not kernels: no launch overheads, no overlap of the two.

N:M weight masks (the last section): `nm_mask(w, n, m)` keeps the n largest |w| of every m consecutive inputs in each
output row (Wanda's |W| * ||X|| scores can be passed instead), and `apply_nm(model, 2, 4)` prunes every Linear of a
model in place, the head and the MoE router excepted. sync.make_rollout_copy("nm2:4") builds the pruned rollout copy.
Simplification: magnitude masks recomputed from the current weights, no calibration and no learned masks (RoI,
MaskLLM); masked dense, so a 2:4 kernel (`to_sparse_semi_structured`) is what would turn the zeros into speed.

Tests: `python -m pytest tests/test_sparsity.py tests/test_mismatch.py tests/test_schedule.py tests/test_copies.py`.
"""

import math

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------- budgets: pages to read


def fixed_budget(pages):
    """Read the same number of pages at every length (Quest's fixed token budget, in pages)."""
    if pages < 1:
        raise ValueError(f"fixed_budget wants at least 1 page, got {pages}")
    return lambda n_pages: pages


def fraction_budget(fraction, min_pages=1):
    """Read a fixed fraction of the cached pages (rounded up), at least `min_pages`."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction_budget wants a fraction in (0, 1], got {fraction}")
    return lambda n_pages: max(min_pages, math.ceil(fraction * n_pages))


def dense_budget(n_pages):
    """Every page: the sparse code path at full budget, which must equal dense decoding."""
    return n_pages


def table_budget(table, bin_pages):
    """A schedule: table[i] pages for cached lengths in bin i (bins of `bin_pages` pages), and the last
    entry beyond the table. Sparrow's tables use bins of 2,000 tokens (125 pages of 16)."""
    if not table or bin_pages < 1:
        raise ValueError(f"table_budget wants a non-empty table and bin_pages >= 1, got {table}, {bin_pages}")
    table = [int(x) for x in table]
    return lambda n_pages: table[bin_index(n_pages, bin_pages, len(table))]


def bin_index(n_pages, bin_pages, n_bins):
    """The bin of a cached length in pages: bins of `bin_pages` pages, the last one open-ended."""
    return min(n_pages // bin_pages, n_bins - 1)


def kept_count(n_pages, n_full, keep_first, keep_recent):
    """How many pages a sequence always reads: the first ones, the recent ones and the partial last page.
    The two ranges start at opposite ends, so their union is their summed size capped at n_pages."""
    recent = max(keep_recent, n_pages - n_full)  # n_pages - n_full is 1 when the last page is partial
    return min(n_pages, min(keep_first, n_pages) + recent)


def pages_to_read(budget, n_pages, n_full, keep_first, keep_recent):
    """The budget of one sequence, clamped to [pages always kept, pages cached]. Python ints, no device."""
    want = int(budget(n_pages))
    return min(n_pages, max(want, kept_count(n_pages, n_full, keep_first, keep_recent)))


# ----------------------------------------------------------------------------- scorers


def centroid_scores(q, kmean):
    """Sparrow's block score. q (B, H_q, D) decode queries, kmean (B, P, H_kv, D) mean key of each logical page
    -> (B, H_kv, P): the GQA group's mean query dotted with the page's mean key."""
    B, H_q, D = q.shape
    H_kv = kmean.shape[2]
    qg = q.float().view(B, H_kv, H_q // H_kv, D).mean(2)  # (B, H_kv, D)
    return torch.einsum("bhd,bphd->bhp", qg, kmean.float())


def quest_scores(q, kmin, kmax):
    """Quest's bound. q (B, H_q, D), kmin/kmax (B, P, H_kv, D) elementwise key extremes of each page
    -> (B, H_kv, P): sum_i max(q_i * min_i, q_i * max_i), an upper bound on q . k for any key k in the page,
    per query head, then the max over the GQA group (simplification 3)."""
    B, H_q, D = q.shape
    H_kv = kmin.shape[2]
    qg = q.float().view(B, H_kv, H_q // H_kv, 1, D)  # (B, H_kv, G, 1, D)
    lo = kmin.float().permute(0, 2, 1, 3)[:, :, None]  # (B, H_kv, 1, P, D)
    hi = kmax.float().permute(0, 2, 1, 3)[:, :, None]
    bound = torch.maximum(qg * lo, qg * hi).sum(-1)  # (B, H_kv, G, P)
    return bound.amax(2)


def oracle_scores(q, kpages, seq_lens):
    """The yardstick scorer: the attention mass each page really gets. q (B, H_q, D) decode queries, kpages
    (B, P, page_size, H_kv, D) the keys of each logical page, seq_lens (B,) tokens cached -> (B, H_kv, P):
    softmax(q . k / sqrt(D)) over the row's cached tokens, summed per page, the max over the GQA group. It reads
    every key, as dense attention does, so it saves nothing; calibrating with it (kv_scorer="oracle") tells a
    weak scorer apart from a task whose attention tail is spread over many pages."""
    B, H_q, D = q.shape
    _, P, ps, H_kv, _ = kpages.shape
    qg = q.float().view(B, H_kv, H_q // H_kv, D)
    logits = torch.einsum("bhgd,bpthd->bhgpt", qg, kpages.float()) * D ** -0.5  # (B, H_kv, G, P, ps)
    ok = torch.arange(P * ps, device=q.device).view(P, ps) < seq_lens.to(q.device).long()[:, None, None]
    logits = logits.masked_fill(~ok[:, None, None], float("-inf"))
    w = torch.softmax(logits.reshape(B, H_kv, -1, P * ps), -1).nan_to_num(0.0)  # an empty row: all -inf -> 0
    return w.view(B, H_kv, -1, P, ps).sum(-1).amax(2)


def page_metadata(pages, with_bounds):
    """pages (n, page_size, H_kv, D) full pages of keys -> mean (n, H_kv, D), and min, max or None, None."""
    k = pages.float()
    if not with_bounds:
        return k.mean(1), None, None
    return k.mean(1), k.amin(1), k.amax(1)


# ----------------------------------------------------------------------------- selection


def select_pages(scores, n_pages, n_full, n_read, keep_first=1, keep_recent=2, max_read=None):
    """Pick the pages each (sequence, KV head) reads.

    scores   (B, H_kv, P) page scores (only full pages need sensible ones; the rest is ignored)
    n_pages  (B,) pages cached per sequence (the last may be partial), <= P
    n_full   (B,) full pages per sequence (n_pages or n_pages - 1)
    n_read   (B,) pages to read, already clamped by `pages_to_read` (so >= the kept count)
    max_read int, n_read.max() if the caller knows it on the host (saves a device sync)
    -> sel (B, H_kv, max_read) int32 logical page ids, ascending, zero-padded; n_sel (B, H_kv) int32.
    """
    B, H_kv, P = scores.shape
    dev = scores.device
    j = torch.arange(P, device=dev)
    n_pages, n_full, n_read = (x.to(dev).long()[:, None] for x in (n_pages, n_full, n_read))  # (B, 1)
    valid = j < n_pages  # (B, P)
    kept = valid & ((j < keep_first) | (j >= n_pages - keep_recent) | (j >= n_full))
    s = scores.float().masked_fill(kept[:, None], float("inf")).masked_fill(~valid[:, None], float("-inf"))
    k = int(n_read.max()) if max_read is None else max_read  # CPU-GPU sync point unless max_read is given
    top = s.topk(k, dim=-1).indices  # (B, H_kv, k): kept pages first (+inf), then the best scores
    used = torch.arange(k, device=dev) < n_read[:, :, None]  # (B, 1, k)
    sel = torch.where(used, top, P).sort(-1).values  # ascending page order reads memory in order
    sel = torch.where(used, sel, 0).to(torch.int32)
    return sel, n_read.to(torch.int32).expand(B, H_kv)


# ----------------------------------------------------------------------------- mismatch: the acceptance rate alpha


def alpha_exact(p_logp, q_logp):
    """Acceptance rate of two full distributions: sum_v min(p(v), q(v)) = 1 - TV(p, q).
    p_logp, q_logp (..., V) log-probs -> (...,) in [0, 1]. min(p, q) = exp(min(log p, log q)): no underflow trap."""
    if p_logp.shape != q_logp.shape:
        raise ValueError(f"alpha_exact: p_logp {tuple(p_logp.shape)} and q_logp {tuple(q_logp.shape)} differ")
    return torch.minimum(p_logp.float(), q_logp.float()).exp().sum(-1).clamp(max=1.0)


def alpha_topk(p_logp, p_ids, q_logp, q_ids=None):
    """A lower bound on alpha_exact from what was kept of each side (Sparrow estimates alpha from top-20 lists).

    p_logp, p_ids (..., k): one side's kept log-probs and their token ids (e.g. ro.topk_logp, ro.topk_ids).
    q_logp (..., V) the other side's full distribution (q_ids None), or q_logp, q_ids (..., k2) its own top-k.
    A token missing from a side counts as probability 0 there, so min(p, q) is summed over the intersection of
    the kept tokens (the union gives the same sum: its other terms are min(x, 0) = 0). Every term of the exact
    sum is either counted or dropped, never overstated: alpha_topk <= alpha_exact, with equality when the kept
    tokens of both sides cover the support. Two top-k lists are matched pairwise, (..., k, k2) booleans: fine
    for k of 20, and for a whole small vocabulary."""
    if p_logp.shape != p_ids.shape:
        raise ValueError(f"alpha_topk: p_logp {tuple(p_logp.shape)} and p_ids {tuple(p_ids.shape)} differ")
    if q_ids is None:  # q is a full distribution: look p's tokens up in it
        q_at = q_logp.float().gather(-1, p_ids.long())  # (..., k)
    else:
        if q_logp.shape != q_ids.shape:
            raise ValueError(f"alpha_topk: q_logp {tuple(q_logp.shape)} and q_ids {tuple(q_ids.shape)} differ")
        match = p_ids[..., :, None] == q_ids[..., None, :]  # (..., k, k2)
        q_at = q_logp.float()[..., None, :].masked_fill(~match, float("-inf")).amax(-1)  # -inf: not kept by q
    return torch.minimum(p_logp.float(), q_at).exp().sum(-1).clamp(max=1.0)


def alpha_sample(logp_dense, logp_sparse):
    """The per-sample form, one number per sampled token: min(1, p_dense(y) / p_sparse(y)) for y drawn from the
    sparse policy. Its expectation under sparse sampling is alpha_exact. (N, T) -> (N, T); mask it yourself."""
    return (logp_dense.float() - logp_sparse.float()).clamp(max=0.0).exp()


def bin_stats(alpha, mask, positions, bin_size, n_bins=None, q=0.05):
    """The tail statistic: alpha per bin of cached length -> {"count", "mean", "p5"}, (n_bins,) tensors each.

    alpha, mask (N, T) per-token alpha and the sampled-token mask.
    positions   (N, T) the cached length at each token, or (N,) offsets (prompt lengths) to which the completion
                position t is added. Any unit: tokens with bin_size = 2,048 (Sparrow's plots), or pages with
                positions = ro.budget_dense (pages cached at the step) and bin_size = a Schedule's bin_pages,
                which lines the bins up exactly with the schedule's.
    n_bins      defaults to the last occupied bin + 1; lengths beyond go to the last bin (as a schedule's last
                entry holds beyond its table).
    An empty bin has count 0 and mean, p5 NaN. "p5" is the q-quantile (linear interpolation), q = 0.05."""
    if alpha.shape != mask.shape:
        raise ValueError(f"bin_stats: alpha {tuple(alpha.shape)} and mask {tuple(mask.shape)} differ")
    if positions.dim() == 1:  # offsets: token t of row i sits at positions[i] + t
        positions = positions[:, None] + torch.arange(alpha.shape[1], device=positions.device)
    if positions.shape != alpha.shape:
        raise ValueError(f"bin_stats: positions {tuple(positions.shape)} match neither alpha {tuple(alpha.shape)} "
                         f"nor its rows ({alpha.shape[0]},)")
    m = mask.bool()
    a = alpha[m].float().cpu()
    bins = (positions.to(m.device)[m] // bin_size).long().cpu()
    if n_bins is None:
        n_bins = int(bins.max()) + 1 if bins.numel() else 1
    bins = bins.clamp(max=n_bins - 1)
    count = torch.bincount(bins, minlength=n_bins)
    mean, p5 = torch.full((n_bins,), float("nan")), torch.full((n_bins,), float("nan"))
    for b in count.nonzero()[:, 0].tolist():
        v = a[bins == b]
        mean[b], p5[b] = v.mean(), v.quantile(q)
    return {"count": count, "mean": mean, "p5": p5}


@torch.no_grad()
def dense_logprobs(model, prompt_ids, ro, temperature=1.0):
    """The dense side of the mismatch: a plain full forward (no cache, dense attention) over each row's prompt and
    completion -> (N, T) log-probs of the sampled tokens under softmax(logits / T), 0 where ro.mask is False.
    One row at a time, and only the completion positions are projected onto the vocabulary."""
    t = temperature if temperature > 0 else 1.0  # greedy rollouts report log-probs at T = 1
    dev = model.lm_head.weight.device
    out = torch.zeros(ro.mask.shape)
    for i in range(len(ro)):
        p, n = list(prompt_ids[int(ro.prompt_index[i])]), int(ro.mask[i].sum())
        if n == 0:
            continue
        comp = ro.tokens[i, :n]
        ids = torch.tensor(p + comp.tolist(), device=dev)[None]
        h = model(ids, hidden=True)[0, len(p) - 1:len(p) + n - 1]  # (n, C): position j predicts token j + 1
        lp = F.log_softmax(model.lm_head(h).float() / t, -1)
        out[i, :n] = lp.gather(-1, comp.to(dev)[:, None])[:, 0].cpu()
    return out


# ----------------------------------------------------------------------------- the schedule: pages per length bin


class Schedule:
    """Sparrow's schedule: read table[i] pages while the cached length is in bin i (bins of `bin_pages` pages;
    the last entry holds beyond the table). It is an engine budget function, `Engine(sparse=schedule)`; the
    engine keeps the object, so a Controller that edits the table steers the next `generate` call.

    threshold  the p5 alpha that the table was calibrated for (the Controller's default target)
    min_pages, max_pages  bounds for every entry (max None: unbounded; the engine reads at most what is cached)
    Save `state_dict()` with the checkpoint and `load_state_dict()` it on resume."""

    def __init__(self, table, bin_pages, threshold=0.86, min_pages=1, max_pages=None):
        if not (isinstance(bin_pages, int) and bin_pages >= 1):
            raise ValueError(f"Schedule: bin_pages must be an int >= 1, got {bin_pages!r}")
        if not 0 <= threshold <= 1:
            raise ValueError(f"Schedule: threshold is a p5 alpha in [0, 1], got {threshold}")
        if min_pages < 1 or (max_pages is not None and max_pages < min_pages):
            raise ValueError(f"Schedule: want 1 <= min_pages <= max_pages, got {min_pages}, {max_pages}")
        self.bin_pages, self.threshold, self.min_pages, self.max_pages = bin_pages, threshold, min_pages, max_pages
        self.table = [int(x) for x in table]
        if not self.table:
            raise ValueError("Schedule: the table is empty")
        bad = [(i, x) for i, x in enumerate(self.table) if x != self.clamp(x)]
        if bad:
            raise ValueError(f"Schedule: table entries (bin, pages) {bad} lie outside [min_pages={min_pages}, "
                             f"max_pages={max_pages}]")

    # no __len__: the engine tests `sparse or None`, and an object with a length could read as False

    def __call__(self, n_pages):
        return self.table[bin_index(n_pages, self.bin_pages, len(self.table))]

    budget = __call__

    def clamp(self, pages):
        pages = max(self.min_pages, int(pages))
        return pages if self.max_pages is None else min(self.max_pages, pages)

    def extend(self, n_bins):
        """Give the bins up to n_bins their own entries, each a copy of the last (which already held there)."""
        self.table += [self.table[-1]] * (n_bins - len(self.table))

    def state_dict(self):
        return {"table": list(self.table), "bin_pages": self.bin_pages, "threshold": self.threshold,
                "min_pages": self.min_pages, "max_pages": self.max_pages}

    def load_state_dict(self, sd):
        missing = {"table", "bin_pages", "threshold", "min_pages", "max_pages"} - set(sd)
        if missing:
            raise KeyError(f"Schedule.load_state_dict: missing keys {sorted(missing)}")
        self.__init__(sd["table"], sd["bin_pages"], sd["threshold"], sd["min_pages"], sd["max_pages"])

    def __repr__(self):
        return f"Schedule(table={self.table}, bin_pages={self.bin_pages}, threshold={self.threshold})"


def calibrate(measure, bins, candidates, threshold=0.86, monotone=True):
    """Offline calibration: the smallest candidate budget per bin whose p5 alpha reaches `threshold`.

    measure(table) -> p5 per bin: `bins` floats, NaN for a bin without tokens (see calibrate_engine).
    The sweep measures one uniform table, [c] * bins, per candidate c in ascending order, and each bin keeps the
    first c at which its own p5 passes: len(candidates) measurements instead of one per (bin, candidate). That
    treats the bins as independent. They are not quite: a token's mismatch comes mostly from its own step's
    budget, but earlier steps' budgets reach it through the keys and values that sparse layers wrote and
    through the tokens sampled. The online Controller corrects what this leaves.
    The sweep stops at the first candidate at which every bin with tokens has passed. A bin without tokens at
    any candidate copies the bin before it; one that failed while it had tokens and has none at the largest
    candidate (sparse rollouts that ran long where dense ones stop) gets the largest candidate; `monotone` lifts
    each bin to at least the one before it (the tail worsens with length; lifting never breaks a bin's threshold).
    A bin that no candidate satisfies is an error: include a candidate at least as large as the bin's cached
    pages, which reads it densely."""
    cands = sorted({int(c) for c in candidates})
    if not cands or cands[0] < 1:
        raise ValueError(f"calibrate: candidates must be page counts >= 1, got {candidates}")
    chosen, best, seen = [None] * bins, [float("nan")] * bins, [False] * bins
    last = [True] * bins  # whether the bin had tokens at the latest candidate
    for c in cands:
        p5 = [float(x) for x in measure([c] * bins)]
        if len(p5) < bins:
            raise ValueError(f"calibrate: measure returned {len(p5)} bins, expected {bins}")
        for b in range(bins):
            last[b] = not math.isnan(p5[b])
            if not last[b]:
                continue
            best[b] = max(best[b], p5[b]) if seen[b] else p5[b]
            seen[b] = True
            if chosen[b] is None and p5[b] >= threshold:
                chosen[b] = c
        if all(ch is not None or not s for ch, s in zip(chosen, seen)) and any(seen):
            break
    for b in range(bins):  # failed while it had tokens, then lost them (rollouts got shorter): the safe side
        if seen[b] and chosen[b] is None and not last[b]:
            chosen[b] = cands[-1]
    fail = [(b, round(best[b], 4)) for b in range(bins) if seen[b] and chosen[b] is None]
    if fail:
        raise ValueError(f"calibrate: bins (bin, best p5) {fail} stay below {threshold} at the largest candidate "
                         f"{cands[-1]} pages: add larger candidates")
    if not any(seen):
        raise ValueError("calibrate: measure returned no tokens in any bin")
    first = next(ch for ch in chosen if ch is not None)  # bins before the first measured one copy it
    table = []
    for ch in chosen:
        prev = table[-1] if table else first
        if ch is None:
            ch = prev
        table.append(max(ch, prev) if monotone else ch)
    return table


def calibrate_engine(model, tokenizer, prompt_ids, candidates, bin_pages, n_bins=None, group_size=1,
                     threshold=0.86, seed=0, min_count=1, max_new_tokens=256, temperature=1.0, page_size=16,
                     **engine_kw):
    """`calibrate` on a real model: measure(table) generates sparse rollouts of `prompt_ids` with that table,
    recomputes the sampled tokens' log-probs with a dense full forward (dense_logprobs), takes alpha_sample per
    token and its p5 per bin (bins of pages cached, aligned with the schedule; bins with fewer than `min_count`
    tokens count as empty). Every candidate samples with the same seed. engine_kw go to rollout.Engine
    (scorer, keep_recent, dense_layers, ...). Returns a Schedule."""
    from rollout import Engine  # rollout imports this module: import it when called

    if n_bins is None:  # enough bins for the longest prompt plus max_new_tokens
        longest = max(len(p) for p in prompt_ids) + max_new_tokens
        n_bins = -(-longest // page_size) // bin_pages + 1

    def measure(table):
        engine = Engine(model, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature,
                        page_size=page_size, sparse=Schedule(table, bin_pages), **engine_kw)
        ro = engine.generate(prompt_ids, group_size=group_size, seed=seed)
        alpha = alpha_sample(dense_logprobs(model, prompt_ids, ro, temperature), ro.logp)
        st = bin_stats(alpha, ro.mask, ro.budget_dense, bin_pages, n_bins)
        return torch.where(st["count"] >= max(1, min_count), st["p5"], float("nan")).tolist()

    return Schedule(calibrate(measure, n_bins, candidates, threshold), bin_pages, threshold)


# ----------------------------------------------------------------------------- the controller: online correction


class Controller:
    """Online: after every step's rollouts, `observe(p5, count)` (from bin_stats) moves each bin's budget toward
    the smallest one whose p5 alpha stays at `target`.

    - p5 < target: raise the bin by step_pages at once (a collapse costs more than a slow step), and remember
      that the old budget failed: the bin's floor becomes the new budget.
    - p5 >= target for `patience` observations in a row: lower it by step_pages, unless that would go below
      the floor (a budget known to fail). This probing goes on inside the deadband, so started from too large
      a table the controller still walks down to the minimal one; a rule that only lowered above
      target + deadband would stop anywhere inside the band.
    - The floor is the hysteresis: once a bin has failed one step down, it holds instead of oscillating. It is
      forgotten (back to min_pages) after 5 * patience observations in a row at least `deadband` above the
      target: the policy has drifted to a place where the tail has room, so a lower budget is worth a probe.
      (If one step of budget moves p5 by more than the deadband, that probe recurs every so often.)
    - Bins with fewer than `min_count` tokens (or NaN) are left alone: a 5th percentile needs tokens.
    - Entries stay within the schedule's [min_pages, max_pages]; bins past the table get their own entries.
    Noise that drops the minimal budget's p5 below target leaves the bin a step high: the safe side."""

    def __init__(self, schedule, target=None, step_pages=None, deadband=0.02, patience=3, min_count=64):
        if not isinstance(schedule, Schedule):
            raise TypeError(f"Controller wants a Schedule, got {type(schedule).__name__}")
        self.schedule = schedule
        self.target = schedule.threshold if target is None else target
        self.step = step_pages if step_pages is not None else max(1, schedule.bin_pages // 8)
        if self.step < 1 or patience < 1 or deadband < 0:
            raise ValueError(f"Controller: want step_pages >= 1, patience >= 1, deadband >= 0, got "
                             f"{self.step}, {patience}, {deadband}")
        self.deadband, self.patience, self.min_count = deadband, patience, min_count
        n = len(schedule.table)
        self.floor, self.calm, self.room = [schedule.min_pages] * n, [0] * n, [0] * n

    def observe(self, p5, count=None):
        """p5 (n_bins,) per-bin 5th percentile of alpha; count (n_bins,) tokens per bin. Returns
        {"raised": bins raised, "lowered": bins lowered}."""
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
            pages = s.table[b]
            if x < self.target:
                s.table[b] = self.floor[b] = s.clamp(pages + self.step)
                self.calm[b] = self.room[b] = 0
                moved["raised"] += s.table[b] != pages
                continue
            self.calm[b] += 1
            self.room[b] = self.room[b] + 1 if x >= self.target + self.deadband else 0
            if self.room[b] >= 5 * self.patience:
                self.floor[b], self.room[b] = s.min_pages, 0
            lower = s.clamp(pages - self.step)
            if self.calm[b] >= self.patience and self.floor[b] <= lower < pages:
                s.table[b], self.calm[b] = lower, 0
                moved["lowered"] += 1
        return moved

    def state_dict(self):
        return {"target": self.target, "floor": list(self.floor), "calm": list(self.calm), "room": list(self.room)}

    def load_state_dict(self, sd):
        self.target = sd["target"]
        self.floor, self.calm, self.room = list(sd["floor"]), list(sd["calm"]), list(sd["room"])


# ----------------------------------------------------------------------------- the cost model (after Kinetics)


def model_shape(cfg):
    """model.ModelConfig -> (P, layers, kv_heads, head_dim) for rollout_cost. P counts the parameters that each
    token multiplies through: every layer (for MoE, the router and the active experts only), the final norm and
    the output head; the embedding is a lookup, not a matmul. For a tied dense model that is num_params().
    From the rest: r = cfg.num_attention_heads / kv_heads and D = 2 * layers * kv_heads * head_dim."""
    C, hd, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    attn = 2 * C * Hq * hd + 2 * C * Hkv * hd + 2 * hd  # q, o; k, v; q_norm, k_norm
    if cfg.attention_bias:
        attn += Hq * hd + 2 * Hkv * hd + C
    P = cfg.hidden_size * cfg.vocab_size + C  # output head, final norm
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            mlp = C * cfg.num_experts + cfg.num_experts_per_tok * 3 * C * cfg.moe_intermediate_size
        else:
            mlp = 3 * C * cfg.intermediate_size
        P += attn + mlp + 2 * C  # two RMSNorms per block
    return P, cfg.num_hidden_layers, Hkv, hd


def rollout_cost(P, n_layers, N, r, D, L_in, L_out, flops, bandwidth, schedule=None, page_size=16,
                 dense_layers=2, keep_first=1, keep_recent=2, kv_bytes=2, meta_keys=1, param_bytes=0):
    """Predicted seconds to generate N completions of L_out tokens from one prompt of L_in tokens, dense and
    with `schedule` (any budget function: pages read from pages cached). Units:
        P          parameters per token (model_shape)           flops      FLOP/s the device sustains
        N          sequences sharing the prompt                 bandwidth  bytes/s of memory bandwidth (1 / I)
        r          query heads per KV head (GQA ratio)          kv_bytes   bytes per KV element (2: bf16)
        D          KV elements per token, all layers, K and V: 2 * layers * kv_heads * head_dim (57,344 for
                   Qwen3-1.7B: 112 KiB a token in bf16)
    Dense, the formula of Kinetics / Sparrow, C = 2 P N L_out + r (2 L_in + L_out) L_out N D
    + I (2 L_in L_out D + N L_out^2 D), in seconds:
        weights  2 P N L_out / flops                      every token multiplies through every parameter
        attn     r (2 L_in + L_out) L_out N D / flops     2 r D FLOPs per (token, context token): q.k and p.v
        kv       kv_bytes D (L_in L_out + N L_out^2 / 2) / bandwidth
                 per step the prompt's KV is read once for all N rows (a shared prefix) and each row reads its
                 own tokens; with kv_bytes = 2 this is the formula's 2 L_in L_out D + N L_out^2 D.
    The step that makes token t sees L_in + t + 1/2 context tokens (the midpoint: the sums over steps equal the
    closed form exactly). Sparse: in the layers past `dense_layers` a row reads f_t = K_t / n_t of its n_t
    cached pages, K_t = pages_to_read(schedule, ...) as the engine clamps it. Attention FLOPs and the row's own
    KV shrink by f_t; the prompt part shrinks to min(1, N f_t) (the rows' selections differ: counted as
    disjoint, a conservative bound). Added: `meta` for scoring, each row reads `meta_keys` key-sized vectors
    per page in the sparse layers (1: centroid, 2: Quest's min and max) and spends 2 FLOPs per element; a step
    that reads every page skips it. `param_bytes` > 0 adds the weights' traffic, param_bytes P per step (the
    formula leaves it out). Returns {"dense_s", "sparse_s", "speedup"} and the parts in seconds."""
    if min(P, n_layers, N, r, D, L_in, L_out, flops, bandwidth, page_size) <= 0:
        raise ValueError("rollout_cost: P, n_layers, N, r, D, L_in, L_out, flops, bandwidth and page_size must "
                         "all be positive")
    budget = schedule or dense_budget
    sp = max(0, n_layers - dense_layers) / n_layers  # share of D in sparse layers
    attn = kv = attn_s = kv_s = meta = 0.0  # FLOPs, bytes
    for t in range(L_out):
        ctx, cached = L_in + t + 0.5, L_in + t + 1
        n = -(-cached // page_size)
        f = pages_to_read(budget, n, cached // page_size, keep_first, keep_recent) / n
        attn += 2 * r * D * N * ctx
        kv += kv_bytes * D * (L_in + N * (t + 0.5))
        attn_s += 2 * r * D * N * ctx * ((1 - sp) + sp * f)
        kv_s += kv_bytes * D * ((1 - sp) * (L_in + N * (t + 0.5)) + sp * (min(1.0, N * f) * L_in + N * f * (t + 0.5)))
        if f < 1:
            meta += N * n * meta_keys * (sp * D / 2) * (kv_bytes / bandwidth + 2 / flops)  # seconds
    weights = 2 * P * N * L_out / flops + param_bytes * P * L_out / bandwidth
    parts = {"weights_s": weights, "attn_s": attn / flops, "kv_s": kv / bandwidth,
             "attn_sparse_s": attn_s / flops, "kv_sparse_s": kv_s / bandwidth, "meta_s": meta}
    dense = weights + parts["attn_s"] + parts["kv_s"]
    sparse = weights + parts["attn_sparse_s"] + parts["kv_sparse_s"] + meta
    return {"dense_s": dense, "sparse_s": sparse, "speedup": dense / sparse, **parts}


# ----------------------------------------------------------------------------- N:M weight masks


def nm_mask(weight, n, m, scores=None):
    """weight (out, in) -> bool mask (out, in) that keeps, in every output row, the n best of each m consecutive
    inputs (the layout 2:4 sparse tensor cores want). Best = largest |w|, or largest `scores` when given: a tensor
    of weight's shape, e.g. Wanda's |W| * ||X||_2 with ||X||_2 (in,) the norm of each input channel over some
    calibration tokens: `nm_mask(w, 2, 4, scores=w.abs() * xnorm)`. Ties are broken arbitrarily."""
    if weight.dim() != 2:
        raise ValueError(f"nm_mask wants a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
    if not 0 < n <= m:
        raise ValueError(f"nm_mask wants 0 < n <= m, got n={n}, m={m}")
    out_f, in_f = weight.shape
    if in_f % m:
        raise ValueError(f"nm_mask: weight of shape {tuple(weight.shape)} has {in_f} inputs, not a multiple of m={m}")
    s = weight.abs() if scores is None else scores
    if s.shape != weight.shape:
        raise ValueError(f"nm_mask: scores of shape {tuple(s.shape)} do not match weight {tuple(weight.shape)}")
    groups = s.detach().float().reshape(out_f, in_f // m, m)  # (out, in/m, m): one group per m inputs
    keep = groups.topk(n, dim=-1, sorted=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(out_f, in_f)


@torch.no_grad()
def apply_nm(model, n, m, skip=("lm_head", "embed", "gate.")):
    """Zero the pruned weights of every nn.Linear in place, magnitude N:M, and return {weight name: mask}.
    `skip` holds substrings of weight names left dense: the output head (tied to the embeddings in small models)
    and the MoE router ("mlp.gate.weight"; "gate." does not match "gate_proj"), whose few, small logits decide
    routing. Pruning is masked dense: the zeros are stored, so it saves compute only with a 2:4 kernel."""
    masks = {}
    for name, mod in model.named_modules():
        wname = f"{name}.weight"
        if not isinstance(mod, torch.nn.Linear) or any(s in wname for s in skip):
            continue
        try:
            mask = nm_mask(mod.weight, n, m)
        except ValueError as e:
            raise ValueError(f"apply_nm: layer {name}: {e}") from None
        mod.weight.masked_fill_(~mask, 0)
        masks[wname] = mask
    return masks
