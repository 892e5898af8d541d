"""
bench/demo.py: does the embedded default's RL do more than cheaper ways to spend the same rollouts?
For each seed, from the same warm start, three arms, each scored greedy on the same held-out
problems per difficulty:

    RL        `python train.py --seed=S` (the default run itself);
    RFT       rejection-sampling fine-tuning: as many rollouts as the RL run generated, sampled
              from the warm start at the rollout temperature on the same pool, and SFT on the
              correct ones;
    more SFT  the warm start trained further on as many teacher tokens as the RL run generated, on
              fresh problems of its own SFT range, from the same teacher.

    python -m bench demo --threads 1          # 3 seeds: about 36 minutes at 1 thread
    python -m bench demo --quick              # seed 0, a few steps: a smoke run

Simplifications:
    1. RFT and more SFT take the RL run's optimizer (AdamW, lr = `lr`, the same betas and weight
       decay) and its number of optimizer steps, with a linear warmup of `warmup_steps` and then a
       constant rate; RFT's batch is the RL step's (prompts_per_step x group_size rows, cycling over
       the correct samples), more SFT's is `sft_batch` rows, for as many steps as its token budget
       takes.
    2. RFT keeps a sample when the cascade scores it 1 (the RL reward of a correct answer) and it
       ended on EOS: the same completions RL gives credit to.
    3. "Beyond the SFT range" is the mean over held-out difficulties above `sft_difficulty`'s top,
       each difficulty weighted alike; mean and spread (sample standard deviation) are over seeds.
"""

import random
import statistics
import tempfile

import torch

import heldout
import parallel
import train
from bench.common import hardware
from config import parse_config
from tasks import make_synthetic
from update import build_batch, token_logprobs
from warmstart import sft_target

ARGS = {True: ["--steps=4", "--sft_steps=60", "--n_eval=40", "--eval_sampled=false"],
        False: []}


def fresh_run(argv):
    """The config and a built Run: the warm start, its pool, held-out set, engines, optimizer."""
    cfg = parse_config(argv)
    _, _, dev = parallel.setup_dist(cfg)
    return cfg, train.build(cfg, 0, 1, dev, parallel.split_roles(cfg, 0, 1), lambda s: None)


def sft_steps(cfg, run, batches):
    """Optimizer steps on (prompt ids, completion ids) batches, at the RL run's rate."""
    for step, batch in enumerate(batches):
        for g in run.opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
        c = [torch.tensor(x) for _, x in batch]
        ids, tmask = build_batch([p for p, _ in batch], c,
                                 [torch.ones(len(x), dtype=torch.bool) for x in c],
                                 run.tok.pad_token_id)
        run.model.train()
        loss = -token_logprobs(run.model, ids, tmask)[tmask].mean()
        run.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
        run.opt.step()
        run.model.eval()


def rft(cfg, run, rollouts, steps, seed):
    """Sample `rollouts` completions from the warm start, keep the correct ones, SFT on them."""
    rng, kept, pool = random.Random(seed), [], run.sampler.problems  # the pool, as train_ids
    G, chunk = cfg.group_size, 32
    picks = [rng.randrange(len(run.train_ids)) for _ in range(-(-rollouts // G))]
    for a in range(0, len(picks), chunk):
        idx = picks[a:a + chunk]
        with torch.no_grad():
            ro = run.sparse.engine.generate([run.train_ids[i] for i in idx], G, seed=seed + a)
        res = run.cascade.score_batch([pool[i] for i in idx for _ in range(G)], ro.texts,
                                      group_size=G, finish=ro.finish)
        for j, (r, fin) in enumerate(zip(res.rewards, ro.finish)):
            if r >= 1.0 and fin == "eos":
                comp = ro.tokens[j][ro.mask[j]].tolist() + [run.tok.eos_token_id]
                kept.append((run.train_ids[idx[j // G]], comp))
    rng.shuffle(kept)
    rows = cfg.prompts_per_step * G
    if kept:  # none correct: nothing to train on, the warm start stands
        sft_steps(cfg, run, [[kept[(s * rows + i) % len(kept)] for i in range(rows)]
                             for s in range(steps)])
    return len(kept)


def more_sft(cfg, run, tokens, seed):
    """The warm start's own SFT, continued on fresh teacher traces up to `tokens` completion
    tokens."""
    rng = random.Random(seed)
    rows, n = [], 0
    for p in make_synthetic(tokens // 8 + 64, seed + 30_000,  # a trace is 9 or more tokens
                            cfg.sft_difficulty or cfg.difficulty, cfg.order):
        if n >= tokens:
            break
        c = sft_target(run.tok, p, cfg, rng)
        rows.append((run.tok.encode(p.prompt, add_special_tokens=False), c))
        n += len(c)
    b = cfg.sft_batch
    sft_steps(cfg, run, [rows[i:i + b] for i in range(0, len(rows), b)])
    return n


def beyond(cfg, accs):
    """Mean accuracy over the held-out difficulties above the SFT range (None if there are none)."""
    top = (cfg.sft_difficulty or cfg.difficulty)[1]
    over = [a for d, a in accs.items() if int(d) > top]
    return sum(over) / len(over) if over else None


def one_seed(seed, quick, root):
    """{arm: {difficulty: greedy accuracy}} for one seed, and what the RL run spent."""
    argv = [f"--seed={seed}", f"--out_dir={root}/s{seed}", "--plot=false"] + ARGS[quick]
    history = train.main(argv)
    recs = history["records"]
    rollouts, tokens = sum(r["rollouts"] for r in recs), sum(r["new_tokens"] for r in recs)
    accs = {"warm start": history["start"]["greedy"],
            "RL": {int(d): a for d, a in recs[-1]["acc_by_difficulty"].items()}}
    cfg, run = fresh_run(argv)
    kept = rft(cfg, run, rollouts, len(recs), seed)
    accs["RFT"] = heldout.evaluate(cfg, run)[1]
    cfg, run = fresh_run(argv)
    sft_tokens = more_sft(cfg, run, tokens, seed)
    accs["more SFT"] = heldout.evaluate(cfg, run)[1]
    return cfg, accs, {"rollouts": rollouts, "tokens": tokens, "rft_kept": kept,
                       "sft_tokens": sft_tokens}


def spread(xs):
    m = statistics.mean(xs)
    return f"{m:.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{m:.3f}"


def run(quick, cmd):
    """-> the table, head included."""
    seeds = (0,) if quick else (0, 1, 2)
    root = tempfile.mkdtemp(prefix="zeros-bench-demo-")
    results = [one_seed(s, quick, root) for s in seeds]
    cfg = results[0][0]
    arms = ("warm start", "RL", "RFT", "more SFT")
    diffs = sorted({int(d) for _, a, _ in results for d in a["warm start"]})
    lo, hi = cfg.sft_difficulty or cfg.difficulty
    spent = results[0][2]
    lines = [f"Hardware: {hardware()}. Command: `{cmd}`. Seeds {', '.join(map(str, seeds))}; "
             f"SFT range {lo}-{hi}, RL range {cfg.difficulty[0]}-{cfg.difficulty[1]}; held-out "
             f"greedy accuracy, mean ± spread over seeds. Seed {seeds[0]}'s RL run generated "
             f"{spent['rollouts']} rollouts ({spent['tokens']} tokens); RFT kept "
             f"{spent['rft_kept']} correct ones; more SFT trained on {spent['sft_tokens']} "
             f"teacher tokens.", "",
             "| arm | beyond the SFT range | " + " | ".join(f"d={d}" for d in diffs) + " |",
             "|---|---|" + "---|" * len(diffs)]
    for arm in arms:
        b = [beyond(cfg, a[arm]) for _, a, _ in results]
        cells = [spread([a[arm].get(d, a[arm].get(str(d), 0.0)) for _, a, _ in results])
                 for d in diffs]
        lines.append(f"| {arm} | {spread(b) if None not in b else 'n/a'} | "
                     + " | ".join(cells) + " |")
    gain = [beyond(cfg, a["RL"]) - beyond(cfg, a["warm start"]) for _, a, _ in results
            if beyond(cfg, a["RL"]) is not None]
    if gain:
        lines += ["", f"RL's gain beyond the SFT range: {spread(gain)} (points x 100: "
                      f"{100 * statistics.mean(gain):+.1f}); per seed "
                      + ", ".join(f"{g:+.3f}" for g in gain) + "."]
    return lines
