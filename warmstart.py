"""
warmstart.py: where the policy starts. A real model comes from its checkpoint (a hub name or a local
Hugging Face folder); the embedded default's tiny model is trained here first, by SFT on the
synthetic task's traces.

    python train.py                     # builds the warm start (minutes on 2 cores), then RL
    python train.py --out_dir=out/try2  # reuses it: out/warmstart-cache/sft-<hash of its settings>
    python train.py configs/longcot.py  # a curriculum: tiny's warm start first, then longer chains
    ZEROS_CACHE=/data/ws python train.py  # the cache in another folder (any out_dir shares it)

What it does:
    1. build_policy: the tokenizer and the model, in the config's dtype. Before anything slow (a
       download, the warm start) it checks that they and the task's data can be had (check_model,
       check_data): a local --model folder or --data file that does not exist, a Hub model
       neither cached nor reachable, or a Hub dataset that cannot be fetched (no network; in
       offline mode, HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, not in the datasets cache) is one
       line, at once, instead of a minute of retries and a traceback. A dataset task (gsm8k, math,
       code) without --model trains the tiny character model, and the log says so.
    2. warm_start: SFT from scratch (or from sft_init: a checkpoint, or another config's warm start)
       on teacher traces (the synthetic task's, or reasoning-gym chain_sum's and string_splitting's:
       chain_sum_trace, string_splitting_trace),
       cached under a key of every setting that shapes it (cache_path: sft-<hash of the key> in
       one folder, cache_root: $ZEROS_CACHE if set, else out/warmstart-cache in the repository),
       so every run shares it whatever its out_dir; a change of any of those settings builds a
       new one. Its log gives the elapsed time and an estimate of the time left. An interrupted
       build resumes: every PROGRESS_EVERY_S seconds it writes its state (weights, optimizer,
       RNGs, step) to sft-<hash>.progress.pt beside the entry (atomically: a new file renamed
       over the old), and the next build of the same key continues from there; the file is
       removed once the entry is written.

Simplifications:
    1. The teacher is the task's reference trace, with an optional planted error (sft_noise, see
       teacher_trace) or, on order "marked", "lagged" and string_splitting, an optional slip at one
       kind of step (sft_slip). On reasoning-gym's chain_sum it is exact: every line of its trace
       holds; on string_splitting too, unless sft_slip is set.
    2. The SFT loop is plain: one AdamW, warmup then cosine over sft_steps, no packing, no
       evaluation. With sft_loss it stops at that loss (the mean of the last SFT_WINDOW steps)
       or at sft_steps, whichever comes first, and the entry records which (sft_fit.json).
    3. On a CPU, while a kernel build that train.py started is under way (a fresh machine's
       first run), SFT runs on one thread and leaves the other cores to the compiler; then on
       all of them again. Its sums split alike at 1 and 2 threads (the weights after 100 steps
       agree to the bit on the CPU we checked), so the warm start does not depend on it.
    4. "The Hub can be reached" is a TCP connection to its host within 3 seconds (hub_reachable;
       through a proxy it is assumed). Without a network a Hub dataset is read from the cache only
       in datasets' offline mode (HF_DATASETS_OFFLINE=1), which the error says; a Hub model is
       looked up in the cache either way.
"""

import collections
import hashlib
import inspect
import itertools
import json
import math
import os
import random
import re
import socket
import sys
import time
from urllib.parse import urlparse

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from checkpoint import save_atomic
from config import parse_config
from model import ModelConfig, Transformer
from tasks import (ALIGN, build_char_tokenizer, end_ids, is_lagged, lagged_trace, load_gsm8k,
                   load_math, load_mbpp, sft_problems, sft_seed, synthetic_trace)
from update import build_batch, token_logprobs
from zeros_kernels.cpu_ext import building

ROOT = os.path.dirname(os.path.abspath(__file__))
PROGRESS_EVERY_S = 60.0  # how often an SFT in progress saves what it has done (seconds)
LOG_EVERY_S = 60.0  # a progress line at least this often (and at every tenth of the steps)
SFT_WINDOW = 50  # sft_loss: SFT stops once the mean loss of this many last steps reaches it
DATASETS = {"gsm8k": load_gsm8k, "math": load_math, "code": load_mbpp}  # tasks with a data source
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")  # "Qwen/Qwen3-0.6B"


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
    """reasoning-gym chain_sum's exact trace, written from the item's metadata (its expression).
    On an aligned prompt (tasks.aligned_prompt, the default's) the running total after each term,
    signed in a cell of ALIGN characters, the prompt's cell size, so step k reads term k at one
    distance: "+7  -3  +5  +9  ...=" -> "+007+004+009+018\n#### 18". Otherwise the first term,
    then each step's operator and next term and the running total, every total signed and in two
    digits so that a digit always sits at the same place in its step; the answer follows "####":
    "63 - 15 + 43" -> "+063-15=+048+43=+091\n#### 91". A step reads the total it has just written
    and one term of the prompt, the same step at any number of terms; the totals a long chain
    reaches (past 200, below -100) are what short ones rarely show."""
    expr = problem.meta["entry"]["metadata"]["expression"].split()  # "63", "-", "15", ...
    if problem.prompt.endswith(" ="):  # aligned: the totals alone, one cell a step
        totals = list(itertools.accumulate(int(t) if op == "+" else -int(t)
                                           for op, t in zip(["+"] + expr[1::2], expr[::2])))
        return "".join(f"{t:+0{ALIGN}d}" for t in totals) + f"\n#### {totals[-1]}"
    total = int(expr[0])
    steps = [f"{total:+03d}"]
    for op, term in zip(expr[1::2], expr[2::2]):
        total += int(term) if op == "+" else -int(term)
        steps.append(f"{op}{term}={total:+03d}")
    return "".join(steps) + f"\n#### {total}"


def string_splitting_trace(problem, max_lines=0, slip=0.0, rng=None):
    """reasoning-gym string_splitting's exact trace, from the item's metadata (its states): one
    line a state, the rule that made it (0 for the start), then the counts of A B C X Y Z, each in
    at least two digits so that a digit sits at the same place on every line; the answer follows
    "####" in the library's form:
    "0 03 03 00 00 00 00\n1 02 03 00 02 01 00\n...\n#### 0 1 0 4 0 3". Every line follows from
    the one above it by the first rule that applies (a rule is read off the change it made), so
    past the first line, which reads the prompt's counts, a token needs only the last 20 or so: a
    long chain of local steps. max_lines > 0: at most that many lines (a prefix, no end).
    `slip` (the warm start's teacher): each time rule 5 takes Z from 09 to 10, with that chance
    the teacher drops the carry and writes 00, then carries on from its own wrong state by the
    rules (splitting_states): a weak learner's slip at one kind of step, which RL can remove."""
    states = problem.meta["entry"]["metadata"]["states"]
    if slip:
        states = splitting_states(states[0], slip, rng)
    lines = []
    for prev, now in zip([None] + states[:-1], states):
        rule = 0 if prev is None else _splitting_rule(prev, now)
        lines.append(" ".join([str(rule)] + [f"{v:02d}" for v in now]))
    if 0 < max_lines < len(lines):  # sft_max_lines: a prefix, no "####" ending (and no EOS)
        return "\n".join(lines[:max_lines]) + "\n"
    return "\n".join(lines) + "\n#### " + " ".join(map(str, states[-1]))


# string_splitting's five rules in order, each the change it makes to the counts A B C X Y Z: A ->
# 2X + Y, 2B -> X, 2C -> Y, B + C -> A, X + Y -> Z. A rule applies where no count goes below 0
SPLITTING_RULES = ((-1, 0, 0, 2, 1, 0), (0, -2, 0, 1, 0, 0), (0, 0, -2, 0, 1, 0),
                   (1, -1, -1, 0, 0, 0), (0, 0, 0, -1, -1, 1))
SLIPPED = (0, 0, 0, -1, -1, -9)  # rule 5 with Z's carry from 9 to 10 dropped (the teacher's slip)


def splitting_states(start, slip=0.0, rng=None):
    """reasoning-gym string_splitting's states from the counts `start` (A B C X Y Z): the first of
    the rules that applies, until none does; with `slip`, rule 5's carry from Z = 9 to 10 is
    dropped (Z written 0) with that chance (string_splitting_trace)."""
    states = [list(start)]
    while True:
        s = states[-1]
        rule = next((d for d in SPLITTING_RULES if all(v + dv >= 0 for v, dv in zip(s, d))), None)
        if rule is None:
            return states
        if rule == SPLITTING_RULES[4] and s[5] == 9 and slip and rng.random() < slip:
            rule = SLIPPED
        states.append([v + dv for v, dv in zip(s, rule)])


def _splitting_rule(prev, now):
    """Which of string_splitting's five rules turned the counts prev into now (A B C X Y Z)."""
    delta = tuple(b - a for a, b in zip(prev, now))
    rules = {d: i + 1 for i, d in enumerate(SPLITTING_RULES)} | {SLIPPED: 5}
    if delta not in rules:
        raise ValueError(f"string_splitting: no rule turns {prev} into {now}")
    return rules[delta]


def teacher_trace(problem, noise, rng, slip=0.0, max_lines=0):
    """The SFT target: the task's reference trace, except that with probability `noise` the teacher
    ends on the value it looked up last instead of the running sum ("a=7>7 b=2>9 #2" instead of
    "#9"). An imperfect teacher with the wrong answer convention: the warm start learns the mix, and
    RL must find from the verifier's reward alone which ending is right (the most common early win
    of RLVR in practice). `slip` (order "marked"): on each step whose running sum crosses 10, with
    that probability the teacher adds the carry into the units digit and carries on from its own
    wrong total ("7>7,5>3." instead of "7>7,5>2."): a weak learner's slip, which comes with the
    input and compounds along the chain; order "lagged": see tasks.lagged_trace; string_splitting:
    see string_splitting_trace."""
    if problem.task == "reasoning_gym":  # config.TEACHER_TASKS: exact traces (or a planted slip)
        if problem.meta["rg_name"] == "string_splitting":
            return string_splitting_trace(problem, max_lines, slip, rng)
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


def first_stage(cfg):
    """A curriculum's first stage: the config file sft_init names, at this warm start's seed."""
    return parse_config([cfg.sft_init, f"--seed={sft_seed(cfg)}"])


def sft_key(cfg):
    """Everything that shapes the warm start, and nothing else: the cache's key."""
    key = {k: getattr(cfg, k) for k in ("n_layer", "n_embd", "n_head", "n_kv_head", "ffn",
                                        "order", "sft_steps", "sft_batch", "sft_lr", "sft_noise",
                                        "sft_init")}
    key.update(seed=sft_seed(cfg))
    if cfg.sft_loss:  # sft_steps is then a cap; a run without a target keeps its key
        key.update(sft_loss=cfg.sft_loss, sft_window=SFT_WINDOW)
    if cfg.sft_slip:  # likewise: a run without the slip keeps its key
        key.update(sft_slip=cfg.sft_slip)
    if cfg.sft_max_lines:
        key.update(sft_max_lines=cfg.sft_max_lines)
    if cfg.task != "synthetic":  # a reasoning-gym task: its SFT data (the synthetic key stays)
        key.update(task=cfg.task, rg_prompt=cfg.rg_prompt,
                   rg_kwargs={**cfg.rg_kwargs, **cfg.sft_rg_kwargs})
    if cfg.sft_init.endswith(".py"):  # a curriculum: its first stage's own key, so that a change
        # there (its steps, its slip) builds this stage anew instead of reusing a stale cache
        key.update(sft_init={"config": cfg.sft_init, "key": sft_key(first_stage(cfg))})
    if cfg.n_expert:  # only MoE keys where they apply: a dense model's cache keeps its key
        key.update(n_expert=cfg.n_expert, n_expert_active=cfg.n_expert_active, moe_ffn=cfg.moe_ffn)
    return json.loads(json.dumps({**key, "sft_difficulty": cfg.sft_difficulty or cfg.difficulty}))


def cache_root():
    """The warm-start cache folder: $ZEROS_CACHE if set, else out/warmstart-cache in the
    repository, wherever the run's out_dir is."""
    return os.path.abspath(os.environ.get("ZEROS_CACHE") or
                           os.path.join(ROOT, "out", "warmstart-cache"))


def cache_path(cfg):
    """Where the warm start of `cfg` is cached: cache_root()/sft-<hash of its key>, so every run
    with the same SFT settings shares one, whatever its out_dir."""
    digest = hashlib.sha1(json.dumps(sft_key(cfg), sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(cache_root(), f"sft-{digest}")


def progress_path(path):
    """An SFT in progress, beside the entry it will write: sft-<hash>.progress.pt."""
    return path + ".progress.pt"


def save_progress(file, key, step, model, opt, rng):
    """The state of an SFT after `step` steps, to a new file renamed over the old: a kill at any
    moment leaves the old complete file or the new one."""
    state = dict(key=key, step=step, model=model.state_dict(), opt=opt.state_dict(),
                 rng=rng.getstate(), torch_rng=torch.get_rng_state())
    os.makedirs(os.path.dirname(file), exist_ok=True)
    torch.save(state, file + ".tmp")
    with open(file + ".tmp", "rb") as f:
        os.fsync(f.fileno())
    os.replace(file + ".tmp", file)


def load_progress(file, key, model, opt, rng, dev, log):
    """Restore what save_progress wrote for this key -> the steps done (0: none to resume)."""
    try:
        state = torch.load(file, map_location=dev, weights_only=True)
    except FileNotFoundError:
        return 0
    except Exception as e:  # a damaged file costs the steps it held, nothing else
        log(f"warm start: starting over, {file} is unreadable ({type(e).__name__}: {e})")
        return 0
    if state.get("key") != key:
        return 0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
    torch.set_rng_state(state["torch_rng"].cpu())
    log(f"warm start: resuming the interrupted SFT at step {state['step']} from {file}")
    return state["step"]


def duration(s):
    """Seconds -> "45s", "3m07s", "1h02m"."""
    s = int(round(s))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else (
        f"{s // 3600}h{s % 3600 // 60:02d}m")


def warm_start(cfg, tok, dev, log, rank=0):
    """The tiny model's starting point: SFT on the synthetic task's reference traces, cached by its
    key (cache_path): changing the model or the SFT settings builds a new one, changing anything
    else (the RL settings, the out_dir) reuses it."""
    key, path = sft_key(cfg), cache_path(cfg)
    try:
        with open(os.path.join(path, "sft_key.json")) as f:
            if json.load(f) == key:
                log(f"warm start: loading the cached SFT model from {path}"
                    + "".join(f" ({fit_text(r)})" for r in [fit(path)] if r))
                return Transformer.from_pretrained(path, device=dev)
    except FileNotFoundError:
        pass
    torch.manual_seed(sft_seed(cfg))
    if cfg.sft_init.endswith(".py"):
        # a curriculum: that config's warm start (built or cached) first, then this SFT
        model = warm_start(first_stage(cfg), tok, dev, log,
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
    result = sft(cfg, model, tok, dev, log, rank, key, path)

    def write(d):
        model.save_pretrained(d)
        tok.save_pretrained(d)
        with open(os.path.join(d, "sft_key.json"), "w") as f:
            json.dump(key, f)
        with open(os.path.join(d, "sft_fit.json"), "w") as f:
            json.dump(result, f)

    save_atomic(path, write)
    if os.path.exists(progress_path(path)):  # the entry supersedes it
        os.remove(progress_path(path))
    return model


def fit(path):
    """What the cached warm start in `path` reached (sft_fit.json): {"steps", "loss", "target",
    "reached"}, or None for an entry written before it was recorded."""
    try:
        with open(os.path.join(path, "sft_fit.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def fit_text(r):
    """sft_fit.json as the log says it."""
    loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
    if not r["target"]:
        return f"{r['steps']} steps, final loss {loss}"
    return (f"loss {loss} (mean of the last {SFT_WINDOW} steps) "
            + (f"reached the target {r['target']:g} at step {r['steps']}" if r["reached"] else
               f"still above the target {r['target']:g} at the cap, {r['steps']} steps"))


def sft(cfg, model, tok, dev, log, rank, key, path):
    """The SFT loop, in place: from the progress file of an interrupted build of the same key if
    there is one, saving its own every PROGRESS_EVERY_S seconds; a line each tenth of the steps
    (and at least every LOG_EVERY_S seconds) with the time spent and an estimate of the time
    left. With sft_loss, it stops once the mean loss of the last SFT_WINDOW steps is at or below
    it (sft_steps the cap). -> {"steps", "loss", "target", "reached"} (sft_fit.json)."""
    data = sft_problems(cfg)  # SFT's range may differ from RL's
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(sft_seed(cfg))
    file, n = progress_path(path), cfg.sft_steps
    start = load_progress(file, key, model, opt, rng, dev, log)
    until = f"until its loss is {cfg.sft_loss:g}, at most {n} steps" if cfg.sft_loss else (
        f"for {n} steps")
    log(f"warm start: SFT of a {model.num_params() / 1e6:.2f}M-parameter model {until}"
        + (f", from step {start}" if start else "") + f", to be cached in {path}")
    bar = rank == 0 and sys.stderr.isatty()  # in a file a bar is one endless line: a terminal only
    t0 = shown = saved = time.perf_counter()
    loss, recent, done = None, collections.deque(maxlen=SFT_WINDOW), start
    threads = torch.get_num_threads()
    for step in tqdm(range(start, n), desc="sft", disable=not bar, dynamic_ncols=True,
                     initial=start, total=n):
        if threads > 1 and dev.type == "cpu":  # a core for a kernel's build (simplification 3)
            torch.set_num_threads(1 if building() else threads)
        batch = data[step * cfg.sft_batch:(step + 1) * cfg.sft_batch]
        p_ids = [tok.encode(p.prompt, add_special_tokens=False) for p in batch]
        c_ids = [torch.tensor(sft_target(tok, p, cfg, rng)) for p in batch]
        ids, tmask = build_batch(p_ids, c_ids,
                                 [torch.ones(len(c), dtype=torch.bool) for c in c_ids],
                                 tok.pad_token_id)
        ids, tmask = ids.to(dev), tmask.to(dev)
        # 50 steps of linear warmup, then cosine to 0
        lr = cfg.sft_lr * min(1.0, (step + 1) / 50) * (0.5 * (1 + math.cos(math.pi * step / n)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = -token_logprobs(model, ids, tmask)[tmask].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent.append(loss.item())
        done = step + 1
        if cfg.sft_loss and len(recent) == SFT_WINDOW and sum(recent) / SFT_WINDOW <= cfg.sft_loss:
            break
        now = time.perf_counter()
        if step + 1 < n and now - saved >= PROGRESS_EVERY_S:
            save_progress(file, key, step + 1, model, opt, rng)
            saved = now
        if not bar and ((step + 1) % max(1, n // 10) == 0 or now - shown >= LOG_EVERY_S):
            left = (now - t0) / (step + 1 - start) * (n - step - 1)
            log(f"warm start: step {step + 1}/{n}, loss {loss.item():.4f} (mean of the last "
                f"{len(recent)}: {sum(recent) / len(recent):.4f}), {duration(now - t0)} elapsed, "
                f"{'at most' if cfg.sft_loss else 'about'} {duration(left)} left")
            shown = now
    torch.set_num_threads(threads)
    mean = sum(recent) / len(recent) if recent else None
    result = {"steps": done, "loss": mean if cfg.sft_loss else loss and loss.item(),
              "target": cfg.sft_loss,
              "reached": bool(cfg.sft_loss) and mean is not None and mean <= cfg.sft_loss}
    log(f"warm start: {fit_text(result)}")
    return result


# ----------------------------------------------------------------------------- before the build


def offline_mode():
    """The offline switch of huggingface_hub, datasets or transformers is on."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in OFFLINE_VARS)


def hub_reachable(timeout=3.0):
    """A TCP connection to the Hub's host (HF_ENDPOINT, default huggingface.co) opens within
    `timeout` seconds. Through a proxy (HTTPS_PROXY, ALL_PROXY) the download is left to try."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout).close()
        return True
    except OSError:
        return False


def hub_state():
    """Why the Hub cannot be used now ("offline mode is on", "... cannot be reached"), or ""."""
    if offline_mode():
        return f"offline mode is on ({', '.join(v for v in OFFLINE_VARS if os.environ.get(v))})"
    if not hub_reachable():
        host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
        return f"the Hugging Face Hub ({host}) cannot be reached"
    return ""


def looks_like_path(name):
    """A local path rather than a Hub id ("org/name"): it starts with / . or ~, or has a path
    separator and is not of the Hub's form."""
    return name.startswith(("/", ".", "~")) or (
        (os.sep in name or "/" in name) and not HUB_ID.fullmatch(name))


def check_model(name):
    """-> where to load config key 'model' from: the local folder, the Hub id (the Hub is
    reachable), or its copy in the Hugging Face cache (the Hub is not). FileNotFoundError, one line,
    for a local path that does not exist or holds no model, or a Hub id neither cached nor
    reachable."""
    if os.path.isdir(name):
        if not os.path.exists(os.path.join(name, "config.json")):
            raise FileNotFoundError(f"config key 'model': {name} is a folder but not a model "
                                    f"folder (it has no config.json)")
        return name
    if looks_like_path(name):
        what = "is a file, not a model folder" if os.path.exists(name) else "does not exist"
        raise FileNotFoundError(f"config key 'model': the local folder {name} {what}")
    why = hub_state()
    if not why:
        return name
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(name, local_files_only=True)
    except Exception:  # not in the cache, whichever way huggingface_hub says it
        raise FileNotFoundError(
            f"config key 'model': {name} is not a local folder nor in the Hugging Face cache, and "
            f"{why}: run once with a network to download it (later runs can set HF_HUB_OFFLINE=1 "
            f"to read the cache), or give the path of a local model folder") from None


def check_data(cfg):
    """A dataset task's data can be had, before anything slow: a local data file exists; a Hub
    dataset (config key 'data', or the task's default) is reachable, or, in offline mode, cached.
    FileNotFoundError, one line, otherwise."""
    loader = DATASETS.get(cfg.task)
    if loader is None or (cfg.data and os.path.exists(cfg.data)):
        return
    source = cfg.data or inspect.signature(loader).parameters["source"].default
    if looks_like_path(source) or source.endswith((".jsonl", ".json", ".parquet")):
        raise FileNotFoundError(f"config key 'data': the local file {source} does not exist")
    why, fix = hub_state(), (
        f"run once with a network to download it into the datasets cache (then, or if it is there "
        f"already, HF_DATASETS_OFFLINE=1 reads it without a network), or give a local copy: "
        f"--data=FILE.jsonl")
    if why and not offline_mode():
        raise FileNotFoundError(f"task {cfg.task}: dataset {source} cannot be fetched, {why}: "
                                f"{fix}")
    if why:  # offline mode: only the cache can serve it
        try:
            loader(source=source, split="test", limit=1)
        except (ConnectionError, OSError) as e:
            raise FileNotFoundError(f"task {cfg.task}: dataset {source} is not in the datasets "
                                    f"cache and {why}: {fix} ({type(e).__name__})") from None


def build_policy(cfg, dev, log, rank=0, world=1):
    """-> (model, tokenizer). Real models come from a checkpoint; the tiny one from its warm start,
    which rank 0 builds (or finds cached) and the other ranks then read. The model and the task's
    data are checked first (check_model, check_data)."""
    if cfg.task in DATASETS and not cfg.model:
        log(f"task {cfg.task} with no --model: the policy is the tiny character-level model (one "
            f"token per character, warm-started by SFT on the synthetic task), not a pretrained "
            f"LM; --model=Qwen/Qwen3-0.6B (as configs/gsm8k_qwen3.py) trains a real one")
    check_data(cfg)
    if cfg.model:
        src = check_model(cfg.model)
        tok = AutoTokenizer.from_pretrained(src)
        model = Transformer.from_pretrained(src, device=dev)
        # every id that ends a row, the generation config's too (Qwen3: <|endoftext|>, besides the
        # tokenizer's <|im_end|>): the engines read them from model.config
        model.config.eos_token_id = end_ids(tok, src, model.config.eos_token_id)
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
