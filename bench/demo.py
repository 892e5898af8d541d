"""
bench/demo.py: does the embedded default's RL do more than cheaper ways to spend the same budget?
For each seed, from the same warm start, five arms, each scored greedy on the same held-out
problems per difficulty:

    RL        `python train.py --seed=S` (the default run itself);
    RFT       rejection-sampling fine-tuning, iterated as many rounds as RL has steps: each round
              samples as many rollouts as that RL step sent to the verifier (the same verifier
              calls in all), from the current policy at the rollout temperature on the same pool,
              keeps the verified ones and takes one SFT step on them;
    more SFT  the warm start trained further on as many teacher tokens as the RL run generated, on
              fresh problems of its own SFT range, from the same teacher;
    SFT, every bin  the same token budget from the teacher on fresh problems of every held-out
              difficulty: the supervised ceiling, what RL would reach if the teacher covered the
              range it is tested on.
Each arm's verifier calls and wall time (training only: sampling, scoring and optimizer steps; the
held-out evaluation is the same for every arm and left out) are in the table. Where the config
samples its held-out set (eval_sampled, the default: pass@64), a second table asks whether RL goes
past what the warm start could sample: beyond the SFT range, RL's pass@1 beside the warm start's
pass@64 (and RL's own pass@64), per difficulty (past_sampling).

    python -m bench demo --threads 1          # 3 seeds
    python -m bench demo --threads 1 --jobs 3 # the seeds at once, each its own process
    python -m bench demo --quick              # seed 0, a few steps: a smoke run

Simplifications:
    1. RFT and the SFT arms take the RL run's optimizer (AdamW, lr = `lr`, the same betas and
       weight decay), with a linear warmup of `warmup_steps` and then a constant rate. An RFT round
       trains on all its verified samples in one step (none verified: no step, as RL skips a step
       whose groups all tie); the SFT arms' batch is `sft_batch` rows, for as many steps as their
       token budget takes.
    2. RFT keeps a sample when the cascade scores it 1 (the RL reward of a correct answer) and it
       ended on EOS: the same completions RL gives credit to.
    3. "Beyond the SFT range" is the mean over held-out difficulties above the SFT range's top,
       each difficulty weighted alike; mean and spread (sample standard deviation) are over seeds.
    4. The teacher's fresh problems leave out every held-out prompt, so no arm trains on the
       held-out set.
    5. Greedy accuracy counts right answers only (a score of 1, heldout.py), as RFT keeps only
       those; the RL reward keeps reasoning-gym's partial credit.
    6. --jobs N runs N seeds at once, each in a process of its own with --threads threads; the
       seeds' figures are the same as one after another (each seed's warm start and draws are its
       own), their wall seconds are not (the processes share the cores).
"""

import concurrent.futures
import multiprocessing
import random
import statistics
import tempfile
import time

import torch

import heldout
import parallel
import train
from bench.common import hardware
from config import RG_PREFIX, parse_config
from tasks import (CHARS, RG_SPLIT, load_problems, make_reasoning_gym, make_synthetic, rg_width,
                   sft_problems)
from update import build_batch, token_logprobs
from warmstart import sft_target

ARGS = {True: ["--steps=4", "--sft_steps=60", "--eval_per_bin=4", "--eval_sampled=false"],
        False: []}
ARMS = ("warm start", "RL", "RFT", "more SFT", "SFT, every bin")


def fresh_run(argv):
    """The config and a built Run: the warm start, its pool, held-out set, engines, optimizer."""
    cfg = parse_config(argv)
    _, _, dev = parallel.setup_dist(cfg)
    return cfg, train.build(cfg, 0, 1, dev, parallel.split_roles(cfg, 0, 1), lambda s: None)


def sft_steps(cfg, run, batches, first=0):
    """Optimizer steps on (prompt ids, completion ids) batches, at the RL run's rate; `first`: the
    steps taken before, for the warmup."""
    for step, batch in enumerate(batches, start=first):
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


def rft(cfg, run, calls, seed):
    """Iterated RFT: round i samples calls[i] rollouts (groups of group_size on pool prompts drawn
    at random) from the current policy, keeps the verified ones that ended on EOS, takes one SFT
    step on them and refreshes what generates. -> (samples kept, verifier calls made)."""
    rng, pool, G = random.Random(seed), run.sampler.problems, cfg.group_size
    kept_all = made = steps = 0
    for i, n in enumerate(calls):
        idx = [rng.randrange(len(run.train_ids)) for _ in range(-(-n // G))]
        with torch.no_grad():
            ro = run.sparse.engine.generate([run.train_ids[j] for j in idx], G, seed=seed + i)
        res = run.cascade.score_batch([pool[j] for j in idx for _ in range(G)], ro.texts,
                                      group_size=G, finish=ro.finish)
        made += len(res.rewards)
        kept = [(run.train_ids[idx[j // G]], ro.tokens[j][ro.mask[j]].tolist()
                 + [run.tok.eos_token_id])
                for j, (r, fin) in enumerate(zip(res.rewards, ro.finish))
                if r >= 1.0 and fin == "eos"]
        if kept:  # none verified: no step, the policy stands
            sft_steps(cfg, run, [kept], first=steps)
            steps += 1
            train.refresh_rollout(cfg, run)
        kept_all += len(kept)
    return kept_all, made


def fresh_problems(cfg, n, seed, every_bin):
    """n teacher problems drawn from a seed of their own (not the SFT data's, the pool's or the
    held-out set's): of the SFT range, or (every_bin) of the held-out set's whole range."""
    if cfg.task.startswith(RG_PREFIX):
        over = cfg.eval_rg_kwargs if every_bin else cfg.sft_rg_kwargs
        return make_reasoning_gym(cfg.task[len(RG_PREFIX):], n, seed + 3 * RG_SPLIT,
                                  {**cfg.rg_kwargs, **over}, CHARS, cfg.rg_prompt, rg_width(cfg))
    span = (cfg.eval_difficulty if every_bin else cfg.sft_difficulty) or cfg.difficulty
    return make_synthetic(n, seed + 30_000, span, cfg.order)


def more_sft(cfg, run, tokens, seed, every_bin=False):
    """The warm start's own SFT, continued on fresh teacher traces (no held-out prompt among them)
    up to `tokens` completion tokens: of its SFT range, or (every_bin) of every held-out
    difficulty. -> the tokens trained on."""
    rng, held = random.Random(seed), {p.prompt for p in run.eval_p}
    rows, n = [], 0
    for p in fresh_problems(cfg, tokens // 8 + 64, seed, every_bin):  # a trace is 9+ tokens
        if n >= tokens:
            break
        if p.prompt in held:
            continue
        c = sft_target(run.tok, p, cfg, rng)
        rows.append((run.tok.encode(p.prompt, add_special_tokens=False), c))
        n += len(c)
    b = cfg.sft_batch
    sft_steps(cfg, run, [rows[i:i + b] for i in range(0, len(rows), b)])
    return n


def span(problems):
    """(lowest, highest) difficulty among problems (their meta's "difficulty")."""
    ds = [p.meta["difficulty"] for p in problems if "difficulty" in p.meta]
    return min(ds), max(ds)


def beyond(top, accs):
    """Mean accuracy over the held-out difficulties above `top`, the SFT range's highest (None
    if there are none)."""
    over = [a for d, a in accs.items() if int(d) > top]
    return sum(over) / len(over) if over else None


def one_seed(seed, quick, root):
    """{arm: {difficulty: greedy accuracy}} for one seed, and {arm: (verifier calls, seconds)}
    with what the RL run spent."""
    argv = [f"--seed={seed}", f"--out_dir={root}/s{seed}", "--plot=false"] + ARGS[quick]
    history = train.main(argv)
    recs = history["records"]
    calls, tokens = [r["rollouts"] for r in recs], sum(r["new_tokens"] for r in recs)
    accs = {"warm start": history["start"]["greedy"],
            "RL": {int(d): a for d, a in recs[-1]["acc_by_difficulty"].items()}}
    cost = {"RL": (sum(calls), sum(r["collect_s"] + r["train_s"] for r in recs))}
    spent = {"rollouts": sum(calls), "tokens": tokens,  # and the sampled figures, if measured
             "passes": (history["start"], history.get("end", {}))}
    cfg = parse_config(argv)
    spent["ranges"] = span(sft_problems(cfg)), span(load_problems(cfg)[0])  # SFT's, RL's
    for arm in ARMS[2:]:
        cfg, run = fresh_run(argv)  # the warm start again, from its cache
        t0 = time.perf_counter()
        if arm == "RFT":
            spent["rft_kept"], made = rft(cfg, run, calls, seed)
        else:
            spent[arm], made = more_sft(cfg, run, tokens, seed, arm == "SFT, every bin"), 0
        cost[arm] = (made, time.perf_counter() - t0)
        accs[arm] = heldout.evaluate(cfg, run)[1]
    return cfg, accs, cost, spent


def in_processes(fn, items, jobs, *args):
    """[fn(item, *args) for item in items], in order, up to `jobs` at once, each in a process of
    its own at this process's torch threads (spawned: a forked child would inherit torch's thread
    pool); one after another here when jobs <= 1."""
    if jobs <= 1 or len(items) <= 1:
        return [fn(x, *args) for x in items]
    with concurrent.futures.ProcessPoolExecutor(
            min(jobs, len(items)), mp_context=multiprocessing.get_context("spawn"),
            initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)) as pool:
        return list(pool.map(fn, items, *([a] * len(items) for a in args)))


def spread(xs):
    m = statistics.mean(xs)
    return f"{m:.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{m:.3f}"


def run(quick, cmd, jobs=1):
    """-> the table, head included. jobs: seeds run at once, each in its own process."""
    seeds = (0,) if quick else (0, 1, 2)
    root = tempfile.mkdtemp(prefix="zeros-bench-demo-")
    results = in_processes(one_seed, seeds, jobs, quick, root)
    cfg, spent = results[0][0], results[0][3]
    diffs = sorted({int(d) for _, a, _, _ in results for d in a["warm start"]})
    (lo, hi), (rl_lo, rl_hi) = spent["ranges"]
    lines = [f"Hardware: {hardware()}. Command: `{cmd}`. Task {cfg.task}, seeds "
             f"{', '.join(map(str, seeds))}; SFT range {lo}-{hi}, RL range {rl_lo}-{rl_hi}; "
             f"held-out greedy accuracy, mean ± spread over seeds; verifier calls and wall "
             f"seconds (training only), the mean over seeds. Seed "
             f"{seeds[0]}'s RL run sent {spent['rollouts']} rollouts to the verifier "
             f"({spent['tokens']} tokens); RFT kept {spent['rft_kept']} verified ones; the SFT "
             f"arms trained on {spent['more SFT']} and {spent['SFT, every bin']} teacher tokens.",
             "", "| arm | verifier calls | wall s | beyond the SFT range | "
             + " | ".join(f"d={d}" for d in diffs) + " |",
             "|---|---|---|---|" + "---|" * len(diffs)]
    for arm in ARMS:
        b = [beyond(hi, a[arm]) for _, a, _, _ in results]
        cells = [spread([a[arm].get(d, a[arm].get(str(d), 0.0)) for _, a, _, _ in results])
                 for d in diffs]
        made = [c[arm] for _, _, c, _ in results if arm in c]  # the warm start spent nothing
        cost = " | ".join(f"{statistics.mean(x[i] for x in made):.0f}" for i in (0, 1)) \
            if made else "- | -"
        lines.append(f"| {arm} | {cost} | {spread(b) if None not in b else 'n/a'} | "
                     + " | ".join(cells) + " |")
    gain = [beyond(hi, a["RL"]) - beyond(hi, a["warm start"]) for _, a, _, _ in results
            if beyond(hi, a["RL"]) is not None]
    if gain:
        lines += ["", f"RL's gain beyond the SFT range: {spread(gain)} (points x 100: "
                      f"{100 * statistics.mean(gain):+.1f}); per seed "
                      + ", ".join(f"{g:+.3f}" for g in gain) + "."]
    return lines + past_sampling(results, hi)


def past_sampling(results, hi):
    """Beyond the SFT range, per difficulty: the warm start's pass@k at the largest k measured
    beside RL's pass@1 and pass@k (eval_sampled runs only): does RL's pass@1 exceed what the warm
    start could sample, or does it only sharpen what was there? -> lines ([] without them)."""
    starts, ends = zip(*(s["passes"] for _, _, _, s in results))
    ks = [k for k in starts[0] if k.startswith("pass@") and k != "pass@1"]
    if not ks or not all(ends):
        return []
    top = max(ks, key=lambda k: int(k[5:]))
    diffs = sorted(int(d) for d in starts[0][top] if int(d) > hi)
    cell = lambda runs, k, d: [r[k].get(d, r[k].get(str(d), 0.0)) for r in runs]  # noqa: E731
    lines = ["", f"Past what the warm start could sample: beyond the SFT range, the warm start's "
                 f"{top} (temperature 1) beside RL's pass@1 and {top}, mean ± spread over seeds.",
             "", f"| difficulty | warm start {top} | RL pass@1 | RL {top} | RL pass@1 > warm "
                 f"start {top} |", "|---|---|---|---|---|"]
    for d in diffs:
        w, p1, pk = cell(starts, top, d), cell(ends, "pass@1", d), cell(ends, top, d)
        wins = sum(a > b for a, b in zip(p1, w))
        lines.append(f"| {d} | {spread(w)} | {spread(p1)} | {spread(pk)} | {wins} of "
                     f"{len(w)} seeds |")
    return lines
