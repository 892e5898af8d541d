"""
update.py: stage 4, the update. Group advantages, importance weights for the rollout/trainer
mismatch, the clipped policy-gradient loss, the log-probs it needs, and the optimizer passes over
one batch.

    ids, tmask, adv, roll = batch_from_groups(kept, pool_ids, G, pad_id, adv_eps, dev)
    out = train_on(cfg, model, opt, ids, tmask, adv, world=1,
                   rollout_logp=roll)  # out["stats"], is_cut
    python -m pytest -q tests/test_update.py tests/test_train.py

The loss, per sampled token t of completion i in group g:
    A_i     = (r_i - mean_g r) / (std_g r + eps)                 group-normalised advantage
    ratio_t = exp(logp_t - logp_old_t)
    loss_t  = -min(ratio_t A_i, clip(ratio_t, 1 - clip_low, 1 + clip_high) A_i)
                                                                 clip-higher (DAPO)
              times w_t = min(p_old / p_rollout, is_cap) (TIS, the default; or MIS, or none)
            + kl_coef * KL_t(policy || reference)                optional, off by default
                                                                 (kl_loss: k2 or k3)
    loss    = sum_t loss_t / (number of sampled tokens in the batch)    token-level aggregation

Simplifications:
    1. logp_old is the trainer's own log-prob before the first optimizer pass, so ratio = 1 at the
       first minibatch of the first pass; the rollout engine's log-probs drive the IS weights.
    2. A NaN or inf gradient skips the optimizer step on every rank; the step is counted as skipped.
    3. Data parallelism sums gradients with one all-reduce per optimizer step instead of wrapping
       the model in DDP: with dynamic sampling, ranks keep different numbers of groups, and DDP's
       hooks would hang on ranks that run fewer backward passes.
    4. The learning rate warms up linearly, then follows a cosine down to min_lr_ratio * lr.
    5. Unpacked, a micro-batch takes rows of about one length (the batch's rows sorted by length)
       and runs only up to its longest row; what is left is the padding within a micro-batch.
    6. share_prompt (on by default; dense models, unpacked): a micro-batch runs each distinct prompt
       once and then its rows' own tokens over the prompt's keys and values (PromptOnce), so a
       group of G rows computes its prompt once instead of G times; the gradients through the
       shared keys and values sum over the rows, as they would over G copies. A LoRA dropout mask
       on the prompt is then shared by the group's rows.
    7. The log-prob pass projects the scored positions onto the vocabulary `logp_chunk` at a time,
       and recomputes each chunk's logits in the backward (one more lm_head matmul) instead of
       keeping them: its memory stops growing with the positions past the chunk.
    8. Autocast (train.py's run.amp) is entered around each forward only; the backward and the
       optimizer step run outside it. Autocast keeps its bf16 copies of the weights until its
       outermost context exits: a forward in the context of an earlier step would see the weights
       before that step.
"""

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import flash_runs, repeat_kv
from moe import disagreement, replay_batch, replaying
from sparsity import alpha_sample, alpha_topk


# ------------------------------------------------------------------------ advantages, weights, loss


def group_advantages(rewards, G, eps=1e-6, norm="std"):
    """rewards (N,) with N = B * G, groups contiguous -> advantages (N,), keep (B,) groups with any
    spread. norm "std" divides by the group's std (GRPO); "none" keeps the plain difference from the
    group mean (Dr. GRPO: the std division weights nearly-solved and nearly-failed groups up)."""
    r = rewards.view(-1, G)
    std = r.std(-1, unbiased=False, keepdim=True)
    adv = r - r.mean(-1, keepdim=True)
    if norm == "std":
        adv = adv / (std + eps)
    elif norm != "none":
        raise ValueError(f"config key 'adv_norm' must be std or none, got {norm!r}")
    keep = std[:, 0] > 0
    return adv.view(-1), keep


def is_weights(old_logp, rollout_logp, mask, mode, cap=2.0, lo=0.5, hi=2.0):
    """Importance weights for the rollout/trainer mismatch (a sparse, low-precision or stale rollout
    policy): ratio = p_train / p_rollout per sampled token. "tis": min(ratio, cap) (truncated IS, as
    in TIS/FlashRL); "mis": ratio where lo <= ratio <= hi, else 0 (the token is dropped); "none": 1.
    Returns weights (N, T), detached, and stats: the fraction truncated or masked, and the
    per-sample acceptance rate alpha = min(1, ratio) of the sampled token (mean and 5th percentile):
    a diagnostic. Sparrow's statistic, the one thresholds apply to, is per position
    (sparsity.dense_alpha)."""
    ratio = torch.exp((old_logp - rollout_logp).clamp(max=20.0)) * mask
    m = mask.bool()
    alpha = alpha_sample(old_logp, rollout_logp)[m]
    stats = {"alpha_mean": alpha.mean().item() if m.any() else 1.0,
             "alpha_p5": alpha.quantile(0.05).item() if m.any() else 1.0}
    if mode == "tis":
        w = ratio.clamp(max=cap)
        stats["is_cut"] = ((ratio > cap) & m).sum().item()
    elif mode == "mis":
        keep = (ratio >= lo) & (ratio <= hi)
        w = torch.where(keep, ratio, 0.0)
        stats["is_cut"] = (~keep & m).sum().item()
    elif mode == "none":
        w, stats["is_cut"] = torch.ones_like(ratio), 0
    else:
        raise ValueError(f"config key 'is_correction' must be none, tis or mis, got {mode!r}")
    return (w * mask).detach(), stats


def pg_loss(logp, old_logp, adv, mask, clip_low, clip_high, ref_logp=None, kl_coef=0.0, is_w=None,
            kl_loss="k2"):
    """Per-token clipped surrogate. logp, old_logp, mask (N, T); adv (N,). Returns summed loss,
    stats. `is_w` (N, T) multiplies the policy term (IS correction). The caller divides by the
    number of sampled tokens (token-level aggregation).
    The KL term, on tokens sampled from the policy, with d = log ref - log policy:
        k2 = d^2 / 2        its expected gradient is the gradient of KL(policy || ref), the usual
                            penalty;
        k3 = e^d - d - 1    an unbiased, low-variance estimate of KL(policy || ref)'s VALUE, but as
                            a loss its expected gradient is that of KL(ref || policy), the reverse
                            direction."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    surr = torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    loss = -surr if is_w is None else -surr * is_w
    if kl_coef > 0:
        d = ref_logp - logp
        if kl_loss == "k2":
            loss = loss + kl_coef * 0.5 * d * d
        elif kl_loss == "k3":
            loss = loss + kl_coef * (torch.exp(d) - d - 1)
        else:
            raise ValueError(f"config key 'kl_loss' must be k2 or k3, got {kl_loss!r}")
    m = mask.float()
    clipped = ((ratio < 1 - clip_low) & (a < 0)) | ((ratio > 1 + clip_high) & (a > 0))
    return (loss * m).sum(), {"clipped": (clipped.float() * m).sum().item()}


def build_batch(prompts, completions, masks, pad_id):
    """Right-padded (B, T) ids of prompt + completion, and a target mask for completion positions,
    on the host. Position t of `tmask` marks that token t+1 is a sampled token, so logits[:, t]
    scores it."""
    seqs = [list(p) + c[m].tolist() for p, c, m in zip(prompts, completions, masks)]
    T = max(len(s) for s in seqs)
    # on the host on purpose: filled row by row here, copied to the device once (batch_from_groups)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long, device="cpu")
    tmask = torch.zeros(len(seqs), T, dtype=torch.bool, device="cpu")
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long, device="cpu")
        tmask[i, len(p) - 1:len(s) - 1] = True
    return ids, tmask


class PromptOnce:
    """A training forward's KV "cache" (the engine's protocol: positions, attend, advance) that runs
    a prompt shared by several rows once: first the distinct prompts (U, P), keeping each layer's
    keys and values with their gradients, then every row's own tokens (B, S), which attend to their
    prompt's first lens[rows] keys and causally to their own. rows (B,): each row's prompt."""

    def __init__(self, rows, lens):
        self.rows, self.lens, self.kv, self.own = rows, lens, {}, False

    def positions(self, T):
        start = self.lens[self.rows] if self.own else torch.zeros_like(self.lens)
        return start[:, None] + torch.arange(T, device=self.lens.device)

    def attend(self, layer, q, k, v):
        if not self.own:  # the prompts, right-padded: causal attention never sees the pads
            self.kv[layer] = (k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        kp, vp = self.kv[layer]
        B, T, P, dev = q.shape[0], q.shape[2], kp.shape[2], q.device
        seen = torch.arange(P, device=dev) < self.lens[self.rows][:, None]  # (B, P)
        mask = torch.cat([seen[:, None].expand(B, T, P),
                          torch.ones(T, T, dtype=torch.bool, device=dev).tril().expand(B, T, T)],
                         -1)[:, None]  # (B, 1, T, P + T)
        k, v = repeat_kv(torch.cat([kp[self.rows], k], 2), torch.cat([vp[self.rows], v], 2),
                         q.shape[1])  # with a mask, SDPA's GQA is the math kernel's alone
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def advance(self, T):
        self.own = True  # the prompts are in: the rows' own tokens come next


def split_prompts(ids, tmask, lens):
    """Rows as (distinct prompts, each row's own tokens), for PromptOnce: a row's prompt is its
    tokens before the last one ahead of its first target (that one is scored, so it goes with the
    row). -> None where no two rows share a prompt, else (prompt ids (U, P), their lengths (U,),
    each row's prompt (B,), own ids (B, S), own target mask (B, S), own targets (B, S))."""
    B, T = ids.shape
    first = tmask.int().argmax(1)  # the first target position = prompt length - 1
    keys = [tuple(ids[i, :first[i]].tolist()) for i in range(B)]
    distinct = list(dict.fromkeys(keys))
    if len(distinct) == B or min(map(len, distinct)) == 0:
        return None
    which = {key: u for u, key in enumerate(distinct)}
    plens = torch.tensor([len(key) for key in distinct], device=ids.device)
    prompts = torch.zeros(len(distinct), int(plens.max()), dtype=ids.dtype, device=ids.device)
    for u, key in enumerate(distinct):
        prompts[u, :len(key)] = torch.tensor(key, dtype=ids.dtype, device=ids.device)
    S = int((lens - first).max())
    at = first[:, None] + torch.arange(S, device=ids.device)  # (B, S) positions in the rows
    inside = at < lens[:, None]
    at = at.clamp(max=T - 1)
    targets = torch.roll(ids, -1, 1).gather(1, at)
    rows = torch.tensor([which[key] for key in keys], device=ids.device)
    return prompts, plens, rows, ids.gather(1, at), tmask.gather(1, at) & inside, targets


def project_logprobs(lm_head, h, tgt, temperature=1.0, chunk=1024, full=False):
    """Log-probs of the targets `tgt` (M,) from the final hidden states h (M, C), `chunk` positions
    per projection onto the vocabulary: the (chunk, V) logits are the largest tensor made, and with
    gradients each chunk's are recomputed in the backward (torch.utils.checkpoint: one more lm_head
    matmul) instead of kept, so memory does not grow with M past the chunk. -> lp (M,); with
    `full`, also the (M, V) log-softmax (kept: the caller asked for all of it)."""
    def proj(h, tgt):
        lsm = (lm_head(h).float() / temperature).log_softmax(-1)
        return lsm.gather(-1, tgt[:, None])[:, 0], lsm

    redo = torch.is_grad_enabled() and h.requires_grad and not full
    lps, lsms = [], []
    for a in range(0, max(1, h.shape[0]), chunk):  # one (empty) chunk when nothing is scored
        hc, tc = h[a:a + chunk], tgt[a:a + chunk]
        if redo:
            lps.append(checkpoint(lambda x, t: proj(x, t)[0], hc, tc, use_reentrant=False,
                                  preserve_rng_state=False))
        else:
            lp, lsm = proj(hc, tc)
            lps.append(lp)
            lsms += [lsm] if full else []
    lp = torch.cat(lps)
    return (lp, torch.cat(lsms)) if full else lp


def token_logprobs(model, ids, tmask, temperature=1.0, packed=False, full=False, routes=None,
                   aux=None, share_prompt=False, chunk=1024):
    """Log-prob of every target token: returns (B, T) with values where tmask is set (0 elsewhere).
    `packed` concatenates the rows without padding and attends within each (flash-attn varlen on
    CUDA). `share_prompt` runs a prompt that rows share once (PromptOnce; dense models, unpacked).
    `full` also returns the whole log-softmax at the target positions, (M, V) in the order of
    ids[tmask]. `routes` (B, T, MoE layers, k): the rollout's experts, replayed; `aux`: a list that
    gets each MoE layer's load-balancing loss (moe.replaying). Only the scored positions are
    projected onto the vocabulary, `chunk` at a time (project_logprobs)."""
    B, T = ids.shape
    targets = torch.roll(ids, -1, 1)
    lens = (tmask.flip(1).cumsum(1).flip(1) > 0).sum(1) + 1  # row length = last target + 2
    split = (split_prompts(ids, tmask, lens) if share_prompt and B > 1 and not packed
             and not model.config.num_experts else None)
    if split is not None:  # each distinct prompt once, then the rows' own tokens
        prompts, plens, rows, own, own_mask, own_targets = split
        cache = PromptOnce(rows, plens)
        model(prompts, cache=cache, hidden=True)
        h = model(own, cache=cache, hidden=True)  # (B, S, C)
        h_sel, tgt = h[own_mask], own_targets[own_mask]
    elif packed:
        flat = torch.cat([ids[i, :lens[i]] for i in range(B)])[None]
        pos = torch.cat([torch.arange(int(n), device=ids.device) for n in lens])[None]
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        rr = None if routes is None else torch.cat([routes[i, :lens[i]] for i in range(B)])[None]
        with replaying(model, rr, aux=aux):  # the same packing for the replayed experts
            h = model(flat, pos=pos, cu_seqlens=cu, max_seqlen=int(lens.max()), hidden=True)[0]
        sel = torch.cat([tmask[i, :lens[i]] for i in range(B)])
        h_sel, tgt = h[sel], torch.cat([targets[i, :lens[i]] for i in range(B)])[sel]
    else:  # the columns past the longest row are pads only: never computed
        t = int(lens.max()) if B else T  # CPU-GPU sync point
        real = torch.arange(t, device=ids.device) < lens[:, None]  # the balance loss skips pads
        with replaying(model, None if routes is None else routes[:, :t], real, aux):
            h = model(ids[:, :t], hidden=True)  # (B, t, C)
        h_sel, tgt = h[tmask[:, :t]], targets[:, :t][tmask[:, :t]]
    got = project_logprobs(model.lm_head, h_sel, tgt, temperature, chunk, full)
    lp, lsm = got if full else (got, None)
    out = torch.zeros(B, T, device=ids.device, dtype=lp.dtype)
    out[tmask] = lp
    return (out, lsm) if full else out


@torch.no_grad()
def replay_mismatch(model, prompt_ids, ro, temperature=1.0, micro_batch=16, pad_id=0):
    """Router replay's figures for a rollout of an MoE model (ro.experts), from two forwards of the
    trainer's `model` over every row: with its own routing ("own") and with the rollout's experts
    replayed ("replay"). Per forward: the routing disagreement with the rollout at the scored
    positions (moe_diff: share of the expert picks that differ; moe_diff_tok: share of tokens with
    a different set in at least one layer) and, when the engine kept its distributions
    (ro.topk_logp), the per-position mismatch: alpha = 1 - TV (mean, p5) and KL(rollout ||
    trainer), summed over the rollout's kept tokens (exact over a whole small vocabulary)."""
    ids, tmask = build_batch([prompt_ids[int(i)] for i in ro.prompt_index], ro.tokens, ro.mask,
                             pad_id)
    routes, out = replay_batch([ro.experts], [ro.mask], ids.shape), {}
    dev = model.lm_head.weight.device
    for name in ("own", "replay"):
        diff, alpha, kl = [], [], []
        # host rows on purpose: ids, tmask and routes are the host's; each part goes to dev
        for rows in torch.arange(len(ro), device="cpu").split(micro_batch):
            _, lsm = token_logprobs(model, ids[rows].to(dev), tmask[rows].to(dev), temperature,
                                    full=True, routes=routes[rows] if name == "replay" else None)
            diff.append((*disagreement(model, routes[rows], tmask[rows]), tmask[rows].sum()))
            if ro.topk_logp is not None:
                m = ro.mask[rows]  # the same positions as tmask's, in the same order
                q, qi = ro.topk_logp[rows][m].to(dev), ro.topk_ids[rows][m].to(dev)
                alpha.append(alpha_topk(q, qi, lsm).cpu())
                term = q.exp() * (q - lsm.gather(-1, qi))  # p_r log(p_r / p_t) per kept token
                kl.append(torch.where(q > float("-inf"), term, 0.0).sum(-1).cpu())
        n = sum(float(x[2]) for x in diff)
        sfx = "" if name == "own" else "_replay"
        out[f"moe_diff{sfx}"] = sum(x[0] * float(x[2]) for x in diff) / max(n, 1)
        out[f"moe_diff_tok{sfx}"] = sum(x[1] * float(x[2]) for x in diff) / max(n, 1)
        if alpha:
            a = torch.cat(alpha)
            out.update({f"alpha_{name}_mean": a.mean().item(),
                        f"alpha_{name}_p5": a.quantile(0.05).item(),
                        f"kl_{name}": torch.cat(kl).mean().item()})
    return out


class Group(NamedTuple):
    """One kept group of G rollouts of a prompt, as stages 1-3 hand it to the update."""
    prompt: int  # index of the prompt in the training pool
    tokens: torch.Tensor  # (G, T) completion ids
    mask: torch.Tensor  # (G, T) sampled tokens
    rewards: torch.Tensor  # (G,)
    logp: torch.Tensor  # (G, T) the rollout policy's log-probs of its tokens
    pages: torch.Tensor = None  # (G, T, sparse layers, H_kv, P) pages read (DistillSparse) or None
    cut: torch.Tensor = None  # (G,) bool: rows cut at max_new_tokens
    routes: object = None  # MoE: moe.Routes of these rows, or None


def batch_from_groups(kept, pool_ids, G, pad_id, adv_eps, dev, adv_norm="std", drop_rows=None):
    """Kept groups [Group] -> ids, tmask (N, T'), advantages (N,), and the rollout policy's log-probs at the
    trainer's target positions (N, T'), on `dev`. No groups: empty tensors, so that this rank still
    joins every collective of the update. `drop_rows` (N,) bool: rows that keep their place in the
    advantages but leave the loss (DAPO's overlong filtering of truncated completions)."""
    if not kept:
        return (torch.zeros(0, 1, dtype=torch.long, device=dev),
                torch.zeros(0, 1, dtype=torch.bool, device=dev),
                torch.zeros(0, device=dev), torch.zeros(0, 1, device=dev))
    p_ids = [pool_ids[k.prompt] for k in kept for _ in range(G)]
    ids, tmask = build_batch(p_ids, [row for k in kept for row in k.tokens],
                             [row for k in kept for row in k.mask],
                             pad_id)  # groups from different refill tries have different lengths
    adv = torch.cat([group_advantages(k.rewards, G, adv_eps, adv_norm)[0] for k in kept])
    roll = torch.zeros(tmask.shape, device="cpu")  # on the host on purpose, as ids: copied below
    roll[tmask] = torch.cat([lp[m] for k in kept for lp, m in zip(k.logp, k.mask)])
    if drop_rows is not None:
        # no token of theirs is trained on; the group's mean still counts them
        tmask[drop_rows] = False
    return ids.to(dev), tmask.to(dev), adv.to(dev), roll.to(dev)


def lr_at(cfg, step):
    """Linear warmup, then cosine down to min_lr_ratio * lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio
                     + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def allreduce_grads(model, world, group=None):
    """Sum gradients over ranks (data parallelism by hand). DDP's hooks would need every rank to run
    the same number of backward passes; with dynamic sampling the ranks keep different numbers of
    groups, so instead every rank runs its own micro-batches and joins exactly one all-reduce per
    optimizer step."""
    if world == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapter only
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p)


# ----------------------------------------------------------------------------- the optimizer passes


def micro_batches(rows, size, fsdp, device):
    """Row indices split into micro-batches. Under FSDP every rank must run as many forwards as the
    others (each one all-gathers weights), so the short ranks get empty micro-batches."""
    parts = list(rows.split(size)) if len(rows) else []
    if fsdp:
        n = torch.tensor([len(parts)], device=device)
        torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
        parts += [rows[:0]] * (int(n) - len(parts))
    return parts


@torch.no_grad()
def reference_logprobs(cfg, model, ids, tmask, packed, full=False, routes=None):
    """The no-grad log-probs of a whole batch, micro-batch by micro-batch: logp_old from the policy
    before its first update, or the reference policy's. `full` also returns the whole log-softmax at
    the target positions (DistillSparse trains toward it). `routes`: replayed MoE experts."""
    parts = [token_logprobs(model, ids[r], tmask[r], cfg.temperature, packed, full,
                            None if routes is None else routes[r], share_prompt=shares_prompt(cfg),
                            chunk=cfg.logp_chunk)
             for r in torch.arange(ids.shape[0], device=ids.device).split(cfg.micro_batch)]
    if not full:
        return torch.cat(parts) if parts else torch.zeros(0, ids.shape[1], device=ids.device)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def optimizer_step(cfg, model, opt, world, group, loss_ok=True, masked=None):
    """Sum the gradients over ranks, clip, and step; a NaN or inf loss or gradient norm on any rank
    skips the step on all of them. `masked` (sparsity.MaskedParams, N:M training): pruned entries
    get no gradient (nor a share of the norm) and stay exactly 0. Returns the gradient norm, or None
    when the step was skipped."""
    if not cfg.fsdp:  # FSDP reduce-scatters the gradients itself
        allreduce_grads(model, world, group)
    if masked is not None:
        masked.mask_grads()
    gn = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                        cfg.grad_clip)
    gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn  # a DTensor under FSDP
    bad = torch.tensor([0.0 if torch.isfinite(gn) and loss_ok else 1.0], device=gn.device)
    if world > 1:
        torch.distributed.all_reduce(bad, group=group)
    if bad.item() > 0:  # CPU-GPU sync point. NaN/inf anywhere: weights untouched on every rank
        opt.zero_grad(set_to_none=True)
        return None
    opt.step()
    if masked is not None:  # Adam's moments and weight decay would move a pruned weight otherwise
        masked.mask_weights()
    return gn


def old_logprobs(cfg, model, ids, tmask, packed, chunks, single, dense_dist, routes=None):
    """logp_old, the policy before this batch's first update, with its experts replayed from
    `routes` if given -> (old (N, T), the whole log-softmax at the targets when `dense_dist`).
    `single` (one optimizer step): zeros, which the training forward fills (its log-prob IS
    logp_old, ratio 1), so the no-grad pass would compute the same numbers again."""
    if dense_dist:  # DistillSparse also takes the whole dense distribution at these positions
        return reference_logprobs(cfg, model, ids, tmask, packed, full=True, routes=routes)
    if single:
        return torch.zeros(ids.shape, device=ids.device), None
    old = torch.zeros(ids.shape, device=ids.device)
    with torch.no_grad():  # every rank runs as many forwards (chunks, in any order of rows)
        for r in chunks(torch.arange(ids.shape[0], device=ids.device)):
            old[r] = token_logprobs(model, ids[r], tmask[r], cfg.temperature, packed,
                                    routes=None if routes is None else routes[r],
                                    share_prompt=shares_prompt(cfg), chunk=cfg.logp_chunk)
    return old, None


def balance_penalty(cfg, aux, tokens, log):
    """moe_aux_coef * the load-balancing loss (`aux`: each MoE layer's, from token_logprobs) as a
    per-token mean, weighted by the micro-batch's `tokens` like the summed policy loss; 0 without
    MoE layers or coefficient. Appends the loss's value to `log`."""
    if not aux:
        return 0.0
    aux = torch.stack(aux).mean()
    log.append(aux.item())
    return cfg.moe_aux_coef * aux * tokens


def shares_prompt(cfg):
    """Whether the training forwards run a shared prompt once (token_logprobs' share_prompt): not
    under FSDP, where every rank must run as many forwards (each one all-gathers the weights) and a
    micro-batch whose rows share a prompt runs two."""
    return cfg.share_prompt and not cfg.fsdp


def row_order(cfg, tmask):
    """The key that orders a batch's rows into micro-batches: by length, so that each micro-batch
    is about as long as its rows (token_logprobs trims the pads past its longest); with
    share_prompt a group's rows (G in a row) stay together, sorted by the group's longest, so that
    its prompt runs once. The loss is a sum over tokens, whatever their order."""
    key, (N, G) = tmask.flip(1).cumsum(1).flip(1).gt(0).sum(1), (tmask.shape[0], cfg.group_size)
    if shares_prompt(cfg) and N % G == 0:  # the group's longest, then the group
        group = torch.arange(N, device=tmask.device) // G
        key = key.view(-1, G).amax(1).repeat_interleave(G) * N + group
    return key


def packs(cfg, model, ids):
    """Whether the training forwards pack their rows (token_logprobs' `packed`): pack=on, or auto
    where flash-attn's varlen kernel runs (CUDA, half precision: autocast's or the weights').
    Without it, packing costs a dense (total x total) mask per forward (model.packed_causal_mask)."""
    half = torch.bfloat16 if cfg.autocast == "bfloat16" else model.lm_head.weight.dtype
    return cfg.pack == "on" or (cfg.pack == "auto" and flash_runs(ids.device, half))


def train_on(cfg, model, opt, ids, tmask, adv, world, rollout_logp=None, group=None, ref_model=None,
             dense_dist=False, masked=None, routes=None, amp=None):
    """`passes` x `minibatches` optimizer steps over one batch of kept rollouts (the same count on
    every rank, whatever its share of the batch). Token-level loss over the global minibatch.
    `rollout_logp` (N, T), the rollout policy's log-probs at the target positions, drives the IS
    correction and the mismatch statistics. `group` is the trainers' process group (None: every
    rank); `ref_model` the frozen reference (kl_coef > 0). `routes` (N, T, MoE layers, k): the
    rollout's experts (moe.replay_batch), replayed as cfg.router_replay says. `amp`: the autocast
    context (train.py's run.amp; None: none), entered afresh around the forwards only: autocast
    keeps its bf16 copies of the weights until its outermost context exits, so a forward in the
    context of an earlier optimizer step would see the weights before it. The caller must not hold
    it open. Returns {"stats": loss sum, tokens, clipped, skipped, grad norm (summed); this rank's
    mismatch figures; "_dense_full": the dense log-softmax at the targets when `dense_dist`}."""
    stats = torch.zeros(5, device=ids.device, dtype=torch.float64)
    ntok = tmask.sum().double()
    if world > 1:
        torch.distributed.all_reduce(ntok, group=group)
    if ntok.item() == 0:  # no rank kept a group: nothing to update (decided globally)
        return {"stats": stats}
    amp, packed, N = amp or contextlib.nullcontext(), packs(cfg, model, ids), ids.shape[0]
    key = row_order(cfg, tmask)  # on the device, as the row indices it sorts (ids.device)
    chunks = lambda rows: micro_batches(rows[key[rows].argsort(stable=True)], cfg.micro_batch,
                                        cfg.fsdp, ids.device)
    # router replay (MoE): the rollout's experts in logp_old's pass; "update": in training too
    r_new = routes if cfg.router_replay == "update" else None
    single = cfg.passes * cfg.minibatches == 1 and not dense_dist and cfg.router_replay != "logprob"
    with amp:  # no-grad forwards before any step: one context
        old, dense_full = old_logprobs(cfg, model, ids, tmask, packed, chunks, single, dense_dist,
                                       routes if cfg.router_replay != "off" else None)
        ref = reference_logprobs(cfg, ref_model, ids, tmask, packed) if cfg.kl_coef > 0 else None
    mode = cfg.is_correction if rollout_logp is not None else "none"
    weights = lambda o, rows: is_weights(o, o if rollout_logp is None else rollout_logp[rows],
                                         tmask[rows].float(), mode, cfg.is_cap, cfg.mis_low,
                                         cfg.mis_high)
    if not single:
        is_w, mis = weights(old, slice(None))
    mb_tokens = (ntok / cfg.minibatches).clamp(min=1)  # token-level mean over the global minibatch
    aux_sum = []  # the load-balancing loss of each training forward (moe_aux_coef > 0)
    model.train()  # dropout (LoRA's) only here: rollouts, logp_old and evaluation run in eval mode
    for _ in range(cfg.passes):
        for k in range(cfg.minibatches):
            opt.zero_grad(set_to_none=True)
            loss_ok = True
            # the micro-batches may be none, or empty, on this rank
            for micro in chunks(torch.arange(k, N, cfg.minibatches, device=ids.device)):
                aux = [] if cfg.moe_aux_coef > 0 else None  # MoE: the load-balancing loss
                with amp:  # the forward only: the backward and the step run outside it
                    lp = token_logprobs(model, ids[micro], tmask[micro], cfg.temperature, packed,
                                        routes=None if r_new is None else r_new[micro], aux=aux,
                                        share_prompt=shares_prompt(cfg), chunk=cfg.logp_chunk)
                if single:
                    old[micro] = lp.detach()
                w = weights(old[micro], micro)[0] if single else is_w[micro]
                loss, s = pg_loss(lp, old[micro], adv[micro], tmask[micro], cfg.clip_low,
                                  cfg.clip_high, None if ref is None else ref[micro], cfg.kl_coef,
                                  w, cfg.kl_loss)
                loss = loss + balance_penalty(cfg, aux, tmask[micro].sum(), aux_sum)
                # FSDP averages over ranks: undo it
                (loss * (world if cfg.fsdp else 1) / mb_tokens).backward()
                # an inf loss can still give a finite gradient
                loss_ok &= bool(torch.isfinite(loss))
                stats[0] += loss.item()
                stats[2] += s["clipped"]
            gn = optimizer_step(cfg, model, opt, world, group, loss_ok, masked)
            if gn is None:
                stats[3] += 1
            else:
                stats[4] += gn.item()
    model.eval()
    if single:  # the mismatch figures, now that every row's logp_old is known
        _, mis = weights(old, slice(None))
    taken = cfg.passes * cfg.minibatches - stats[3]
    stats[4] = stats[4] / taken.clamp(min=1)  # the mean grad norm of the steps taken, not their sum
    stats[1] = tmask.sum() * cfg.passes
    out = {"stats": stats, "sample_alpha_mean": mis["alpha_mean"],
           "sample_alpha_p5": mis["alpha_p5"], "is_cut": mis["is_cut"] / max(1, int(tmask.sum()))}
    if dense_dist:
        out["_dense_full"] = dense_full
    out.update({"moe_aux": sum(aux_sum) / len(aux_sum)} if aux_sum else {})
    return out
