"""
warmstart.py: where the policy starts. A real model comes from its checkpoint (a hub name or a local
Hugging Face folder); the embedded default's tiny model is trained here first, by SFT on the
synthetic task's traces.

    python train.py                     # builds the warm start (about a minute on 2 cores), then RL
    python train.py --out_dir=out/try2  # reuses it: out/warmstart-cache/sft-<hash of its settings>
    python train.py configs/longcot.py  # a curriculum: tiny's warm start first, then longer chains

What it does:
    1. build_policy: the tokenizer and the model, in the config's dtype.
    2. warm_start: SFT from scratch (or from sft_init: a checkpoint, or another config's warm start)
       on teacher traces (the synthetic task's, or reasoning-gym chain_sum's: chain_sum_trace), cached under a key of every setting that shapes it (cache_path: out_dir's
       parent/warmstart-cache/sft-<hash>), so runs in other out_dirs share it; a change of any of
       those settings builds a new one.

Simplifications:
    1. The teacher is the task's reference trace, with an optional planted error (sft_noise, see
       teacher_trace) or, on order "marked", an optional slip at each carry (sft_slip). On
       reasoning-gym's chain_sum it is exact: every line of its trace is arithmetic that holds.
    2. The SFT loop is plain: one AdamW, warmup then cosine, no packing, no evaluation.
"""

import hashlib
import json
import math
import os
import random
import sys

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from checkpoint import save_atomic
from config import parse_config
from model import ModelConfig, Transformer
from tasks import (build_char_tokenizer, is_lagged, lagged_trace, sft_problems, sft_seed,
                   synthetic_trace)
from update import build_batch, token_logprobs


def tiny_model_config(cfg, tok):
    """The embedded default's model shape: a Qwen3-family decoder with tied embeddings, sized by the
    config; with n_expert > 0 a Qwen3-MoE whose every layer routes to experts."""
    moe = dict(num_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_active,
               moe_intermediate_size=cfg.moe_ffn) if cfg.n_expert else {}
    return ModelConfig(vocab_size=len(tok), hidden_size=cfg.n_embd, intermediate_size=cfg.ffn,
                       num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                       num_key_value_heads=cfg.n_kv_head, head_dim=cfg.n_embd // cfg.n_head,
                       max_position_embeddings=max(2048, 512 + cfg.max_new_tokens),
                       tie_word_embeddings=True,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **moe)


def chain_sum_trace(problem):
    """reasoning-gym chain_sum's exact trace, written from the item's metadata (its expression):
    the first term, then each step's operator and next term and the running total, every total
    signed and in two digits so that a digit always sits at the same place in its step; the
    answer follows "####": "63 - 15 + 43" -> "+063-15=+048+43=+091\n#### 91". A step reads the
    total it has just written and one term of the prompt, the same step at any number of terms;
    the totals a long chain reaches (past 200, below -100) are what short ones rarely show."""
    expr = problem.meta["entry"]["metadata"]["expression"].split()  # "63", "-", "15", ...
    total = int(expr[0])
    steps = [f"{total:+03d}"]
    for op, term in zip(expr[1::2], expr[2::2]):
        total += int(term) if op == "+" else -int(term)
        steps.append(f"{op}{term}={total:+03d}")
    return "".join(steps) + f"\n#### {total}"


def teacher_trace(problem, noise, rng, slip=0.0, max_lines=0):
    """The SFT target: the task's reference trace, except that with probability `noise` the teacher
    ends on the value it looked up last instead of the running sum ("a=7>7 b=2>9 #2" instead of
    "#9"). An imperfect teacher with the wrong answer convention: the warm start learns the mix, and
    RL must find from the verifier's reward alone which ending is right (the most common early win
    of RLVR in practice). `slip` (order "marked"): on each step whose running sum crosses 10, with
    that probability the teacher adds the carry into the units digit and carries on from its own
    wrong total ("7>7,5>3." instead of "7>7,5>2."): a weak learner's slip, which comes with the
    input and compounds along the chain; order "lagged": see tasks.lagged_trace."""
    if problem.task == "reasoning_gym":  # config.TEACHER_TASKS: chain_sum, exact
        return chain_sum_trace(problem)
    if is_lagged(problem.prompt):  # max_lines > 0: at most that many lines (a prefix, no end)
        return lagged_trace(problem.prompt, slip, rng, max_lines)[0]
    if slip > 0:
        items, steps, total = problem.prompt.strip().partition("?")[0], [], 0
        for i in range(0, len(items), 4):  # "k=v," items (tasks._make_marked)
            v, sep = int(items[i + 2]), items[i + 3]
            total = (total + v + 1) % 10 if total + v >= 10 and rng.random() < slip else (
                (total + v) % 10)
            steps.append(f"{v}>{total}{sep}")
            if sep == ".":
                return "".join(steps) + f"#{total}"
    trace = synthetic_trace(problem)
    if rng.random() < noise:
        body, _, _ = trace.rpartition(" #")
        trace = f"{body} #{body.split(' ')[-1].split('=')[1].split('>')[0]}"
    return trace


def sft_target(tok, problem, cfg, rng):
    """The token ids SFT trains on for one problem: the teacher's trace and EOS, or no EOS where the
    trace is a prefix (a lagged trace cut at sft_max_lines: no "#" ending)."""
    trace = teacher_trace(problem, cfg.sft_noise, rng, cfg.sft_slip, cfg.sft_max_lines)
    end = [tok.eos_token_id] if "#" in trace else []
    return tok.encode(trace, add_special_tokens=False) + end


def sft_key(cfg):
    """Everything that shapes the warm start, and nothing else: the cache's key."""
    key = {k: getattr(cfg, k) for k in ("n_layer", "n_embd", "n_head", "n_kv_head", "ffn",
                                        "order", "sft_steps", "sft_batch", "sft_lr", "sft_noise",
                                        "sft_init")}
    key.update(seed=sft_seed(cfg))
    if cfg.sft_slip:  # likewise: a run without the slip keeps its key
        key.update(sft_slip=cfg.sft_slip)
    if cfg.sft_max_lines:
        key.update(sft_max_lines=cfg.sft_max_lines)
    if cfg.task != "synthetic":  # a reasoning-gym task: its SFT data (the synthetic key stays)
        key.update(task=cfg.task, rg_prompt=cfg.rg_prompt,
                   rg_kwargs={**cfg.rg_kwargs, **cfg.sft_rg_kwargs})
    if cfg.n_expert:  # only MoE keys where they apply: a dense model's cache keeps its key
        key.update(n_expert=cfg.n_expert, n_expert_active=cfg.n_expert_active, moe_ffn=cfg.moe_ffn)
    return json.loads(json.dumps({**key, "sft_difficulty": cfg.sft_difficulty or cfg.difficulty}))


def cache_path(cfg):
    """Where the warm start of `cfg` is cached: out_dir's parent/warmstart-cache/<hash of its key>,
    so every run under out/ with the same SFT settings shares one, whatever its out_dir."""
    digest = hashlib.sha1(json.dumps(sft_key(cfg), sort_keys=True).encode()).hexdigest()[:12]
    parent = os.path.dirname(os.path.abspath(cfg.out_dir))
    return os.path.join(parent, "warmstart-cache", f"sft-{digest}")


def warm_start(cfg, tok, dev, log, rank=0):
    """The tiny model's starting point: SFT on the synthetic task's reference traces, cached by its
    key (cache_path): changing the model or the SFT settings builds a new one, changing anything
    else (the RL settings, the out_dir) reuses it."""
    key, path = sft_key(cfg), cache_path(cfg)
    try:
        with open(os.path.join(path, "sft_key.json")) as f:
            if json.load(f) == key:
                log(f"warm start: loading the cached SFT model from {path}")
                return Transformer.from_pretrained(path, device=dev)
    except FileNotFoundError:
        pass
    torch.manual_seed(sft_seed(cfg))
    if cfg.sft_init.endswith(".py"):
        # a curriculum: that config's warm start (built or cached) first, then this SFT
        model = warm_start(parse_config([cfg.sft_init, f"--seed={sft_seed(cfg)}"]), tok, dev, log,
                           rank)
    elif cfg.sft_init:  # or any checkpoint of the same tokenizer
        model = Transformer.from_pretrained(cfg.sft_init, device=dev)
    else:
        model = Transformer(tiny_model_config(cfg, tok)).to(dev)
    want, got = tiny_model_config(cfg, tok), model.config
    diff = [f"{k} {getattr(got, k)} (want {getattr(want, k)})" for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "num_experts", "num_experts_per_tok")
        if getattr(got, k) != getattr(want, k)]
    if diff:
        raise ValueError(f"config key 'sft_init' ({cfg.sft_init}): its model differs from this "
                         f"config's: {', '.join(diff)}")
    data = sft_problems(cfg)  # SFT's range may differ from RL's
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(sft_seed(cfg))
    log(f"warm start: SFT of a {model.num_params() / 1e6:.2f}M-parameter model for {cfg.sft_steps} "
        f"steps")
    bar = rank == 0 and sys.stderr.isatty()  # in a file a bar is one endless line: a terminal only
    for step in tqdm(range(cfg.sft_steps), desc="sft", disable=not bar, dynamic_ncols=True):
        batch = data[step * cfg.sft_batch:(step + 1) * cfg.sft_batch]
        p_ids = [tok.encode(p.prompt, add_special_tokens=False) for p in batch]
        c_ids = [torch.tensor(sft_target(tok, p, cfg, rng)) for p in batch]
        ids, tmask = build_batch(p_ids, c_ids,
                                 [torch.ones(len(c), dtype=torch.bool) for c in c_ids],
                                 tok.pad_token_id)
        ids, tmask = ids.to(dev), tmask.to(dev)
        # 50 steps of linear warmup, then cosine to 0
        lr = (cfg.sft_lr * min(1.0, (step + 1) / 50)
              * (0.5 * (1 + math.cos(math.pi * step / cfg.sft_steps))))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = -token_logprobs(model, ids, tmask)[tmask].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if not bar and (step + 1) % max(1, cfg.sft_steps // 10) == 0:  # no bar: a line each tenth
            log(f"warm start: step {step + 1}/{cfg.sft_steps}, loss {loss.item():.4f}")
    log(f"warm start: final SFT loss {loss.item():.4f}")

    def write(d):
        model.save_pretrained(d)
        tok.save_pretrained(d)
        with open(os.path.join(d, "sft_key.json"), "w") as f:
            json.dump(key, f)

    save_atomic(path, write)
    return model


def build_policy(cfg, dev, log, rank=0, world=1):
    """-> (model, tokenizer). Real models come from a checkpoint; the tiny one from its warm start,
    which rank 0 builds (or finds cached) and the other ranks then read."""
    if cfg.model:
        tok = AutoTokenizer.from_pretrained(cfg.model)
        model = Transformer.from_pretrained(cfg.model, device=dev)
    else:
        tok = build_char_tokenizer(os.path.join(cfg.out_dir, "tokenizer"))
        if rank == 0:
            model = warm_start(cfg, tok, dev, log, rank)
        if world > 1:
            torch.distributed.barrier()  # rank 0 built the warm start; the others read it
        if rank != 0:
            model = Transformer.from_pretrained(cache_path(cfg), device=dev)
        # RoPE needs no table: a cached warm start serves a config that generates longer
        model.config.max_position_embeddings = tiny_model_config(cfg, tok).max_position_embeddings
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.to(getattr(torch, cfg.dtype)), tok
