"""
train.py: the entry point and the RL loop; stage 4 (the GRPO-style loss, the optimizer).

    python train.py                                    # the embedded default: tiny model, synthetic task, CPU, offline
    python train.py configs/gsm8k_qwen3.py             # a config file of overrides
    python train.py configs/tiny.py --steps=20 --lr=1e-3   # ... plus command-line overrides
    torchrun --nproc_per_node=2 train.py --threads=1   # data parallel (gloo on the CPU, NCCL on GPUs); rank 0 prints

One step (see DESIGN.md), in `collect` and `rl_step`:
    1 signal   the sampler draws prompts from the growth zone (pass rate neither ~0 nor ~1)
    2 rollout  engine.generate: G completions each, the prompt prefilled once per group
    3 rewards  the verifier cascade; every rank tells the sampler every group's rewards
               groups whose rewards are all equal carry no gradient: they are dropped and the batch is refilled
               with fresh prompts, up to `refill_tries` times (a refill draws the missing groups divided by the
               step's keep rate so far, not a whole batch); then it is trained short, never padded (DAPO)
    4 update   group advantages -> dense log-probs -> clipped policy-gradient loss -> AdamW
    5 sync     colocated: the rollout copy is refreshed in place; with rollout_ranks > 0 (torchrun), trainer 0
               broadcasts checked weight deltas (sync.py) to ranks that only generate (parallel.run_split)
The log has one line per step with each stage's figures, plus a tqdm bar; metrics.jsonl has every number.

The loss, per sampled token t of completion i in group g:
    A_i      = (r_i - mean_g r) / (std_g r + eps)                    group-normalised advantage
    ratio_t  = exp(logp_t - logp_old_t)
    loss_t   = -min(ratio_t A_i, clip(ratio_t, 1 - clip_low, 1 + clip_high) A_i)   clip-higher (DAPO)
               times w_t = min(p_old / p_rollout, is_cap) (TIS, the default; or MIS, or none)
             + kl_coef * KL_t(policy || reference)                    optional, off by default (k3 estimator)
    loss     = sum_t loss_t / (number of sampled tokens in the batch)        token-level aggregation

Simplifications:
    1. Colocated by default: the policy and the rollout engine share a process (and, with rollout_copy=same,
       the module). `fsdp=true` shards training and keeps a full replica for the engines.
    2. logp_old is the trainer's own log-prob before the first optimizer pass, so ratio = 1 at the first
       minibatch of the first pass; the rollout engine's log-probs drive the IS weights and the alpha statistics.
    3. The embedded default builds its own warm start (an SFT pass on the synthetic task's traces) and
       caches it under the output folder; real models start from their checkpoint.
    4. A NaN or inf loss or gradient skips the optimizer step on every rank; the step is logged as skipped.
    5. Data parallelism sums gradients with one all-reduce per optimizer step instead of wrapping the model in
       DDP: with dynamic sampling, ranks keep different numbers of groups, and DDP's hooks would hang on
       ranks that run fewer backward passes.

Config: `Config` in config.py is the one source of truth; a config file is a list of assignments of its fields.
The run writes the config it used to out_dir/config.json.
"""

import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time

import torch
import torch.nn.functional as F

from config import Config, parse_config  # noqa: F401  (Config is part of train's interface: tests build it)
from parallel import pull_full, run_split, shard, split_roles


# ----------------------------------------------------------------------------- stage 4: advantages and loss


def group_advantages(rewards, G, eps=1e-6):
    """rewards (N,) with N = B * G, groups contiguous -> advantages (N,), keep (B,) groups with any spread."""
    r = rewards.view(-1, G)
    std = r.std(-1, unbiased=False, keepdim=True)
    adv = (r - r.mean(-1, keepdim=True)) / (std + eps)
    keep = std[:, 0] > 0
    return adv.view(-1), keep


def is_weights(old_logp, rollout_logp, mask, mode, cap=2.0, lo=0.5, hi=2.0):
    """Importance weights for the rollout/trainer mismatch (a sparse, low-precision or stale rollout policy):
    ratio = p_train / p_rollout per sampled token. "tis": min(ratio, cap) (truncated IS, as in TIS/FlashRL);
    "mis": ratio where lo <= ratio <= hi, else 0 (the token is dropped); "none": 1. Returns weights (N, T),
    detached, and stats: the fraction truncated or masked, and the per-sample acceptance rate
    alpha = min(1, ratio) (mean and 5th percentile), the mismatch statistic of Sparrow."""
    from sparsity import alpha_sample
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


def pg_loss(logp, old_logp, adv, mask, clip_low, clip_high, ref_logp=None, kl_coef=0.0, is_w=None):
    """Per-token clipped surrogate. logp, old_logp, mask (N, T); adv (N,). Returns summed loss, stats.
    `is_w` (N, T) multiplies the policy term (IS correction). The caller divides by the number of sampled
    tokens (token-level aggregation)."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    surr = torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    loss = -surr if is_w is None else -surr * is_w
    if kl_coef > 0:
        d = ref_logp - logp  # k3 estimator of KL(policy || ref): e^d - d - 1 >= 0
        loss = loss + kl_coef * (torch.exp(d) - d - 1)
    m = mask.float()
    clipped = ((ratio < 1 - clip_low) & (a < 0)) | ((ratio > 1 + clip_high) & (a > 0))
    return (loss * m).sum(), {"clipped": (clipped.float() * m).sum().item()}


def build_batch(prompts, completions, masks, pad_id):
    """Right-padded (B, T) ids of prompt + completion, and a target mask for completion positions.
    Position t of `tmask` marks that token t+1 is a sampled token, so logits[:, t] scores it."""
    seqs = [list(p) + c[m].tolist() for p, c, m in zip(prompts, completions, masks)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    tmask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        ids[i, :len(s)] = torch.tensor(s)
        tmask[i, len(p) - 1:len(s) - 1] = True
    return ids, tmask


def token_logprobs(model, ids, tmask, temperature=1.0, packed=False, full=False):
    """Log-prob of every target token: returns (B, T) with values where tmask is set (0 elsewhere).
    `packed` concatenates the rows without padding and attends within each (flash-attn varlen on CUDA).
    `full` also returns the whole log-softmax at the target positions, (M, V) in the order of ids[tmask]."""
    B, T = ids.shape
    targets = torch.roll(ids, -1, 1)
    if packed:
        lens = (tmask.flip(1).cumsum(1).flip(1) > 0).sum(1) + 1  # row length = last target position + 2
        flat = torch.cat([ids[i, :lens[i]] for i in range(B)])[None]
        pos = torch.cat([torch.arange(int(n), device=ids.device) for n in lens])[None]
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        h = model(flat, pos=pos, cu_seqlens=cu, max_seqlen=int(lens.max()), hidden=True)[0]
        sel = torch.cat([tmask[i, :lens[i]] for i in range(B)])
        h_sel, tgt = h[sel], torch.cat([targets[i, :lens[i]] for i in range(B)])[sel]
    else:
        h = model(ids, hidden=True)  # (B, T, C)
        h_sel, tgt = h[tmask], targets[tmask]
    logits = model.lm_head(h_sel).float() / temperature  # only the scored positions are projected onto the vocabulary
    lsm = logits.log_softmax(-1)
    lp = lsm.gather(-1, tgt[:, None])[:, 0]
    out = torch.zeros(B, T, device=ids.device, dtype=lp.dtype)
    out[tmask] = lp
    return (out, lsm) if full else out


# ----------------------------------------------------------------------------- setup: devices, data, model


def setup_dist(cfg):
    """Returns (rank, world, device). Under torchrun, joins the process group (gloo on CPU, NCCL on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    dev = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dev = f"cuda:{torch.cuda.current_device()}"
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if dev.startswith("cuda") else "gloo")
    return rank, world, torch.device(dev)


def load_problems(cfg):
    """-> (train problems, held-out problems)."""
    import prompts
    if cfg.task == "synthetic":
        return (prompts.make_synthetic(cfg.n_train or 20_000, cfg.seed, cfg.difficulty, cfg.order),
                prompts.make_synthetic(cfg.n_eval, cfg.seed + 10_000, cfg.difficulty, cfg.order))
    loader = {"gsm8k": prompts.load_gsm8k, "math": prompts.load_math, "code": prompts.load_mbpp}.get(cfg.task)
    if loader is None:
        raise ValueError(f"config key 'task' must be synthetic, gsm8k, math or code, got {cfg.task!r}")
    src = {"source": cfg.data} if cfg.data else {}
    if cfg.data and os.path.exists(cfg.data):  # one local file: hold out its last n_eval rows
        rows = loader(**src)
        return rows[:-cfg.n_eval] if len(rows) > cfg.n_eval else rows, rows[-cfg.n_eval:]
    return loader(split="train", limit=cfg.n_train or None, **src), loader(split="test", limit=cfg.n_eval, **src)


def encode_pool(tok, problems, cfg, ctx, log):
    """Token ids of every prompt; prompts too long for the context are dropped and counted (not fatal)."""
    import prompts
    keep, ids = [], []
    for p in problems:
        t = tok.encode(prompts.format_prompt(tok, p, cfg.chat_template), add_special_tokens=False)
        if 0 < len(t) <= ctx - cfg.max_new_tokens:
            keep.append(p)
            ids.append(t)
    if len(keep) < len(problems):
        log(f"dropped {len(problems) - len(keep)} of {len(problems)} prompts longer than context {ctx} "
            f"- max_new_tokens {cfg.max_new_tokens}")
    if not keep:
        raise ValueError("no prompt fits in the context; lower max_new_tokens or use a longer-context model")
    return keep, ids


def tiny_model_config(cfg, tok):
    from model import ModelConfig
    return ModelConfig(vocab_size=len(tok), hidden_size=cfg.n_embd, intermediate_size=cfg.ffn,
                       num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                       head_dim=cfg.n_embd // cfg.n_head, max_position_embeddings=2048, tie_word_embeddings=True,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def teacher_trace(problem, noise, rng):
    """The SFT target: the task's reference trace, except that with probability `noise` the teacher ends on the
    value it looked up last instead of the running sum ("a=7>7 b=2>9 #2" instead of "#9"). An imperfect teacher
    with the wrong answer convention: the warm start learns the mix, and RL must find from the verifier's reward
    alone which ending is right (the most common early win of RLVR in practice)."""
    import prompts
    trace = prompts.synthetic_trace(problem)
    if rng.random() < noise:
        body, _, _ = trace.rpartition(" #")
        trace = f"{body} #{body.split(' ')[-1].split('=')[1].split('>')[0]}"
    return trace


def warm_start(cfg, tok, dev, log):
    """The tiny model's starting point: SFT on the synthetic task's reference traces, cached in out_dir/warmstart.
    The cache is keyed by everything that shapes it, so changing the model or the SFT settings rebuilds it."""
    import prompts
    from model import Transformer
    key = {k: getattr(cfg, k) for k in ("seed", "n_layer", "n_embd", "n_head", "n_kv_head", "ffn", "difficulty",
                                        "order", "sft_steps", "sft_batch", "sft_lr", "sft_noise", "sft_difficulty",
                                        "sft_init")}
    path = os.path.join(cfg.out_dir, "warmstart")
    try:
        with open(os.path.join(path, "sft_key.json")) as f:
            if json.load(f) == json.loads(json.dumps(key)):
                log(f"warm start: loading the cached SFT model from {path}")
                return Transformer.from_pretrained(path, device=dev)
    except FileNotFoundError:
        pass
    torch.manual_seed(cfg.seed)
    if cfg.sft_init.endswith(".py"):  # a curriculum: that config's warm start (built or cached) first, then this SFT
        model = warm_start(parse_config([cfg.sft_init, f"--seed={cfg.seed}"]), tok, dev, log)
    elif cfg.sft_init:  # or any checkpoint of the same tokenizer
        model = Transformer.from_pretrained(cfg.sft_init, device=dev)
    else:
        model = Transformer(tiny_model_config(cfg, tok)).to(dev)
    want, got = tiny_model_config(cfg, tok), model.config
    diff = [f"{k} {getattr(got, k)} (want {getattr(want, k)})" for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads") if getattr(got, k) != getattr(want, k)]
    if diff:
        raise ValueError(f"config key 'sft_init' ({cfg.sft_init}): its model differs from this config's: "
                         f"{', '.join(diff)}")
    data = prompts.make_synthetic(cfg.sft_steps * cfg.sft_batch, cfg.seed + 20_000,
                                  cfg.sft_difficulty or cfg.difficulty, cfg.order)  # SFT's range may differ from RL's
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(cfg.seed)
    log(f"warm start: SFT of a {model.num_params() / 1e6:.2f}M-parameter model for {cfg.sft_steps} steps")
    from tqdm import tqdm
    for step in tqdm(range(cfg.sft_steps), desc="sft", disable=cfg._rank != 0, dynamic_ncols=True):
        batch = data[step * cfg.sft_batch:(step + 1) * cfg.sft_batch]
        p_ids = [tok.encode(p.prompt, add_special_tokens=False) for p in batch]
        c_ids = [torch.tensor(tok.encode(teacher_trace(p, cfg.sft_noise, rng), add_special_tokens=False)
                              + [tok.eos_token_id]) for p in batch]
        ids, tmask = build_batch(p_ids, c_ids, [torch.ones(len(c), dtype=torch.bool) for c in c_ids], tok.pad_token_id)
        ids, tmask = ids.to(dev), tmask.to(dev)
        lr = cfg.sft_lr * min(1.0, (step + 1) / 50) * (0.5 * (1 + math.cos(math.pi * step / cfg.sft_steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = -token_logprobs(model, ids, tmask)[tmask].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    log(f"warm start: final SFT loss {loss.item():.4f}")
    save_atomic(path, lambda d: (model.save_pretrained(d), tok.save_pretrained(d),
                                 json.dump(key, open(os.path.join(d, "sft_key.json"), "w"))))
    return model


def build_policy(cfg, dev, log):
    """-> (model, tokenizer). Real models come from a checkpoint; the tiny one from its warm start."""
    from transformers import AutoTokenizer
    from model import Transformer
    if cfg.model:
        tok = AutoTokenizer.from_pretrained(cfg.model)
        model = Transformer.from_pretrained(cfg.model, device=dev)
    else:
        import prompts
        tok = prompts.build_char_tokenizer(os.path.join(cfg.out_dir, "tokenizer"))
        if cfg._rank == 0:
            model = warm_start(cfg, tok, dev, log)
        if cfg._world > 1:
            torch.distributed.barrier()  # rank 0 built the warm start; the others read it
        if cfg._rank != 0:
            model = Transformer.from_pretrained(os.path.join(cfg.out_dir, "warmstart"), device=dev)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.to(getattr(torch, cfg.dtype)), tok


# ----------------------------------------------------------------------------- checkpoints


def save_atomic(path, write):
    """Write a folder with write(tmp_dir), then swap it in with renames. A kill at any point leaves either the
    old complete folder at `path`, or (between the two renames) the old one at `path.old`, which load looks at."""
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    for fn in os.listdir(tmp):  # flush file contents before the rename makes them visible
        with open(os.path.join(tmp, fn), "rb") as f:
            os.fsync(f.fileno())
    if os.path.exists(path):
        shutil.rmtree(f"{path}.old", ignore_errors=True)
        os.replace(path, f"{path}.old")
    os.replace(tmp, path)
    shutil.rmtree(f"{path}.old", ignore_errors=True)


def save_checkpoint(cfg, model, tok, opt, sampler, step, history):
    # under FSDP the optimizer state is sharded, and resume is not supported yet: it is not saved
    state = {"step": step, "opt": None if cfg.fsdp else opt.state_dict(), "sampler": sampler.state_dict(),
             "history": history,
             "schedule": cfg._schedule.state_dict() if cfg._schedule is not None else None,
             "controller": cfg._controller.state_dict() if cfg._controller is not None else None,
             "distill": cfg._distill.state_dict() if cfg._distill is not None else None,
             "torch_rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg)}
    from model import save_adapter
    save_atomic(os.path.join(cfg.out_dir, "ckpt"), lambda d: (model.save_pretrained(d), tok.save_pretrained(d),
                                                               cfg.lora_r and save_adapter(model, d, cfg.model or "warmstart"),
                                                               torch.save(state, os.path.join(d, "trainer_state.pt"))))


def load_checkpoint(cfg, model, opt, sampler, dev):
    from safetensors.torch import load_file
    for path in (os.path.join(cfg.out_dir, "ckpt"), os.path.join(cfg.out_dir, "ckpt.old")):
        if os.path.exists(os.path.join(path, "trainer_state.pt")):
            break
    else:
        raise FileNotFoundError(f"resume=True but there is no checkpoint in {cfg.out_dir}/ckpt")
    if cfg.lora_r:  # model.safetensors holds the merged weights (for other engines); resume from the adapter
        from model import load_adapter
        load_adapter(model, path)
    else:
        sd = load_file(os.path.join(path, "model.safetensors"), device=str(dev))
        model.load_state_dict(sd, strict=not model.config.tie_word_embeddings)
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location=dev, weights_only=False)
    opt.load_state_dict(state["opt"])
    sampler.load_state_dict(state["sampler"])
    if state.get("schedule") and cfg._schedule is not None:  # the KV table as the controller left it
        cfg._schedule.load_state_dict(state["schedule"])
        if state.get("controller") and cfg._controller is not None:
            cfg._controller.load_state_dict(state["controller"])
    if state.get("distill") and cfg._distill is not None:  # the rollout-only adapter and its optimizer
        cfg._distill.load_state_dict(state["distill"])
    torch.set_rng_state(state["torch_rng"].cpu())
    return state["step"], state["history"]


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(cfg, engine, cascade, problems, ids, rank, world):
    """Greedy accuracy on the held-out set, scored by the same cascade; each rank takes a slice, counts are summed."""
    mine = list(range(rank, len(problems), world))
    correct = 0.0
    for a in range(0, len(mine), 256):
        chunk = mine[a:a + 256]
        ro = engine.generate([ids[i] for i in chunk], 1, seed=0)
        correct += sum(cascade.score_batch([problems[i] for i in chunk], ro.texts, group_size=1).rewards)
    if world > 1:
        t = torch.tensor([correct], dtype=torch.float64, device=engine.model.lm_head.weight.device)
        torch.distributed.all_reduce(t, group=cfg._group)
        correct = t.item()
    return correct / len(problems)


# ----------------------------------------------------------------------------- one RL step


def gather(obj, world, group=None):
    """Every rank's `obj` (of `group`, by default all), in rank order (a list of one on a single process)."""
    if world == 1:
        return [obj]
    out = [None] * world
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def collect(cfg, step, engine, cascade, sampler, pool_ids, rank, world):
    """Stages 1-3 with DAPO's dynamic sampling: draw prompts, generate G completions each, score them, and keep
    the groups whose rewards have spread. Refill with fresh prompts up to `refill_tries` more times; when the tries
    run out the batch is trained short (never padded with zero-advantage groups). Every rank draws the same
    prompts and takes its slice, and every rank observes the whole batch, so the samplers stay identical."""
    from prompts import group_has_signal
    from reward import combine
    G, n_local = cfg.group_size, max(1, cfg.prompts_per_step // world)
    kept, results, rec = [], [], {"gen_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0, "tries": 0}
    lens, finish_length, rewards_all, zone, zero_adv = [], 0, [], [], 0
    n_draw, drawn, signals = n_local, 0, 0  # prompts per rank this try; drawn and with-spread so far, all ranks
    for t in range(1 + (cfg.refill_tries if cfg.dynamic_sampling else 0)):
        batch = sampler.next_batch(n_draw * world)[rank * n_draw:(rank + 1) * n_draw]
        zone.append(sampler.stats().get("zone", float("nan")))
        t0, seed = time.perf_counter(), cfg.seed * 100_003 + (step * 8 + t) * world + rank
        ro = engine.generate([pool_ids[i] for i, _ in batch], G, seed=seed)
        rec["gen_s"] += time.perf_counter() - t0
        if t == 0 and cfg._dense_engine is not None and step % cfg.kv_compare_every == 0:
            rec.update(compare_dense(cfg, ro, [pool_ids[i] for i, _ in batch], seed))
        for k in ("prefill_s", "decode_s", "new_tokens", "pages_read", "pages_dense"):
            rec[k] = rec.get(k, 0) + ro.timings[k]
        res = cascade.score_batch([p for _, p in batch for _ in range(G)], ro.texts, group_size=G)
        results.append(res)
        r = torch.tensor(res.rewards, dtype=torch.float32).view(-1, G)
        rewards_all.append(r.flatten())
        lens.append(ro.mask.sum(1).float())
        finish_length += sum(f == "length" for f in ro.finish)
        has = [group_has_signal(g, cfg.min_spread) for g in r.tolist()]  # this rank's groups
        everyone = gather(([i for i, _ in batch], r.tolist(), has), world, cfg._group)
        sampler.observe([i for idx, _, _ in everyone for i in idx], [g for _, rs, _ in everyone for g in rs])
        drawn += sum(len(h) for *_, h in everyone)
        signals += sum(sum(h) for *_, h in everyone)
        for g, signal in enumerate(has):
            if (signal or not cfg.dynamic_sampling) and len(kept) < n_local:
                zero_adv += not signal
                rows = slice(g * G, (g + 1) * G)
                kept.append((batch[g][0], ro.tokens[rows], ro.mask[rows], r[g], ro.logp[rows],
                             None if ro.read_pages is None else ro.read_pages[rows]))
        rec["tries"] = t + 1
        n_kept = gather(len(kept), world, cfg._group)
        if min(n_kept) >= n_local:  # the decision to refill is global: every rank runs the same collectives
            break
        # a refill draws what is missing, scaled up by this step's keep rate so far, not a whole new batch
        n_draw = min(n_local, math.ceil((n_local - min(n_kept)) * drawn / max(1, signals)))
    rew = torch.cat(rewards_all)
    rec["kv_read"] = rec["pages_read"] / max(1, rec["pages_dense"])  # fraction of the KV pages decode read
    rec.update(reward=rew.mean().item(), groups_kept=sum(n_kept), groups=n_local * world,
               short=int(sum(n_kept) < n_local * world), len_mean=torch.cat(lens).mean().item(),
               zero_adv_groups=sum(gather(zero_adv, world, cfg._group)), rollouts=len(rew) * world,
               finish_length=finish_length / len(rew), zone=sum(zone) / len(zone), **combine(results).summary())
    return kept, rec


def compare_dense(cfg, ro, prompt_ids, seed):
    """The same prompts again on a dense engine (same weights, same seed), timed: the sparse budget's rollout
    speedup, measured in the run itself, in tokens per second (prefill included), since the two rollouts may
    differ in length. The dense rollout is thrown away."""
    de, sp = cfg._dense_engine.generate(prompt_ids, cfg.group_size, seed=seed).timings, ro.timings
    rate = {k: t["new_tokens"] / max(1e-9, t["prefill_s"] + t["decode_s"]) for k, t in (("dense", de), ("sparse", sp))}
    return {"dense_tok_s": rate["dense"], "sparse_tok_s": rate["sparse"], "rollout_speedup": rate["sparse"] / rate["dense"]}


def rl_step(cfg, step, model, engine, cascade, opt, sampler, pool_ids, rank, world):
    """Rollouts, rewards, advantages, and the update of one step. Returns the step's metrics record."""
    t0 = time.perf_counter()
    kept, rec = collect(cfg, step, engine, cascade, sampler, pool_ids, rank, world)
    rec["step"], rec["collect_s"] = step, time.perf_counter() - t0
    rec.update(learn(cfg, model, opt, kept, pool_ids, engine.pad_id, world))
    return rec


def learn(cfg, model, opt, kept, pool_ids, pad_id, world):
    """Stage 4 on the kept groups (prompt index, tokens, mask, rewards, rollout log-probs): advantages, the
    passes of train_on, and the figures for the log. Every rank of cfg._group calls it, kept groups or not."""
    dev = model.lm_head.weight.device
    t1, rec = time.perf_counter(), {}
    stats = torch.zeros(5, device=dev, dtype=torch.float64)  # loss sum, tokens, clipped, skipped, grad norm
    if kept:
        p_ids = [pool_ids[i] for i, *_ in kept for _ in range(cfg.group_size)]
        ids, tmask = build_batch(p_ids, [row for k in kept for row in k[1]], [row for k in kept for row in k[2]],
                                 pad_id)  # groups from different refill tries have different lengths
        adv = torch.cat([group_advantages(k[3], cfg.group_size, cfg.adv_eps)[0] for k in kept])
        roll = torch.zeros(tmask.shape)  # the rollout policy's log-probs, at the trainer's target positions
        roll[tmask] = torch.cat([lp[m] for k in kept for lp, m in zip(k[4], k[2])])
        ids, tmask, adv, roll = ids.to(dev), tmask.to(dev), adv.to(dev), roll.to(dev)
    else:  # nothing to learn from here, but this rank still joins every collective of the update
        ids, tmask, adv = (torch.zeros(0, 1, dtype=torch.long, device=dev), torch.zeros(0, 1, dtype=torch.bool, device=dev),
                           torch.zeros(0, device=dev))
        roll = torch.zeros(0, 1, device=dev)
    out = train_on(cfg, model, opt, ids, tmask, adv, world, roll)
    stats += out.pop("stats")
    dense_full = out.pop("_dense_full", None)
    if cfg._distill is not None and kept and dense_full is not None:  # the rollout-only adapter, toward dense
        pg = lambda lp, rows: pg_loss(lp, roll[rows], adv[rows], tmask[rows], cfg.clip_low, cfg.clip_high)[0]
        rec.update(cfg._distill.step_on(kept, [len(pool_ids[k[0]]) for k in kept], cfg.group_size, ids, tmask,
                                        dense_full, pg))
    if cfg._schedule is not None:
        observe_schedule(cfg, out.pop("_alpha", (torch.zeros(0), torch.zeros(0, dtype=torch.long))), rec, world)
    rec.update(out)
    if world > 1:
        torch.distributed.all_reduce(stats, group=cfg._group)
    rec.update(loss=(stats[0] / stats[1].clamp(min=1)).item(), tokens=int(stats[1]),
               clipfrac=(stats[2] / stats[1].clamp(min=1)).item(), skipped_nonfinite=int(stats[3]) // world,
               grad_norm=stats[4].item() / world, lr=opt.param_groups[0]["lr"], train_s=time.perf_counter() - t1)
    return rec


def observe_schedule(cfg, alpha_pages, rec, world):
    """Per-bin mean and p5 of alpha over every rank's tokens, into the record; the controller (if on) moves the
    table toward the smallest budgets whose p5 holds the target. Every rank sees the same numbers and so keeps
    the same table."""
    from sparsity import bin_stats
    a, pages = (torch.cat(x) for x in zip(*gather(alpha_pages, world, cfg._group)))
    if a.numel() == 0:
        return
    st = bin_stats(a[None], torch.ones(1, a.numel(), dtype=torch.bool), pages[None], cfg.kv_bin_pages)
    rec["alpha_bins"] = {"count": st["count"].tolist(), "mean": st["mean"].tolist(), "p5": st["p5"].tolist()}
    if cfg._controller is not None:
        rec["kv_moved"] = cfg._controller.observe(st["p5"], st["count"])
    rec["kv_table"] = list(cfg._schedule.table)


def allreduce_grads(model, world, group=None):
    """Sum gradients over ranks (data parallelism by hand). DDP's hooks would need every rank to run the same
    number of backward passes; with dynamic sampling the ranks keep different numbers of groups, so instead
    every rank runs its own micro-batches and joins exactly one all-reduce per optimizer step."""
    if world == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapter only
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p)


def train_on(cfg, model, opt, ids, tmask, adv, world, rollout_logp=None):
    """`passes` x `minibatches` optimizer steps over one batch of kept rollouts (the same count on every rank,
    whatever its share of the batch). Token-level loss over the global minibatch. `rollout_logp` (N, T), the
    rollout policy's log-probs at the target positions, drives the IS correction and the mismatch statistics.
    Returns {"stats": summed stats, and this rank's mismatch figures}."""
    stats = torch.zeros(5, device=ids.device, dtype=torch.float64)
    ntok = tmask.sum().double()
    if world > 1:
        torch.distributed.all_reduce(ntok, group=cfg._group)
    if ntok.item() == 0:  # no rank kept a group: nothing to update (decided globally)
        return {"stats": stats}
    packed = cfg.pack == "on" or (cfg.pack == "auto" and ids.is_cuda and model_flash_ok())
    N, mbs = ids.shape[0], cfg.micro_batch

    def chunks(rows):
        """Micro-batches of rows. Under FSDP every rank must run as many forwards as the others (each one
        all-gathers weights), so the short ranks get empty micro-batches."""
        parts = list(rows.split(mbs)) if len(rows) else []
        if cfg.fsdp:
            n = torch.tensor([len(parts)], device=ids.device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
            parts += [rows[:0]] * (int(n) - len(parts))
        return parts

    def logprobs_of(m, rows):
        parts = chunks(rows) if m is model else list(rows.split(mbs))
        return torch.cat([token_logprobs(m, ids[r], tmask[r], cfg.temperature, packed) for r in parts]) \
            if parts else torch.zeros(0, ids.shape[1], device=ids.device)

    with torch.no_grad():  # logp_old: the policy before this batch's first update
        if cfg._distill is not None:  # DistillSparse also takes the whole dense distribution at these positions
            parts = [token_logprobs(model, ids[r], tmask[r], cfg.temperature, packed, full=True)
                     for r in torch.arange(N).split(mbs)]
            old, dense_full = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        else:
            old = logprobs_of(model, torch.arange(N))
        ref = logprobs_of(cfg._ref_model, torch.arange(N)) if cfg.kl_coef > 0 else None
    mode = cfg.is_correction if rollout_logp is not None else "none"
    is_w, mis = is_weights(old, old if rollout_logp is None else rollout_logp, tmask.float(), mode,
                           cfg.is_cap, cfg.mis_low, cfg.mis_high)
    mb_tokens = (ntok / cfg.minibatches).clamp(min=1)  # token-level mean over the (global) minibatch
    for _ in range(cfg.passes):
        for k in range(cfg.minibatches):
            opt.zero_grad(set_to_none=True)
            for micro in chunks(torch.arange(k, N, cfg.minibatches)):  # may be none, or empty, on this rank
                lp = token_logprobs(model, ids[micro], tmask[micro], cfg.temperature, packed)
                loss, s = pg_loss(lp, old[micro], adv[micro], tmask[micro], cfg.clip_low, cfg.clip_high,
                                  None if ref is None else ref[micro], cfg.kl_coef, is_w[micro])
                (loss * (world if cfg.fsdp else 1) / mb_tokens).backward()  # FSDP averages over ranks: undo it
                stats[0] += loss.item()
                stats[2] += s["clipped"]
            if not cfg.fsdp:  # FSDP reduce-scatters the gradients itself
                allreduce_grads(model, world, cfg._group)
            gn = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.grad_clip)
            gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn  # a DTensor under FSDP
            bad = torch.tensor([0.0 if torch.isfinite(gn) else 1.0], device=ids.device)
            if world > 1:
                torch.distributed.all_reduce(bad, group=cfg._group)
            if bad.item() > 0:  # NaN/inf anywhere: skip the optimizer step on every rank, weights untouched
                opt.zero_grad(set_to_none=True)
                stats[3] += 1
                continue
            opt.step()
            stats[4] += gn.item()
    stats[1] = tmask.sum() * cfg.passes
    local_tokens = max(1, int(tmask.sum()))
    out = {"stats": stats, "alpha_mean": mis["alpha_mean"], "alpha_p5": mis["alpha_p5"],
           "is_cut": mis["is_cut"] / local_tokens}
    if cfg._distill is not None:
        out["_dense_full"] = dense_full
    if rollout_logp is not None and cfg._schedule is not None:  # the tail statistic per bin of cached pages
        from sparsity import alpha_sample
        a = alpha_sample(old, rollout_logp)  # position t scores token t + 1: t + 1 tokens are cached
        pages = (torch.arange(ids.shape[1], device=ids.device) + cfg.page_size) // cfg.page_size
        out["_alpha"] = (a[tmask].cpu(), pages.expand_as(tmask)[tmask].cpu())
    return out


def kv_budget(cfg, model=None, tok=None, pool_ids=None, log=print):
    """The rollout engine's KV budget from the config: False (dense) or a function of the cached page count.
    kv_budget=calibrate runs calibrate.py's sweep on `model` and saves the table to out_dir/kv_schedule.json."""
    from sparsity import Schedule, fixed_budget, fraction_budget
    kind, _, arg = cfg.kv_budget.partition(":")
    if kind in ("schedule", "calibrate"):
        import calibrate
        if kind == "schedule":
            return calibrate.load_schedule(arg, cfg.page_size)
        sched = calibrate.calibrated_schedule(cfg, model, tok, pool_ids, log)
        if cfg._rank == 0:
            calibrate.save_schedule(sched, os.path.join(cfg.out_dir, "kv_schedule.json"), cfg)
        return sched
    try:
        if kind == "dense":
            return False
        if kind == "fraction":
            return fraction_budget(float(arg))
        if kind == "fixed":
            return fixed_budget(int(arg))
        if kind == "table":
            return Schedule([int(x) for x in arg.split(",")], cfg.kv_bin_pages)
    except ValueError as e:
        raise ValueError(f"config key 'kv_budget': {e}") from None
    raise ValueError(f"config key 'kv_budget' must be dense, fraction:F, fixed:N, table:N1,N2,..., schedule:PATH or "
                     f"calibrate, got {cfg.kv_budget!r}")


def make_rollout(cfg, model):
    """The model that generates: the policy itself, or a bf16 / fp8 / N:M copy of it (sync.make_rollout_copy).
    With LoRA the copy is made from the merged weights, so the adapter is quantised or pruned with its layer."""
    from model import merge_lora
    from sync import make_rollout_copy
    if cfg.rollout_copy == "same":
        return model
    import copy
    return make_rollout_copy(merge_lora(copy.deepcopy(model)) if cfg.lora_r else model, cfg.rollout_copy)


def refresh_rollout(cfg, rollout_model, model):
    """After an update: re-derive the rollout copy from the policy (a no-op when they are the same object)."""
    if cfg._distill is not None:  # DistillSparse: new base weights under the kept adapter
        cfg._distill.refresh(model)
        return
    if rollout_model is model:
        return
    from model import merged_state_dict
    from sync import refresh_rollout_copy
    refresh_rollout_copy(rollout_model, merged_state_dict(model) if cfg.lora_r else model)


def load_judge(spec):
    """'module:function' -> the callable, imported by name (the user's own file; nothing is registered)."""
    if not spec:
        return None
    import importlib
    mod, _, fn = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"config key 'judge': cannot import {spec!r} ({e})") from None


def model_flash_ok():
    import model as m
    return m.flash_attn_varlen_func is not None


def lr_at(cfg, step):
    """Linear warmup, then cosine down to min_lr_ratio * lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


# ----------------------------------------------------------------------------- the loop


def fmt(rec):
    """One log line per step, grouped by stage: what each stage kept or skipped, and what it spent."""
    g = lambda k, f: f.format(rec[k]) if k in rec else ""
    parts = [f"step {rec['step']:4d}",
             "signal " + g("zone", "zone {:.2f} ") + f"kept {rec['groups_kept']}/{rec['groups']} tries {rec['tries']}"
             + (" SHORT" if rec.get("short") else ""),
             "rollout " + g("gen_s", "{:.2f}s ") + g("prefill_s", "(prefill {:.2f}s ") + g("decode_s", "decode {:.2f}s) ")
             + g("len_mean", "len {:.1f} ") + g("kv_read", "kv {:.2f} ") + g("kv_table", "table {} ")
             + g("rollout_speedup", "vs dense {:.2f}x"),
             "reward " + g("reward", "{:.3f} ") + g("reach_verify", "verify {:.2f} ") + g("dedup_saved", "dedup {:.2f} ")
             + (g("errors", "errors {} ") if rec.get("errors") else "") + (g("timeouts", "timeouts {}") if rec.get("timeouts") else ""),
             "mismatch " + g("alpha_mean", "alpha {:.4f} ") + g("alpha_p5", "p5 {:.4f} ") + g("is_cut", "is-cut {:.3f} ")
             + (f"p5/bin {[round(x, 2) for x in rec['alpha_bins']['p5']]} " if "alpha_bins" in rec else "")
             + g("distill_kl", "distill-kl {:.4f}"),
             "update " + g("loss", "loss {:+.4f} ") + g("clipfrac", "clip {:.3f} ") + g("grad_norm", "gn {:.2f} ")
             + g("train_s", "{:.2f}s") + (g("skipped_nonfinite", " NONFINITE-SKIPPED {}") if rec.get("skipped_nonfinite") else "")]
    if "acc" in rec:
        parts.append(g("acc", "held-out acc {:.3f}"))
    return " | ".join(p.strip() for p in parts)


def main(argv):
    from tqdm import tqdm
    from prompts import GrowthZoneSampler, PromptSampler
    from reward import Cascade
    from rollout import Engine
    cfg = parse_config(argv)
    rank, world, dev = setup_dist(cfg)
    cfg._rank, cfg._world = rank, world
    roles = split_roles(cfg, rank, world)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    log = (lambda s: tqdm.write(s)) if rank == 0 else (lambda s: None)
    os.makedirs(cfg.out_dir, exist_ok=True)
    if rank == 0:
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
    random.seed(cfg.seed)
    model, tok = build_policy(cfg, dev, log)
    train_p, eval_p = load_problems(cfg)
    ctx = model.config.max_position_embeddings
    train_p, train_ids = encode_pool(tok, train_p, cfg, ctx, log)
    eval_p, eval_ids = encode_pool(tok, eval_p, cfg, ctx, log)
    stop = [cfg.stop] if cfg.stop else []
    if cfg.lora_r:
        from model import add_lora
        add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
    if world > 1:  # the ranks start from the same weights (the adapter's random init included)
        for p in model.parameters():
            torch.distributed.broadcast(p.data, 0)
    if cfg.kl_coef > 0:
        import copy
        cfg._ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    cfg._replica = shard(cfg, model, dev) if cfg.fsdp else None
    full = cfg._replica or model  # full weights: what the engines read
    budget = kv_budget(cfg, full, tok, train_ids, log)
    if cfg.distill_r:
        from distill import DistillSparse
        cfg._distill = DistillSparse.for_run(cfg, full, budget, world)
    rollout_model = cfg._distill.model if cfg._distill is not None else make_rollout(cfg, full)
    from sync import describe_copy
    log(f"rollout copy: {describe_copy(rollout_model)}" + (f", plus a DistillSparse adapter of rank "
                                                            f"{cfg.distill_r}" if cfg.distill_r else ""))
    kv = dict(page_size=cfg.page_size, scorer=cfg.kv_scorer, dense_layers=cfg.dense_layers)
    engine = Engine(rollout_model, tok, cfg.max_new_tokens, cfg.temperature, cfg.top_p, stop, sparse=budget,
                    record_pages=cfg._distill is not None, **kv)
    if cfg.kv_compare_every > 0 and budget:
        cfg._dense_engine = Engine(rollout_model, tok, cfg.max_new_tokens, cfg.temperature, cfg.top_p, stop, **kv)
    from sparsity import Controller, Schedule
    if isinstance(budget, Schedule):  # the engine reads this object, so the controller's edits apply next step
        cfg._schedule = budget
        cfg._controller = Controller(budget, target=cfg.kv_target) if cfg.kv_controller else None
    elif cfg.kv_controller:
        raise ValueError("config key 'kv_controller' needs a table budget (kv_budget=table:N1,N2,...)")
    greedy = Engine(full, tok, cfg.max_new_tokens, 0.0, 1.0, stop)  # held-out accuracy is the policy's
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    if cfg.sampler == "growth":
        sampler = GrowthZoneSampler(train_p, cfg.seed, zone=cfg.zone, explore=cfg.explore)
    elif cfg.sampler == "uniform":
        sampler = PromptSampler(train_p, cfg.seed)
    else:
        raise ValueError(f"config key 'sampler' must be growth or uniform, got {cfg.sampler!r}")
    if cfg.autocast not in ("none", "bfloat16"):
        raise ValueError(f"config key 'autocast' must be none or bfloat16, got {cfg.autocast!r}")
    amp = torch.autocast(dev.type, torch.bfloat16, enabled=cfg.autocast == "bfloat16")
    cascade = Cascade(max_chars=cfg.max_chars or None, math_verify=cfg.math_verify, judge=load_judge(cfg.judge))
    try:  # the cascade holds worker processes: close them however the run ends
        if roles:
            history = run_split(cfg, model, tok, rollout_model, engine, greedy, cascade, opt, sampler, amp,
                                (train_ids, eval_p, eval_ids), roles, log)
        else:
            history = run(cfg, model, tok, rollout_model, engine, greedy, cascade, opt, sampler, amp,
                          (train_ids, eval_p, eval_ids), rank, world, dev, log)
    finally:
        cascade.close()
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return history


def run(cfg, model, tok, rollout_model, engine, greedy, cascade, opt, sampler, amp, data, rank, world, dev, log):
    """Evaluate the start, run the steps (log, metrics, checkpoints), check the ranks agree, summarise."""
    from tqdm import tqdm
    train_ids, eval_p, eval_ids = data
    start, history = 0, {"records": [], "acc0": None}
    if cfg.resume:
        start, history = load_checkpoint(cfg, model, opt, sampler, dev)
        refresh_rollout(cfg, rollout_model, model)  # the copy was made from the weights before the checkpoint
        log(f"resumed from step {start}")
    else:
        with amp:
            history["acc0"] = evaluate(cfg, greedy, cascade, eval_p, eval_ids, rank, world)
        log(f"held-out accuracy before RL: {history['acc0']:.3f} on {len(eval_p)} problems")
    log(f"policy: {model.num_params() / 1e6:.2f}M parameters on {dev} ({cfg.dtype}), world size {world}; "
        f"{len(train_ids)} training prompts")
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if rank == 0:  # rewrite the log up to the resume point, so a resumed run does not repeat steps
        with open(metrics_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in history["records"])
    t_start = time.perf_counter()
    for step in tqdm(range(start, cfg.steps), desc="rl", initial=start, total=cfg.steps, disable=rank != 0,
                     dynamic_ncols=True):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        with amp:
            rec = rl_step(cfg, step, model, engine, cascade, opt, sampler, train_ids, rank, world)
            pull_full(cfg, model)
            refresh_rollout(cfg, rollout_model, cfg._replica or model)  # stage 5, colocated: the copy follows
            last = step == cfg.steps - 1
            if (step + 1) % cfg.eval_every == 0 or last:
                rec["acc"] = evaluate(cfg, greedy, cascade, eval_p, eval_ids, rank, world)
        history["records"].append(rec)
        log(fmt(rec))
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if rank == 0 and ((step + 1) % cfg.save_every == 0 or last):
            save_checkpoint(cfg, cfg._replica or model, tok, opt, sampler, step + 1, history)
    history["checksums"] = check_ranks_agree(cfg._replica or model, world, log)
    if rank == 0:
        summarize(cfg, history, time.perf_counter() - t_start, log)
    return history


def check_ranks_agree(model, world, log):
    """Every rank's weight checksum, logged: the ranks must hold the same weights, so check instead of trusting."""
    from model import weight_checksum
    sums = gather(weight_checksum(model), world)
    log(f"weight checksum per rank: {' '.join(sums)}" + (" (identical)" if len(set(sums)) == 1 else " (DIFFERENT)"))
    return sums


def summarize(cfg, history, seconds, log):
    recs = history["records"]
    accs = [r["acc"] for r in recs if "acc" in r]
    if not recs:
        return
    n = len(recs)
    mean = lambda k: sum(r.get(k, 0.0) for r in recs) / n
    rows = [("steps", f"{n}"), ("held-out accuracy before RL", f"{history['acc0']}"),
            ("held-out accuracy after RL", f"{accs[-1] if accs else 'n/a'}"),
            ("reward, first 10% of steps", f"{sum(r['reward'] for r in recs[:max(1, n // 10)]) / max(1, n // 10):.3f}"),
            ("reward, last 10% of steps", f"{sum(r['reward'] for r in recs[-max(1, n // 10):]) / max(1, n // 10):.3f}"),
            ("groups kept / step", f"{mean('groups_kept'):.1f} of {recs[0]['groups']}"),
            ("steps trained short", f"{sum(r.get('short', 0) for r in recs)}"),
            ("reward calls that errored / timed out", f"{sum(r.get('errors', 0) for r in recs)} / "
                                                      f"{sum(r.get('timeouts', 0) for r in recs)}"),
            ("rollout time / step", f"{mean('gen_s'):.2f}s"), ("train time / step", f"{mean('train_s'):.2f}s"),
            ("non-finite steps skipped", f"{sum(r.get('skipped_nonfinite', 0) for r in recs)}"),
            ("RL wall time", f"{seconds:.0f}s")]
    w = max(len(k) for k, _ in rows)
    log("\n".join(["", "summary", "-" * (w + 12)] + [f"{k:<{w}}  {v}" for k, v in rows]))
    if cfg.plot:
        plot(cfg, history)


def plot(cfg, history):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = history["records"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot([r["step"] for r in recs], [r["reward"] for r in recs], lw=1)
    ax[0].set(xlabel="step", ylabel="mean reward", title="training reward")
    pts = [(0, history["acc0"])] if history["acc0"] is not None else []
    pts += [(r["step"] + 1, r["acc"]) for r in recs if "acc" in r]
    ax[1].plot(*zip(*pts), marker="o")
    ax[1].set(xlabel="step", ylabel="greedy accuracy", title="held-out accuracy", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(os.path.join(cfg.out_dir, "run.png"), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError) as e:  # config and data errors: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
