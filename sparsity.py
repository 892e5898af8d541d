"""
sparsity.py: sparsity primitives that several stages share. This first part is the KV-page selection
that the rollout engine's block-sparse decode uses (Sparrow's "block top-k", with Quest's bound as
an option).

    from sparsity import fraction_budget
    engine = Engine(model, tok, sparse=fraction_budget(1 / 8), scorer="centroid", keep_recent=2,
                    dense_layers=2)

How a decode step picks the KV pages it reads, per sequence and per KV head:
    1. Every full page carries metadata, written once when the page fills: its mean key, and for
       Quest its elementwise min and max keys.
    2. A scorer rates each page against the step's query: `centroid_scores` (the query averaged over
       its GQA group, dotted with the mean key) or `quest_scores` (Quest's upper bound on q . k over
       the page).
    3. A budget function says how many pages to read from how many are cached:
       `budget(n_pages) -> int`. `fixed_budget`, `fraction_budget`, `dense_budget`, the per-bin
       `table_budget` and calibrate.Schedule all fit.
    4. `select_pages` keeps the first `keep_first` pages (attention sinks), the last `keep_recent`
       pages and the partial last page, then fills the rest of the budget with the best-scored
       pages. Its output is what `zeros_kernels.block_sparse_decode.decode_attention` takes: LOGICAL page
       ids, padded, and a count. On a CPU, `zeros_kernels.sparse_decode_cpu.select_pages_cpu` does
       steps 2 to 4 in one C++ call, the metadata read in place (the same pages, ties aside).

Simplifications:
    1. The budget counts every page read, the always-kept ones included; a budget below the kept
       count reads just the kept pages, one above the cached count reads everything. (Sparrow's
       published table, 29, 61, 93, ..., looks like it counts the top-k pages alone: add the kept
       pages to use it.)
    2. The budget is per sequence (a function of its own length), shared by all its KV heads and
       sparse layers; which pages fill it differs per KV head.
    3. Quest with GQA: the bound is taken per query head and the group keeps the max, since a page
       is read for the whole group and matters if it matters to any one of its heads.
    4. Scores are fp32 and unscaled (1/sqrt(D) does not change a ranking).

The sparse-to-dense mismatch (Sparrow): alpha, the acceptance rate of speculative decoding.
Sparrow's statistic is per POSITION: alpha_t = sum_v min(p_dense(v), p_sparse(v)) = 1 - TV at every
sampled position, and its thresholds (p5 >= 0.86 per bin) are defined on that.
    dense_alpha(model, prompt_ids, ro)    alpha_t for a rollout: the engine's kept distribution
                                          (the whole vocabulary: exact; top-k: a lower bound)
                                          against a plain full dense forward. What calibration,
                                          the controller and the log threshold
    alpha_exact(p_logp, q_logp)           sum_v min(p, q) = 1 - TV over two full distributions
    alpha_topk(ro.topk_logp, ro.topk_ids, dense_logp)
                                          a lower bound from what was kept of each side
    alpha_sample(dense_logp, ro.logp)     min(1, p_dense(y) / p_sparse(y)) for the one sampled
                                          token: the same mean, but not the same tail (each token
                                          gives 1 or one noisy ratio). A diagnostic, never a
                                          threshold
    bin_stats(alpha, ro.mask, ro.budget_dense, schedule.bin_pages)
                                          count, mean, p5 per bin of cached length
    rollout_tv(alpha, ro.mask)            each rollout's summed TV, sum_t (1 - alpha_t): the
                                          expected positions where sparse and dense part, what
                                          decides an exact chain (calibrate.tv_bin_stats bins it)
    dense_logprobs(model, prompt_ids, ro) the dense side's sampled-token log-probs alone
Collapse shows in the tail, not the mean: Sparrow keeps the 5th percentile per 2,048-token bin above
0.86. The budget schedule that holds that tail, its calibration sweep and its online controller are
calibrate.py's.

N:M weight masks (the last sections): `nm_mask(w, n, m)` keeps the n best of every m consecutive
inputs in each output row, by |w| or by given scores; `apply_nm(model, 2, 4)` prunes every Linear
in place (NM_SKIP: the head, the embeddings and the MoE router stay dense), with magnitude or
`wanda_scores(model, batches)` (|W| * ||X||_2 per input channel, from a forward pre-hook over
calibration batches). `SRSTE(model, 2, 4)` fine-tunes dense weights through their N:M masks
(SR-STE: straight-through gradient plus a decay on the pruned weights, masks recomputed every k
steps); `MaskedParams(model, masks)` keeps fixed masks through optimizer steps. copies.py's
"nm2:4" rollout copy uses apply_nm; roi.py learns masks (RoI) and compares the methods.
Simplifications: masked dense, so a 2:4 kernel (`to_sparse_semi_structured`) is what would turn the
zeros into speed; the weight is the (out, in) matrix of an nn.Linear, grouped along its inputs.

Tests: `python -m pytest tests/test_sparsity.py tests/test_mismatch.py tests/test_copies.py
tests/test_nm.py`.
"""

import math

import torch
import torch.nn.functional as F

from model import swap_module

# --------------------------------------------------------------------------- budgets: pages to read


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
    """A schedule: table[i] pages for cached lengths in bin i (bins of `bin_pages` pages), and the
    last entry beyond the table. Sparrow's tables use bins of 2,000 tokens (125 pages of 16)."""
    if not table or bin_pages < 1:
        raise ValueError(f"table_budget wants a non-empty table and bin_pages >= 1, got {table}, "
                         f"{bin_pages}")
    table = [int(x) for x in table]
    return lambda n_pages: table[bin_index(n_pages, bin_pages, len(table))]


def bin_index(n_pages, bin_pages, n_bins):
    """The bin of a cached length in pages: bins of `bin_pages` pages, the last one open-ended."""
    return min(n_pages // bin_pages, n_bins - 1)


def kept_count(n_pages, n_full, keep_first, keep_recent):
    """How many pages a sequence always reads: the first ones, the recent ones and the partial last
    page. The two ranges start at opposite ends, so their union is their summed size capped at
    n_pages."""
    # n_pages - n_full is 1 when the last page is partial
    recent = max(keep_recent, n_pages - n_full)
    return min(n_pages, min(keep_first, n_pages) + recent)


def pages_to_read(budget, n_pages, n_full, keep_first, keep_recent):
    """The budget of one sequence, clamped to [pages always kept, pages cached]. Python ints, no
    device."""
    want = int(budget(n_pages))
    return min(n_pages, max(want, kept_count(n_pages, n_full, keep_first, keep_recent)))


# ----------------------------------------------------------------------------- scorers


def centroid_scores(q, kmean):
    """Sparrow's block score. q (B, H_q, D) decode queries, kmean (B, P, H_kv, D) mean key of each
    logical page -> (B, H_kv, P): the GQA group's mean query dotted with the page's mean key."""
    B, H_q, D = q.shape
    H_kv = kmean.shape[2]
    qg = q.float().view(B, H_kv, H_q // H_kv, D).mean(2)  # (B, H_kv, D)
    return torch.einsum("bhd,bphd->bhp", qg, kmean.float())  # (B, H_kv, P)


def quest_scores(q, kmin, kmax):
    """Quest's bound. q (B, H_q, D), kmin/kmax (B, P, H_kv, D) elementwise key extremes of each page
    -> (B, H_kv, P): sum_i max(q_i * min_i, q_i * max_i), an upper bound on q . k for any key k in
    the page, per query head, then the max over the GQA group (simplification 3)."""
    B, H_q, D = q.shape
    H_kv = kmin.shape[2]
    qg = q.float().view(B, H_kv, H_q // H_kv, 1, D)  # (B, H_kv, G, 1, D)
    lo = kmin.float().permute(0, 2, 1, 3)[:, :, None]  # (B, H_kv, 1, P, D)
    hi = kmax.float().permute(0, 2, 1, 3)[:, :, None]
    bound = torch.maximum(qg * lo, qg * hi).sum(-1)  # (B, H_kv, G, P)
    return bound.amax(2)


def oracle_scores(q, kpages, seq_lens):
    """The yardstick scorer: the attention mass each page really gets. q (B, H_q, D) decode queries,
    kpages (B, P, page_size, H_kv, D) the keys of each logical page, seq_lens (B,) tokens cached ->
    (B, H_kv, P): softmax(q . k / sqrt(D)) over the row's cached tokens, summed per page, the max
    over the GQA group. It reads every key, as dense attention does, so it saves nothing;
    calibrating with it (kv_scorer="oracle") tells a weak scorer apart from a task whose attention
    tail is spread over many pages."""
    B, H_q, D = q.shape
    _, P, ps, H_kv, _ = kpages.shape
    qg = q.float().view(B, H_kv, H_q // H_kv, D)
    # (B, H_kv, G, P, ps)
    logits = torch.einsum("bhgd,bpthd->bhgpt", qg, kpages.float()) * D ** -0.5
    ok = (torch.arange(P * ps, device=q.device).view(P, ps)
          < seq_lens.to(q.device).long()[:, None, None])  # (B, P, ps): slots holding a cached token
    logits = logits.masked_fill(~ok[:, None, None], float("-inf"))
    # an empty row: all -inf -> 0
    w = torch.softmax(logits.reshape(B, H_kv, -1, P * ps), -1).nan_to_num(0.0)
    return w.view(B, H_kv, -1, P, ps).sum(-1).amax(2)


def page_metadata(pages, with_bounds):
    """pages (n, page_size, H_kv, D) full pages of keys -> mean (n, H_kv, D), and min, max or None,
    None."""
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
    -> sel (B, H_kv, max_read) int32 logical page ids, ascending, zero-padded; n_sel (B, H_kv)
    int32.
    """
    B, H_kv, P = scores.shape
    dev = scores.device
    j = torch.arange(P, device=dev)
    # (B, 1) each, to broadcast against the page ids j
    n_pages, n_full, n_read = (x.to(dev).long()[:, None] for x in (n_pages, n_full, n_read))
    valid = j < n_pages  # (B, P)
    # always read: the first keep_first (sinks), the last keep_recent and the partial last page
    kept = valid & ((j < keep_first) | (j >= n_pages - keep_recent) | (j >= n_full))
    # kept pages score +inf so topk takes them first; pages past the row's end score -inf
    s = (scores.float().masked_fill(kept[:, None], float("inf"))
         .masked_fill(~valid[:, None], float("-inf")))
    # CPU-GPU sync point unless max_read is given
    k = int(n_read.max()) if max_read is None else max_read
    top = s.topk(k, dim=-1).indices  # (B, H_kv, k): kept pages first (+inf), then the best scores
    used = torch.arange(k, device=dev) < n_read[:, :, None]  # (B, 1, k)
    # padding as P sorts after every real page id, then becomes 0 (the kernel skips it by n_sel)
    sel = torch.where(used, top, P).sort(-1).values  # ascending page order reads memory in order
    sel = torch.where(used, sel, 0).to(torch.int32)
    return sel, n_read.to(torch.int32).expand(B, H_kv)


# -------------------------------------------------------------- mismatch: the acceptance rate alpha


def alpha_exact(p_logp, q_logp):
    """Acceptance rate of two full distributions: sum_v min(p(v), q(v)) = 1 - TV(p, q).
    p_logp, q_logp (..., V) log-probs -> (...,) in [0, 1]. min(p, q) = exp(min(log p, log q)): no
    underflow trap."""
    if p_logp.shape != q_logp.shape:
        raise ValueError(f"alpha_exact: p_logp {tuple(p_logp.shape)} and q_logp "
                         f"{tuple(q_logp.shape)} differ")
    return torch.minimum(p_logp.float(), q_logp.float()).exp().sum(-1).clamp(max=1.0)


def alpha_topk(p_logp, p_ids, q_logp, q_ids=None):
    """A lower bound on alpha_exact from what was kept of each side (Sparrow estimates alpha from
    top-20 lists).

    p_logp, p_ids (..., k): one side's kept log-probs and their token ids (e.g. ro.topk_logp,
    ro.topk_ids). q_logp (..., V) the other side's full distribution (q_ids None), or q_logp, q_ids
    (..., k2) its own top-k. A token missing from a side counts as probability 0 there, so min(p, q)
    is summed over the intersection of the kept tokens (the union gives the same sum: its other
    terms are min(x, 0) = 0). Every term of the exact sum is either counted or dropped, never
    overstated: alpha_topk <= alpha_exact, with equality when the kept tokens of both sides cover
    the support. Two top-k lists are matched pairwise, (..., k, k2) booleans: fine for k of 20, and
    for a whole small vocabulary."""
    if p_logp.shape != p_ids.shape:
        raise ValueError(f"alpha_topk: p_logp {tuple(p_logp.shape)} and p_ids {tuple(p_ids.shape)} "
                         f"differ")
    if q_ids is None:  # q is a full distribution: look p's tokens up in it
        q_at = q_logp.float().gather(-1, p_ids.long())  # (..., k)
    else:
        if q_logp.shape != q_ids.shape:
            raise ValueError(f"alpha_topk: q_logp {tuple(q_logp.shape)} and q_ids "
                             f"{tuple(q_ids.shape)} differ")
        match = p_ids[..., :, None] == q_ids[..., None, :]  # (..., k, k2)
        # -inf: not kept by q
        q_at = q_logp.float()[..., None, :].masked_fill(~match, float("-inf")).amax(-1)
    return torch.minimum(p_logp.float(), q_at).exp().sum(-1).clamp(max=1.0)


def alpha_sample(logp_dense, logp_sparse):
    """The per-sample form, one number per sampled token: min(1, p_dense(y) / p_sparse(y)) for y
    drawn from the sparse policy. Its expectation under sparse sampling is alpha_exact. (N, T) ->
    (N, T); mask it yourself."""
    return (logp_dense.float() - logp_sparse.float()).clamp(max=0.0).exp()


def bin_stats(alpha, mask, positions, bin_size, n_bins=None, q=0.05):
    """The tail statistic: alpha per bin of cached length -> {"count", "mean", "p5"}, (n_bins,)
    tensors each.

    alpha, mask (N, T) per-token alpha and the sampled-token mask.
    positions   (N, T) the cached length at each token, or (N,) offsets (prompt lengths) to which
                the completion position t is added. Any unit: tokens with bin_size = 2,048
                (Sparrow's plots), or pages with positions = ro.budget_dense (pages cached at the
                step) and bin_size = a Schedule's bin_pages, which lines the bins up exactly with
                the schedule's.
    n_bins      defaults to the last occupied bin + 1; lengths beyond go to the last bin (as a
                schedule's last entry holds beyond its table).
    An empty bin has count 0 and mean, p5 NaN. "p5" is the q-quantile (linear interpolation),
    q = 0.05."""
    if alpha.shape != mask.shape:
        raise ValueError(f"bin_stats: alpha {tuple(alpha.shape)} and mask {tuple(mask.shape)} "
                         f"differ")
    if positions.dim() == 1:  # offsets: token t of row i sits at positions[i] + t
        positions = positions[:, None] + torch.arange(alpha.shape[1], device=positions.device)
    if positions.shape != alpha.shape:
        raise ValueError(f"bin_stats: positions {tuple(positions.shape)} match neither alpha "
                         f"{tuple(alpha.shape)} nor its rows ({alpha.shape[0]},)")
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


def rollout_tv(alpha, mask):
    """The rollout-level mismatch: each rollout's summed TV, sum_t (1 - alpha_t) over its sampled
    tokens, the expected number of positions at which sparse and dense sampling would part.
    alpha, mask (N, T) -> (N,). An exact chain fails at its first wrong token, so this, not a
    per-position quantile, is what decides whether a sparse rollout is still the dense one's."""
    return ((1 - alpha.float()) * mask.float()).sum(1)


@torch.no_grad()
def dense_logprobs(model, prompt_ids, ro, temperature=1.0):
    """The dense side of the mismatch: a plain full forward (no cache, dense attention) over each
    row's prompt and completion -> (N, T) log-probs of the sampled tokens under softmax(logits / T),
    0 where ro.mask is False. One row at a time, and only the completion positions are projected
    onto the vocabulary."""
    t = temperature if temperature > 0 else 1.0  # greedy rollouts report log-probs at T = 1
    dev = model.lm_head.weight.device
    out = torch.zeros(ro.mask.shape, device="cpu")  # host, as the rollout's fields are
    for i in range(len(ro)):
        p, n = list(prompt_ids[int(ro.prompt_index[i])]), int(ro.mask[i].sum())
        if n == 0:
            continue
        comp = ro.tokens[i, :n]
        ids = torch.tensor(p + comp.tolist(), device=dev)[None]
        # (n, C): position j predicts token j + 1
        h = model(ids, hidden=True)[0, len(p) - 1:len(p) + n - 1]
        lp = F.log_softmax(model.lm_head(h).float() / t, -1)
        out[i, :n] = lp.gather(-1, comp.to(dev)[:, None])[:, 0].cpu()
    return out


EXACT_VOCAB = 256  # vocabularies this small keep their whole distribution: alpha is exact


def alpha_k(vocab_size, topk=20):
    """How much of its distribution a rollout keeps per position for dense_alpha: all of a small
    vocabulary (exact), else the top-k (Sparrow keeps 20; a lower bound)."""
    return vocab_size if vocab_size <= EXACT_VOCAB else min(topk, vocab_size)


@torch.no_grad()
def dense_alpha(model, prompt_ids, ro, temperature=1.0, micro_batch=16, chunk=4096):
    """Sparrow's mismatch statistic, per position: alpha_t = sum_v min(p_dense(v), p_rollout(v))
    = 1 - TV at every sampled position of a rollout. The rollout side is what the engine kept of its
    distribution (Engine(topk_logprobs=k): ro.topk_logp, ro.topk_ids): the whole vocabulary gives
    alpha exactly, a top-k list a lower bound (alpha_topk). The dense side is a plain full forward
    of `model` (the policy, dense attention, full precision) over prompt + completion, whole
    distribution. -> (N, T) alpha, 0 where ro.mask is False. Rows go `micro_batch` at a time,
    right-padded; the vocabulary projection `chunk` positions at a time."""
    if ro.topk_logp is None:
        raise ValueError("dense_alpha needs the rollout's distribution: build the Engine with "
                         "topk_logprobs=k (the vocabulary size for alpha exactly)")
    t = temperature if temperature > 0 else 1.0  # greedy rollouts report log-probs at T = 1
    dev = model.lm_head.weight.device
    lens = ro.mask.sum(1).tolist()
    alpha = torch.zeros(ro.mask.shape, device="cpu")  # host, as the rollout's fields are
    for rows in torch.arange(len(ro), device="cpu").split(micro_batch):
        rows = [r for r in rows.tolist() if lens[r]]
        if not rows:
            continue
        seqs = [list(prompt_ids[int(ro.prompt_index[r])]) + ro.tokens[r, :lens[r]].tolist()
                for r in rows]
        # built on the host row by row, then copied to the device for the forward; sel: the
        # positions that predict a sampled token
        ids = torch.zeros(len(rows), max(len(s) for s in seqs), dtype=torch.long, device="cpu")
        sel = torch.zeros(ids.shape, dtype=torch.bool, device="cpu")
        for j, (s, r) in enumerate(zip(seqs, rows)):
            ids[j, :len(s)] = torch.tensor(s, device="cpu")
            sel[j, len(s) - lens[r] - 1:len(s) - 1] = True  # position p predicts token p + 1
        h = model(ids.to(dev), hidden=True)[sel.to(dev)]  # (M, C), row-major: row by row
        m = ro.mask[rows]  # the same M positions, in the same order
        q_logp, q_ids = ro.topk_logp[rows][m], ro.topk_ids[rows][m]  # (M, k)
        out = []
        for a in range(0, h.shape[0], chunk):  # (chunk, V) logits at a time: large vocabularies fit
            p = F.log_softmax(model.lm_head(h[a:a + chunk]).float() / t, -1)
            out.append(alpha_topk(q_logp[a:a + chunk].to(dev), q_ids[a:a + chunk].to(dev), p).cpu())
        alpha[rows] = alpha[rows].masked_scatter(m, torch.cat(out))
    return alpha


# ----------------------------------------------------------------------------- N:M weight masks

# left dense: the output head (tied to the embeddings in small models) and the MoE router
# ("mlp.gate.weight"; "gate." does not match "gate_proj"), whose few, small logits decide routing
NM_SKIP = ("lm_head", "embed", "gate.")


def nm_mask(weight, n, m, scores=None):
    """weight (out, in) -> bool mask (out, in) that keeps, in every output row, the n best of each m
    consecutive inputs (the layout 2:4 sparse tensor cores want). Best = largest |w|, or largest
    `scores` when given: a tensor of weight's shape, e.g. Wanda's |W| * ||X||_2 with ||X||_2 (in,)
    the norm of each input channel over some calibration tokens:
    `nm_mask(w, 2, 4, scores=w.abs() * xnorm)`. Ties are broken arbitrarily."""
    if weight.dim() != 2:
        raise ValueError(f"nm_mask wants a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
    if not 0 < n <= m:
        raise ValueError(f"nm_mask wants 0 < n <= m, got n={n}, m={m}")
    out_f, in_f = weight.shape
    if in_f % m:
        raise ValueError(f"nm_mask: weight of shape {tuple(weight.shape)} has {in_f} inputs, not a "
                         f"multiple of m={m}")
    s = weight.abs() if scores is None else scores
    if s.shape != weight.shape:
        raise ValueError(f"nm_mask: scores of shape {tuple(s.shape)} do not match weight "
                         f"{tuple(weight.shape)}")
    # (out, in/m, m): one group per m inputs
    groups = s.detach().float().reshape(out_f, in_f // m, m)
    keep = groups.topk(n, dim=-1, sorted=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(out_f, in_f)


def nm_linears(model, skip=NM_SKIP):
    """{weight name: nn.Linear} of the layers that N:M prunes: every nn.Linear whose weight name
    contains none of the `skip` substrings. A DDP wrapper is looked through."""
    model = getattr(model, "module", model)
    return {f"{name}.weight": mod for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and not any(s in f"{name}.weight" for s in skip)}


@torch.no_grad()
def apply_nm(model, n, m, skip=NM_SKIP, scores=None):
    """Zero the pruned weights of every nn.Linear in place and return {weight name: mask}. The
    mask keeps the largest |w| (magnitude), or the largest `scores[weight name]` when a dict of
    scores is given (wanda_scores' output, say). `skip` holds substrings of weight names left
    dense (NM_SKIP). Pruning is masked dense: the zeros are stored, so it saves compute only with a
    2:4 kernel."""
    masks = {}
    for wname, mod in nm_linears(model, skip).items():
        if scores is not None and wname not in scores:
            raise KeyError(f"apply_nm: no scores for {wname}")
        try:
            mask = nm_mask(mod.weight, n, m, None if scores is None else scores[wname])
        except ValueError as e:
            raise ValueError(f"apply_nm: layer {wname[:-len('.weight')]}: {e}") from None
        mod.weight.masked_fill_(~mask, 0)
        masks[wname] = mask
    return masks


@torch.no_grad()
def input_norms(model, batches, skip=NM_SKIP):
    """Wanda's calibration statistic: the L2 norm of each input channel of every prunable Linear
    over all calibration tokens -> {weight name: (in,) fp32}. `batches` yields model inputs ((B, T)
    token ids), or (ids, valid) pairs whose (B, T) bool `valid` marks the real tokens, so that
    padding does not count. A forward pre-hook per layer sums x**2 per channel. An MoE expert's
    input arrives flattened to its routed tokens, so `valid` cannot select there: its padding
    tokens count."""
    layers = nm_linears(model, skip)
    sq = {k: torch.zeros(mod.in_features, device=mod.weight.device) for k, mod in layers.items()}
    state = {"valid": None}

    def hook(name):
        def fn(mod, args):
            x, valid = args[0].detach(), state["valid"]
            if valid is not None and x.shape[:-1] == valid.shape:
                x = x[valid]
            sq[name] += x.float().reshape(-1, x.shape[-1]).pow(2).sum(0)
        return fn

    handles = [mod.register_forward_pre_hook(hook(k)) for k, mod in layers.items()]
    dev = next(iter(layers.values())).weight.device if layers else "cpu"
    try:
        for b in batches:
            ids, valid = b if isinstance(b, (tuple, list)) else (b, None)
            state["valid"] = None if valid is None else valid.to(dev)
            model(ids.to(dev))
    finally:
        for h in handles:
            h.remove()
    return {k: v.sqrt() for k, v in sq.items()}


def wanda_scores(model, batches, skip=NM_SKIP):
    """{weight name: |W| * ||X||_2}, Wanda's score, with the input norms over `batches` (see
    input_norms). Pass it to apply_nm(model, n, m, scores=...)."""
    norms = input_norms(model, batches, skip)
    return {k: mod.weight.detach().abs() * norms[k][None].to(mod.weight.dtype)
            for k, mod in nm_linears(model, skip).items()}


# --------------------------------------------------------- SR-STE: train dense, run N:M


class SRSTEFunction(torch.autograd.Function):
    """SR-STE's masked weight. Forward: W * mask. Backward: the gradient of the masked weight goes
    straight through to every entry of W (dense), plus decay * (1 - mask) * W, which pulls the
    pruned weights toward zero so that the mask settles (the "sparse-refined" term)."""

    @staticmethod
    def forward(ctx, weight, mask, decay):
        ctx.save_for_backward(weight, mask)
        ctx.decay = decay
        return weight * mask

    @staticmethod
    def backward(ctx, grad):
        weight, mask = ctx.saved_tensors
        return grad + ctx.decay * weight * ~mask, None, None


class NMLinear(torch.nn.Module):
    """A Linear trained by SR-STE: forward with its N:M-masked weight, backward through
    SRSTEFunction. It holds the wrapped Linear's own weight and bias Parameters (the bias is never
    masked), so the optimizer and state_dict see the same tensors under the same names; the mask is
    a non-persistent buffer, so a checkpoint holds the dense weights."""

    def __init__(self, linear, n, m, decay):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.n, self.m, self.decay = n, m, decay
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("mask", nm_mask(linear.weight, n, m), persistent=False)

    @torch.no_grad()
    def remask(self):
        self.mask.copy_(nm_mask(self.weight, self.n, self.m))

    def forward(self, x):
        return F.linear(x, SRSTEFunction.apply(self.weight, self.mask, self.decay), self.bias)


class SRSTE:
    """SR-STE fine-tuning of a whole model: every prunable Linear (nm_linears) becomes an NMLinear,
    in place; the optimizer keeps updating the dense weights.

        sr = SRSTE(model, 2, 4, decay=2e-4, every=1)
        loss.backward(); opt.step(); sr.step()   # counts steps; magnitude masks anew every `every`
        masks = sr.remove()                      # plain Linears again, pruned weights zeroed

    Each backward adds the decay once, so with gradient accumulation it counts once per micro-batch.
    """

    def __init__(self, model, n, m, decay=2e-4, every=1, skip=NM_SKIP):
        if every < 1:
            raise ValueError(f"SRSTE: every must be >= 1, got {every}")
        self.model, self.every, self.steps = getattr(model, "module", model), every, 0
        self.layers, self.linears = {}, nm_linears(model, skip)
        for wname, lin in self.linears.items():
            name = wname[:-len(".weight")]
            try:
                self.layers[wname] = NMLinear(lin, n, m, decay)
            except ValueError as e:
                raise ValueError(f"SRSTE: layer {name}: {e}") from None
        for wname, layer in self.layers.items():
            swap_module(self.model, wname[:-len(".weight")], layer)

    def step(self):
        """Call after each optimizer step: every `every` steps the masks follow the weights."""
        self.steps += 1
        if self.steps % self.every == 0:
            for layer in self.layers.values():
                layer.remask()

    def masks(self):
        return {k: layer.mask.clone() for k, layer in self.layers.items()}

    @torch.no_grad()
    def remove(self):
        """Bake: the final magnitude masks of the final weights zero the pruned entries, the
        original nn.Linear modules go back in place -> {weight name: mask}."""
        for wname, layer in self.layers.items():
            layer.remask()
            layer.weight.masked_fill_(~layer.mask, 0)
            swap_module(self.model, wname[:-len(".weight")], self.linears[wname])
        return self.masks()


# ------------------------------------------------------- a fixed mask: only active weights move


class MaskedParams:
    """Fixed masks, {parameter name: bool tensor, True = active}: pruned entries get no gradient
    before the optimizer step and are set back to exactly 0 after it, so neither Adam's moments
    nor weight decay can move them.

        mp = MaskedParams(model, apply_nm(model, 2, 4))
        loss.backward(); mp.mask_grads(); clip_grad_norm_(...); opt.step(); mp.mask_weights()
        mp.step(opt)                             # the last three in one call, no clipping
        mp = MaskedParams.from_model(model, 2, 4)   # the masks of an already N:M model (resume)
    """

    def __init__(self, model, masks):
        params = dict(getattr(model, "module", model).named_parameters())
        missing = sorted(set(masks) - set(params))
        if missing:
            raise KeyError(f"MaskedParams: the model has no parameters {missing[:5]}")
        for k, mask in masks.items():
            if mask.shape != params[k].shape or mask.dtype != torch.bool:
                raise ValueError(f"MaskedParams: mask for {k} is {mask.dtype} "
                                 f"{tuple(mask.shape)}, the parameter {tuple(params[k].shape)}")
        self.masks = {k: v.to(params[k].device) for k, v in masks.items()}
        self.params = {k: params[k] for k in masks}

    @classmethod
    def from_model(cls, model, n, m, skip=NM_SKIP):
        """Masks read off a model that is already N:M (an `roi.py` output, a checkpoint of a masked
        run): its pruned weights are exactly 0, so magnitude keeps its active ones (unless an
        active weight is itself exactly 0). Refuses a model that is not N:M there."""
        masks = {k: nm_mask(mod.weight, n, m) for k, mod in nm_linears(model, skip).items()}
        bad = [k for k, mod in nm_linears(model, skip).items() if mod.weight[~masks[k]].any()]
        if bad:
            raise ValueError(f"MaskedParams.from_model: {bad[:3]} are not {n}:{m} sparse")
        return cls(model, masks)

    @torch.no_grad()
    def mask_grads(self):
        for k, p in self.params.items():
            if p.grad is not None:
                p.grad.masked_fill_(~self.masks[k], 0)

    @torch.no_grad()
    def mask_weights(self):
        for k, p in self.params.items():
            p.masked_fill_(~self.masks[k], 0)

    def step(self, opt):
        self.mask_grads()
        opt.step()
        self.mask_weights()

    @torch.no_grad()
    def leaked(self):
        """How many pruned entries are not exactly 0 (0 unless something bypassed the masks)."""
        return sum(int(p[~self.masks[k]].count_nonzero()) for k, p in self.params.items())
