"""
roi.py: stage 4's N:M masks, learned (RoI, "Reservoir of Importance") or one-shot, for a saved
model; and the comparison of the mask methods on a small model that the project trains itself.

    python roi.py learn MODEL_DIR --nm=2:4 --steps=300 --out=OUT_DIR  # RoI, distilled from dense
    python roi.py apply MODEL_DIR --nm=2:4 --scores=wanda --out=OUT_DIR  # one-shot mask
    python roi.py compare --write-results  # RESULTS.md: 3 seeds, 30, 150 steps (--seeds, --steps)

MODEL_DIR is a Hugging Face folder (model.Transformer.from_pretrained) with its tokenizer; OUT_DIR
gets the masked model (save_pretrained: pruned weights stored as zeros), the tokenizer, nm.json and
masks.pt (the bool masks by weight name: `python train.py --rollout_copy=nm2:4
--rollout_copy_mask=OUT_DIR` runs a rollout copy under them); both record the mask's task. The
data: problems of the task MODEL_DIR was trained on and their reference traces (prompt + trace +
EOS), as the folder records it (checkpoint.trained_config: a checkpoint's trainer_state.pt, a warm
start's sft_key.json, roi.py's nm.json), else --config=FILE's (else configs/sharpen.py's, said in
the log); a --config of another task or order than the record's is refused. Tasks with a reference
trace only: the synthetic task (any order) and reasoning_gym:chain_sum.

How RoI learns a mask (a group is m consecutive inputs of one output row, as in sparsity.nm_mask):
    1. The model's weights are frozen; every prunable Linear (sparsity.NM_SKIP: not the head, the
       embeddings or the MoE router) gets m logits phi per group.
    2. Each training forward samples a soft mask per group by relaxed top-k (sampling without
       replacement): kappa = phi / lambda + Gumbel noise; alpha_1 = kappa; for k = 1..n:
       mu_k = softmax(alpha_k / tau), alpha_{k+1} = alpha_k + log(1 - mu_k). The soft mask is
       sum_k mu_k (n in total per group); the layer computes with W * soft mask.
    3. tau decays from 1.0 to 0.05 and lambda from 1.0 to 0.002, exponentially over the first 75%
       of the steps, then holds.
    4. The loss: KL(dense || masked) on the completion tokens (--loss=kd; the teacher is the same
       layers with their masks off) or the next-token loss on them (--loss=lm). Adam on phi.
    5. The final mask keeps the n largest logits of each group; it is baked into the weights.

Simplifications:
    1. phi starts at init_scale * score / (mean score of its group), the score being magnitude or
       Wanda (--init): the first samples are near the one-shot mask (RoI's paper gives no init).
    2. The soft mask in the forward, never straight-through (RoI's authors found straight-through
       worse); one Gumbel draw per forward, shared by the batch.
    3. Data: the model's task (above; any tokenizer works): training problems from seed + 30,000,
       Wanda's 128 calibration problems from seed + 40,000, both without the held-out prompts
       (tasks.load_problems' held-out set, the RL loop's).
    4. Masked dense: the zeros are stored, so the masked model is no faster without a 2:4 kernel.
    5. compare: configs/sharpen.py's warm start, a clean teacher (sft_noise 0), --sft_steps 1,200
       (600 left seed 2's stuck), one per seed with its own data and held-out set; mean and sd over
       the seeds whose dense model learned the task. Held-out perplexity of the reference
       completions, greedy accuracy. SR-STE and RoI: the same steps, batch and loss (KL to dense).

Tests: `python -m pytest -q tests/test_nm.py tests/test_newcomer_tasks.py`.
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import time
from statistics import mean, stdev

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoTokenizer

from checkpoint import trained_config
from config import RG_PREFIX, TEACHER_TASKS, cli, parse_config
from model import Transformer, swap_module
from report import hardware, write_block
from reward import score
from rollout import Engine
from sparsity import NM_SKIP, SRSTE, apply_nm, nm_linears, nm_mask, wanda_scores
from tasks import (CHARS, format_prompt, load_problems, make_reasoning_gym, make_synthetic,
                   rg_width, synthetic_trace)
from warmstart import build_policy, chain_sum_trace

TRAIN_SEED, CALIB_SEED = 30_000, 40_000  # offsets from the run's seed: data of their own
CALIB_PROBLEMS = 128  # Wanda's calibration set: as many sequences as Wanda's 128


# ----------------------------------------------------------------------------- data and losses


def trace_batches(tok, problems, batch):
    """Problems -> [(ids, tmask, valid)] right-padded (B, T) batches of prompt + reference trace +
    EOS. tmask marks the positions whose next token is a completion token (as update.build_batch
    does), valid the real tokens."""
    out = []
    for a in range(0, len(problems), batch):
        chunk = problems[a:a + batch]
        prompts = [tok.encode(format_prompt(tok, p, True), add_special_tokens=False)
                   for p in chunk]
        comps = [tok.encode(chain_sum_trace(p) if p.task == "reasoning_gym" else synthetic_trace(p),
                            add_special_tokens=False) + [tok.eos_token_id] for p in chunk]
        T = max(len(p) + len(c) for p, c in zip(prompts, comps))
        ids = torch.full((len(chunk), T), tok.pad_token_id, dtype=torch.long)
        tmask = torch.zeros(len(chunk), T, dtype=torch.bool)
        valid = torch.zeros(len(chunk), T, dtype=torch.bool)
        for i, (p, c) in enumerate(zip(prompts, comps)):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c)
            tmask[i, len(p) - 1:len(p) + len(c) - 1] = True
            valid[i, :len(p) + len(c)] = True
        out.append((ids, tmask, valid))
    return out


def completion_logits(model, ids, tmask):
    """(M, V) fp32 logits at the tmask positions, and their (M,) target tokens; only those
    positions are projected onto the vocabulary."""
    dev = model.lm_head.weight.device
    ids, tmask = ids.to(dev), tmask.to(dev)
    h = model(ids, hidden=True)
    return model.lm_head(h[tmask]).float(), torch.roll(ids, -1, 1)[tmask]


def kd_loss(logits, teacher_logits):
    """KL(teacher || student) per scored token, averaged: the student matches the dense model's
    whole distribution, not just its top token."""
    return F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits, -1),
                    log_target=True, reduction="batchmean")


def train_loss(model, ids, tmask, loss, teacher):
    """--loss=lm: next-token NLL of the completion; --loss=kd: KL to teacher(), a callable that
    returns the dense logits at the same positions."""
    logits, tgt = completion_logits(model, ids, tmask)
    if loss == "lm":
        return F.cross_entropy(logits, tgt)
    with torch.no_grad():
        t_logits, _ = teacher()
    return kd_loss(logits, t_logits)


# ----------------------------------------------------------------------------- RoI


def anneal(step, steps, start, end, frac=0.75):
    """Exponential from `start` to `end` over the first `frac` of `steps`, then `end`."""
    t = min(1.0, step / max(1.0, frac * steps))
    return start * (end / start) ** t


def relaxed_topk(logits, n, tau, lam, noise=True):
    """logits (..., m) -> soft mask (..., m): n rounds of relaxed top-k (module docstring, step
    2); each round's softmax sums to 1, so a group's soft mask sums to n. log(1 - mu_i) is taken
    as logsumexp_{j != i}(alpha_j / tau) - logsumexp_j(alpha_j / tau), the same number without
    the rounding of 1 - mu to 0: late in the schedule alpha / tau reaches 1e4 and mu is exactly 1
    in float32, and a clamped log(1 - mu) (-87 at most) would let the top entry win every round.
    Below tau = 1 it is a relaxation: an entry far ahead of the others can still be taken twice
    (a soft value near 2); the final mask is the top n of the logits all the same."""
    kappa = logits / lam
    if noise:  # -log(E), E ~ Exp(1), is Gumbel(0, 1)
        kappa = kappa - torch.empty_like(logits).exponential_().log()
    m = logits.shape[-1]
    others = torch.eye(m, dtype=torch.bool, device=logits.device)  # row i: every j but i
    alpha, soft = kappa, torch.zeros_like(logits)
    for k in range(n):
        z = alpha / tau
        lse = z.logsumexp(-1, keepdim=True)
        soft = soft + (z - lse).exp()
        if k < n - 1:  # (..., m, m) -> (..., m): log(1 - mu) for every entry at once
            alpha = alpha + z.unsqueeze(-2).masked_fill(others, float("-inf")).logsumexp(-1) - lse
    return soft


class RoILinear(nn.Module):
    """A Linear with frozen weight and bias (the wrapped Linear's own Parameters) and m logits per
    group. Training mode samples a soft mask (relaxed_topk at the layer's tau and lam); eval mode
    uses the hard mask (top n logits); `masked = False` gives the dense output (the KD teacher)."""

    def __init__(self, linear, n, m, scores, init_scale):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.n, self.m, self.tau, self.lam, self.masked = n, m, 1.0, 1.0, True
        self.weight, self.bias = linear.weight, linear.bias
        nm_mask(linear.weight, n, m)  # the shape checks, with their messages
        s = scores.detach().float().reshape(self.out_features, -1, m)
        self.logits = nn.Parameter(init_scale * s / s.mean(-1, keepdim=True).clamp_min(1e-12))

    def hard_mask(self):
        """(out, in) bool: the n largest logits of every group (not the largest |logit|, nm_mask's
        default: a logit that training drove far below 0 is the one most surely pruned)."""
        phi = self.logits.detach().reshape(self.weight.shape)
        return nm_mask(phi, self.n, self.m, scores=phi)

    def forward(self, x):
        if not self.masked:
            return F.linear(x, self.weight, self.bias)
        if self.training:
            mask = relaxed_topk(self.logits, self.n, self.tau, self.lam).reshape(self.weight.shape)
        else:
            mask = self.hard_mask()
        return F.linear(x, self.weight * mask.to(self.weight.dtype), self.bias)


class RoI:
    """RoI on a whole model, in place: every prunable Linear becomes a RoILinear and every
    parameter of the model is frozen.

        roi = RoI(model, 2, 4, scores=wanda_scores(model, batches))   # None: magnitude
        opt = torch.optim.Adam(roi.parameters(), lr=0.05)
        roi.set_schedule(tau, lam); loss.backward(); opt.step()
        with roi.dense(): teacher_logits = model(ids)
        masks = roi.remove()   # plain Linears, pruned weights zeroed, requires_grad restored
    """

    def __init__(self, model, n, m, scores=None, init_scale=2.0, skip=NM_SKIP):
        self.model = getattr(model, "module", model)
        self.grad_flags = {p: p.requires_grad for p in self.model.parameters()}
        self.linears, self.layers = nm_linears(self.model, skip), {}
        for wname, lin in self.linears.items():
            s = lin.weight.abs() if scores is None else scores[wname]
            try:
                self.layers[wname] = RoILinear(lin, n, m, s, init_scale)
            except ValueError as e:
                raise ValueError(f"RoI: layer {wname[:-len('.weight')]}: {e}") from None
        for p in self.model.parameters():
            p.requires_grad_(False)
        for wname, layer in self.layers.items():
            swap_module(self.model, wname[:-len(".weight")], layer)

    def parameters(self):
        return [layer.logits for layer in self.layers.values()]

    def set_schedule(self, tau, lam):
        for layer in self.layers.values():
            layer.tau, layer.lam = tau, lam

    @contextlib.contextmanager
    def dense(self):
        """The unmasked model inside the block (a teacher that costs no second copy)."""
        for layer in self.layers.values():
            layer.masked = False
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.masked = True

    @torch.no_grad()
    def remove(self):
        """Bake the hard masks into the weights, put the nn.Linear modules back -> masks."""
        masks = {}
        for wname, layer in self.layers.items():
            masks[wname] = layer.hard_mask()
            layer.weight.masked_fill_(~masks[wname], 0)
            swap_module(self.model, wname[:-len(".weight")], self.linears[wname])
        for p, flag in self.grad_flags.items():
            p.requires_grad_(flag)
        return masks


# ----------------------------------------------------------------------------- the methods


def synthetic_problems(cfg, n, offset, exclude=frozenset()):
    """n synthetic problems (cfg's difficulty and order) from seed cfg.seed + offset, none with a
    prompt in `exclude` (the held-out prompts: training and calibration never see them)."""
    drawn = make_synthetic(2 * n + 100, cfg.seed + offset, cfg.difficulty, cfg.order)
    out = [p for p in drawn if p.prompt not in exclude][:n]
    if len(out) < n:
        raise ValueError(f"only {len(out)} of {n} synthetic problems are not held out")
    return out


def task_problems(cfg, n, offset, exclude=frozenset()):
    """synthetic_problems, or reasoning-gym items of cfg's task (the tiny model's characters only
    where cfg has no model) from seed cfg.seed + offset."""
    if not cfg.task.startswith(RG_PREFIX):
        return synthetic_problems(cfg, n, offset, exclude)
    drawn = make_reasoning_gym(cfg.task[len(RG_PREFIX):], 2 * n + 100, cfg.seed + offset,
                               cfg.rg_kwargs, None if cfg.model else CHARS, cfg.rg_prompt,
                               rg_width(cfg))
    out = [p for p in drawn if p.prompt not in exclude][:n]
    if len(out) < n:
        raise ValueError(f"only {len(out)} of {n} {cfg.task} problems are not held out")
    return out


def calib_scores(model, tok, kind, problems):
    """None for magnitude (nm_mask's default), or Wanda's scores over the problems' traces."""
    if kind == "magnitude":
        return None
    if kind != "wanda":
        raise ValueError(f"scores must be 'magnitude' or 'wanda', got {kind!r}")
    return wanda_scores(model, [(ids, valid) for ids, _, valid in trace_batches(tok, problems, 16)])


def learn_roi(model, tok, n, m, problems, batch=16, lr=0.05, loss="kd", scores=None,
              init_scale=2.0, seed=0, log=print):
    """RoI masks for `model`, one step per `batch` of the training problems, logits initialised
    from `scores` (None: magnitude); the model is left N:M (masks baked) -> masks."""
    torch.manual_seed(seed)
    data = trace_batches(tok, problems, batch)
    roi = RoI(model, n, m, scores, init_scale)
    opt = torch.optim.Adam(roi.parameters(), lr=lr)
    model.train()
    for step, (ids, tmask, _) in enumerate(data):
        roi.set_schedule(anneal(step, len(data), 1.0, 0.05), anneal(step, len(data), 1.0, 0.002))

        def teacher():
            with roi.dense():
                return completion_logits(model, ids, tmask)

        loss_v = train_loss(model, ids, tmask, loss, teacher)
        opt.zero_grad(set_to_none=True)
        loss_v.backward()
        opt.step()
        if step % 100 == 0 or step == len(data) - 1:
            log(f"roi {n}:{m} step {step}: {loss} loss {loss_v.item():.4f}")
    model.eval()
    return roi.remove()


def finetune_srste(model, tok, n, m, problems, batch=16, lr=3e-4, loss="kd", decay=2e-4,
                   every=1, seed=0, log=print):
    """SR-STE fine-tuning of every weight, one step per `batch` of the training problems; the
    model is left N:M -> masks. The KD teacher is a frozen copy of the dense model."""
    torch.manual_seed(seed)
    data = trace_batches(tok, problems, batch)
    dense = copy.deepcopy(model).eval() if loss == "kd" else None
    sr = SRSTE(model, n, m, decay=decay, every=every)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    for step, (ids, tmask, _) in enumerate(data):
        loss_v = train_loss(model, ids, tmask, loss, lambda: completion_logits(dense, ids, tmask))
        opt.zero_grad(set_to_none=True)
        loss_v.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sr.step()
        if step % 100 == 0 or step == len(data) - 1:
            log(f"sr-ste {n}:{m} step {step}: {loss} loss {loss_v.item():.4f}")
    model.eval()
    return sr.remove()


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def perplexity(model, batches):
    """exp(mean NLL) of the completion tokens (reference trace + EOS) given the prompt."""
    nll, count = 0.0, 0
    for ids, tmask, _ in batches:
        logits, tgt = completion_logits(model, ids, tmask)
        nll += F.cross_entropy(logits, tgt, reduction="sum").item()
        count += tgt.numel()
    return math.exp(nll / count)


@torch.no_grad()
def greedy_accuracy(model, tok, problems, max_new_tokens=64):
    """The share of problems whose greedy completion reward.score rates 1."""
    engine = Engine(model.eval(), tok, max_new_tokens, 0.0, 1.0)
    ids = [tok.encode(format_prompt(tok, p, True), add_special_tokens=False) for p in problems]
    texts = []
    for a in range(0, len(ids), 256):
        texts += engine.generate(ids[a:a + 256], 1, seed=0).texts
    return sum(score(problems, texts)) / len(problems)


def check_nm(model, masks, n, m):
    """The masked model really is N:M: every mask keeps n of each m and the weights are zero
    elsewhere (a comparison row must not be a dense model by mistake)."""
    lin = nm_linears(model)
    for k, mask in masks.items():
        groups = mask.reshape(mask.shape[0], -1, m).sum(-1)
        if not (groups == n).all() or lin[k].weight[~mask].any():
            raise AssertionError(f"{k} is not {n}:{m} sparse")


# ----------------------------------------------------------------------------- the comparison

METHODS = ("magnitude", "wanda", "sr-ste", "roi")
MIN_DENSE_ACC = 0.5  # a seed whose dense warm start scores below this is left out of the table


def mask_with(method, model, tok, n, m, args, data, log):
    """One comparison row's mask: the model is left N:M -> masks. data: {"calib", "train"}."""
    kind = {"magnitude": "magnitude", "wanda": "wanda", "roi": args.init}.get(method)
    scores = calib_scores(model, tok, kind, data["calib"]) if kind else None  # SR-STE: none
    if method in ("magnitude", "wanda"):
        return apply_nm(model, n, m, scores=scores)
    kw = dict(batch=args.batch, loss=args.loss, seed=args.seed, log=log)
    if method == "sr-ste":
        return finetune_srste(model, tok, n, m, data["train"], lr=args.srste_lr, **kw)
    return learn_roi(model, tok, n, m, data["train"], lr=args.roi_lr, scores=scores, **kw)


def compare(args, log=print):
    """For each --seeds seed: dense, then magnitude and Wanda (one-shot) and SR-STE and RoI at each
    --steps, at each --nm, on configs/sharpen.py's warm start of that seed (a clean teacher),
    scored on its held-out problems -> rows; writes out_dir/compare.json and .md."""
    rows = [r for seed in args.seeds for r in compare_seed(args, seed, log)]
    with open(os.path.join(args.out_dir, "compare.json"), "w") as f:
        json.dump(dict(rows=rows, args={k: v for k, v in vars(args).items() if k != "func"},
                       hardware=hardware(gpu=torch.cuda.is_available())), f, indent=1)
    text = "\n\n".join(compare_table(rows, "python roi.py " + " ".join(sys.argv[1:])))
    with open(os.path.join(args.out_dir, "compare.md"), "w") as f:
        f.write(text + "\n")
    log(text)
    if args.write_results:
        write_block("roi", text)
    return rows


def compare_table(rows, cmd):
    """(head, table) over the seeds whose dense model learned the task: a seed whose warm start
    is below MIN_DENSE_ACC held-out accuracy is named in the head and left out (every mask ties a
    broken model there, which says nothing about the masks)."""
    acc = {r["seed"]: r["acc"] for r in rows if r["method"] == "dense"}
    bad = sorted(s for s, a in acc.items() if a < MIN_DENSE_ACC)
    good = [r for r in rows if r["seed"] not in bad]
    head = (f"Hardware: {hardware(gpu=torch.cuda.is_available())}. Command: `{cmd}`. Seeds "
            f"{', '.join(str(s) for s in sorted(acc) if s not in bad)} (each its own warm start "
            f"and held-out set); mean and sd over them." + (" Left out: seed " + ", ".join(
                f"{s} (dense held-out accuracy {acc[s]:.3f})" for s in bad) + ", whose warm start "
                f"did not learn the task (below {MIN_DENSE_ACC})." if bad else ""))
    return head, results_table(good) if good else "(no seed's warm start learned the task)"


def compare_seed(args, seed, log):
    """One seed's rows: dense, and each (n:m, method, steps)."""
    cfg = parse_config(["configs/sharpen.py", f"--out_dir={args.out_dir}", "--sft_noise=0.0",
                        f"--seed={seed}", f"--n_eval={args.n_eval}",
                        f"--sft_steps={args.sft_steps}"])
    dense, tok = build_policy(cfg, "cpu", log)
    _, problems = load_problems(cfg)
    held, seen = trace_batches(tok, problems, 64), {p.prompt for p in problems}
    data = dict(calib=synthetic_problems(cfg, CALIB_PROBLEMS, CALIB_SEED, seen),
                train=synthetic_problems(cfg, max(args.steps) * args.batch, TRAIN_SEED, seen))
    kw = dict(vars(args), seed=seed)

    def row(nm, method, steps, model, secs):
        r = dict(seed=seed, nm=nm, method=method, steps=steps, ppl=perplexity(model, held),
                 acc=greedy_accuracy(model, tok, problems, cfg.max_new_tokens), secs=secs)
        log(f"seed {seed}, {nm} {method} ({steps} steps): perplexity {r['ppl']:.4f}, accuracy "
            f"{r['acc']:.3f}, mask {secs:.0f} s")
        return r

    rows = [row("dense", "dense", 0, dense.eval(), 0.0)]
    for n, m in args.nm:
        for method in METHODS:
            for steps in ([0] if method in ("magnitude", "wanda") else args.steps):
                model = copy.deepcopy(dense)
                part = dict(data, train=data["train"][:steps * args.batch])
                t0 = time.perf_counter()
                masks = mask_with(method, model, tok, n, m, argparse.Namespace(**kw), part, log)
                secs = time.perf_counter() - t0
                check_nm(model, masks, n, m)
                rows.append(row(f"{n}:{m}", method, steps, model, secs))
    return rows


def results_table(rows):
    """Markdown: one row per (sparsity, method, steps), mean and sd over the seeds. The traces are
    nearly determined by their prompt, so perplexities sit near 1: the NLL per token (its log)
    shows the differences better."""
    ms = lambda xs, f: f"{mean(xs):{f}} ± {stdev(xs) if len(xs) > 1 else 0.0:{f.lstrip('+')}}"
    keys = list(dict.fromkeys((r["nm"], r["method"], r["steps"]) for r in rows))
    by = {k: [r for r in rows if (r["nm"], r["method"], r["steps"]) == k] for k in keys}
    dense = {r["seed"]: r["acc"] for r in by[keys[0]]}
    lines = ["| sparsity | method | training steps (of --batch traces) | seeds | held-out NLL, "
             "nats/token | greedy accuracy | vs dense (same seed) | mask time |",
             "|---|---|---|---|---|---|---|---|"]
    for (nm, method, steps), rs in by.items():
        gap = "" if (nm, method, steps) == keys[0] else ms(
            [r["acc"] - dense[r["seed"]] for r in rs], "+.3f")
        how = "" if nm == "dense" else ("one-shot" if method in ("magnitude", "wanda") else steps)
        lines.append(f"| {nm} | {method} | {how} | {len(rs)} | "
                     f"{ms([math.log(r['ppl']) for r in rs], '.4f')} | "
                     f"{ms([r['acc'] for r in rs], '.3f')} | {gap} | "
                     f"{sum(r['secs'] for r in rs) / len(rs):.0f} s |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the CLI


def parse_nm(text):
    """'2:4' -> (2, 4); a comma list '2:4,2:8' -> [(2, 4), (2, 8)] through parse_nm_list."""
    try:
        n, m = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nm wants N:M, e.g. 2:4, got {text!r}") from None
    if not 0 < n <= m:
        raise argparse.ArgumentTypeError(f"--nm wants 0 < N <= M, got {text!r}")
    return n, m


def parse_nm_list(text):
    return [parse_nm(t) for t in text.split(",")]


def load_model(model_dir, device):
    """A saved model and its tokenizer (a pad token borrowed from EOS when it has none)."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir} is not a model folder")
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return Transformer.from_pretrained(model_dir, device=device).eval(), tok


# what a saved model's record sets of the data; SAME_TASK: where a --config must agree with it
DATA_KEYS = ("task", "order", "difficulty", "eval_difficulty", "rg_kwargs", "eval_rg_kwargs",
             "sft_rg_kwargs", "rg_prompt", "data", "model", "n_train", "sft_difficulty",
             "sft_steps", "sft_batch", "sft_seed")
SAME_TASK = ("task", "order")


def task_config(args, log=print):
    """The config that mask_saved draws its data from: MODEL_DIR's record (trained_config) over
    --config or configs/sharpen.py; a --config of another task or order than the record's is
    refused, and so is a task without reference traces."""
    base = parse_config([args.config or "configs/sharpen.py", f"--seed={args.seed}",
                         f"--n_eval={max(args.eval, 1)}"])
    rec, where = trained_config(args.model_dir)
    said = lambda c: ", ".join(f"{k} {c.get(k, getattr(base, k))}" for k in SAME_TASK)
    if rec and args.config and said(rec) != said({}):
        raise ValueError(f"{args.model_dir} was trained on {said(rec)} ({where}) but --config "
                         f"{args.config} is {said({})}: a mask fitted on other data than the "
                         f"model's; leave --config out to use the model's")
    if rec and not args.config:
        tup = lambda k, v: tuple(v) if isinstance(getattr(base, k), tuple) else v
        base = dataclasses.replace(base, **{k: tup(k, v) for k, v in rec.items() if k in DATA_KEYS})
    if not rec and not args.config:
        log(f"{args.model_dir} records no task (no trainer_state.pt, sft_key.json or roi.py's "
            f"nm.json): drawing configs/sharpen.py's; --config=FILE names the model's")
    rg = base.task.startswith(RG_PREFIX) and base.task[len(RG_PREFIX):] in TEACHER_TASKS
    if base.task != "synthetic" and not rg:
        raise ValueError(f"roi.py {args.cmd}: {args.model_dir} is for task {base.task}, which has "
                         f"no reference traces to fit a mask on (the synthetic task and "
                         f"reasoning_gym:chain_sum have)")
    log(f"data: {said({})}, difficulty {base.difficulty}, from "
        + (args.config or (where if rec else "configs/sharpen.py")))
    return base


def mask_saved(args, log=print):
    """`learn` and `apply`: mask MODEL_DIR's model and write it, with its tokenizer and nm.json
    (n, m, method, the task's config keys), to --out. Perplexity before and after on --eval
    held-out problems of the model's task (task_config)."""
    cfg = task_config(args, log)
    model, tok = load_model(args.model_dir, args.device)
    (n, m), problems = args.nm, load_problems(cfg)[1]
    held, seen = trace_batches(tok, problems[:args.eval], 32), {p.prompt for p in problems}
    before = perplexity(model, held) if held else None
    kind = args.init if args.cmd == "learn" else args.scores
    scores = calib_scores(model, tok, kind, task_problems(cfg, CALIB_PROBLEMS, CALIB_SEED, seen))
    if args.cmd == "learn":
        train = task_problems(cfg, args.steps * args.batch, TRAIN_SEED, seen)
        masks = learn_roi(model, tok, n, m, train, args.batch, args.lr, args.loss, scores,
                          args.init_scale, args.seed, log)
        method = f"roi (init {args.init}, {args.loss}, {args.steps} steps)"
    else:
        masks, method = apply_nm(model, n, m, scores=scores), args.scores
    check_nm(model, masks, n, m)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    task = {k: getattr(cfg, k) for k in DATA_KEYS}
    with open(os.path.join(args.out, "nm.json"), "w") as f:
        json.dump(dict(n=n, m=m, method=method, layers=sorted(masks), config=task), f, indent=1)
    # the masks themselves, for a rollout copy of another model of this shape (copies.load_masks)
    torch.save(dict(n=n, m=m, method=method, masks={k: v.cpu() for k, v in masks.items()},
                    task={k: str(task[k]) for k in SAME_TASK}), os.path.join(args.out, "masks.pt"))
    kept = sum(int(k.sum()) for k in masks.values()) / sum(k.numel() for k in masks.values())
    ppl = f"; held-out perplexity {before:.4f} -> {perplexity(model, held):.4f}" if held else ""
    log(f"wrote {args.out}: {method}, {n}:{m} on {len(masks)} Linear ({kept:.3f} of their "
        f"weights kept){ppl}")


def parse_ints(text):
    """"30,150" -> [30, 150] (each >= 0)."""
    if not all(x.strip().isdigit() for x in text.split(",")):
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 0, got {text!r}")
    return [int(x) for x in text.split(",")]


ROI_HELP = {"learn": "learn an N:M mask by RoI (distilled from the dense model); write the model",
            "apply": "a one-shot N:M mask (magnitude or Wanda scores); write the model",
            "compare": "the mask methods side by side, 3 seeds (bench/RESULTS.md's roi block)"}


def build_parser():
    p = argparse.ArgumentParser(prog="roi.py", description="N:M masks, learned (RoI) or one-shot, "
                                "for a saved model. `roi.py COMMAND --help`: its flags")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    learn, apply_, c = (sub.add_parser(k, help=v, description=v) for k, v in ROI_HELP.items())
    for s in (learn, apply_):
        s.add_argument("model_dir", help="a Hugging Face folder with its tokenizer")
        s.add_argument("--nm", type=parse_nm, required=True, help="the pattern, e.g. 2:4")
        s.add_argument("--out", required=True, help="folder for the masked model and masks.pt")
        s.add_argument("--device", default="cpu", help="cpu or cuda")
        s.add_argument("--seed", type=int, default=0, help="seeds the data and the sampling")
        s.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
        s.add_argument("--eval", type=int, default=100, help="held-out problems (0: no eval)")
        s.add_argument("--config", default="", help="the config file of the model's task, where "
                       "MODEL_DIR records none (a recorded one must agree with it)")
    learn.add_argument("--steps", type=int, default=300, help="steps of training the logits")
    learn.add_argument("--batch", type=int, default=16, help="traces a step")
    learn.add_argument("--lr", type=float, default=0.05, help="Adam's rate on the logits")
    learn.add_argument("--loss", choices=("kd", "lm"), default="kd",
                       help="kd: KL to the dense model; lm: the next-token loss")
    learn.add_argument("--init", choices=("magnitude", "wanda"), default="wanda",
                       help="the score the logits start from")
    learn.add_argument("--init_scale", type=float, default=2.0, help="the start logits' scale")
    apply_.add_argument("--scores", choices=("magnitude", "wanda"), default="magnitude",
                        help="the score whose N largest of each M the mask keeps")
    c.add_argument("--out_dir", default="out/roi", help="compare.json and compare.md")
    c.add_argument("--nm", type=parse_nm_list, default=[(2, 4), (2, 8)], help="e.g. 2:4,2:8")
    c.add_argument("--steps", type=parse_ints, default=[30, 150],
                   help="training steps of SR-STE and RoI, comma-separated: a row each")
    c.add_argument("--batch", type=int, default=16, help="traces a step")
    c.add_argument("--loss", choices=("kd", "lm"), default="kd", help="as learn's")
    c.add_argument("--init", choices=("magnitude", "wanda"), default="wanda", help="RoI's start")
    c.add_argument("--roi_lr", type=float, default=0.05, help="RoI's rate on the logits")
    c.add_argument("--srste_lr", type=float, default=3e-4, help="SR-STE's rate on the weights")
    c.add_argument("--n_eval", type=int, default=500, help="held-out problems a seed")
    c.add_argument("--seeds", type=parse_ints, default=[0, 1, 2],
                   help="comma-separated: each seed its own warm start, data and held-out set")
    c.add_argument("--sft_steps", type=int, default=1200, help="each warm start's SFT steps")
    c.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    c.add_argument("--write-results", dest="write_results", action="store_true",
                   help="rewrite bench/RESULTS.md's roi block")
    return p


def main(argv):
    p = build_parser()
    args = p.parse_args(argv)
    if args.cmd is None:  # `python roi.py` alone: what it does, and a one-line error
        p.print_help()
        p.exit(2, "roi.py: error: a COMMAND is needed: learn, apply or compare\n")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cmd == "compare":
        os.makedirs(args.out_dir, exist_ok=True)
        return compare(args)
    return mask_saved(args)


if __name__ == "__main__":
    sys.exit(cli(main, sys.argv[1:]))
