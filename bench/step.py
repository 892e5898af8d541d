"""
bench/step.py: one whole RL step, zeros against TRL's GRPOTrainer, side by side in one process.

Both sides start from the warm start of configs/sharpen.py (the earlier default, a fixed workload:
the tiny model, an HF folder in the warm-start cache, warmstart.cache_root: zeros reads it with
Transformer.from_pretrained, TRL with AutoModelForCausalLM) and train on the same prompts in the
same order: zeros draws them (uniform sampling, no dynamic sampling, so every group trains), the
bench records each step's draw and hands TRL that list, unshuffled. The shapes are the same (16
prompts x 8 rollouts, at most 64 new tokens, temperature 1, one optimizer step per batch, no KL
term), and so is the reward: zeros' verifier cascade (reward.Cascade, an exact match on the
synthetic task), with rows cut at the token limit scored 0 on both sides. Per side and thread count
(1 and 2): the median wall time of a step (generate, reward, log-probs, backward, optimizer; the
first step is a warm-up and not counted), the time per generated token, and the mean completion
length (the two sides sample differently, so their lengths differ a little: the per-token figure
allows for that).

TRL is optional: `pip install trl` (the section was written against trl 1.16). Without it the
section prints how to install it and its one row says "skipped: trl not installed".

Simplifications:
    1. A step's time is zeros' train.rl_step (stages 1-5) and, for TRL, the trainer's step from
       on_step_begin to on_step_end (generation, reward, loss, backward, optimizer); evaluation,
       model loading and logging are outside both.
    2. TRL runs on transformers' generate (its default without vLLM), fp32 on the CPU, as zeros
       does.
    3. The learning rate is the config's (1e-4) on both sides, held constant on TRL's; it does not
       change the cost of a step.

    python -m bench step --threads 1   # about 5 minutes on 2 cores
    python -m bench step --quick       # 3 steps, 1 thread: a smoke run
"""

import os
import shutil
import statistics
import time

import torch

import train
from bench.common import TABLE_HEAD, hardware

INSTALL = "pip install trl"
SKIPPED = "skipped: trl not installed"  # the ratio cell of the row without TRL
BASE = ["configs/sharpen.py", "--sampler=uniform", "--dynamic_sampling=false", "--prompts_per_step=16",
        "--group_size=8", "--max_new_tokens=64", "--temperature=1.0", "--passes=1",
        "--minibatches=1", "--kl_coef=0", "--eval_every=1000", "--n_eval=8",
        "--eval_sampled=false", "--plot=false", "--save_every=1000"]


def zeros_side(steps, threads, out):
    """Run zeros' loop; -> (step times, per-step records, the prompts each step drew, the run)."""
    times, drawn, seen = [], [], {}
    rl_step = train.rl_step

    def timed(cfg, step, run):
        if "run" not in seen:  # record every draw of the sampler, to hand TRL the same prompts
            seen["run"], next_batch = run, run.sampler.next_batch
            run.sampler.next_batch = lambda *a, **k: drawn.append(next_batch(*a, **k)) or drawn[-1]
        t0 = time.perf_counter()
        rec = rl_step(cfg, step, run)
        times.append(time.perf_counter() - t0)
        return rec

    train.rl_step = timed
    try:
        hist = train.main(BASE + [f"--stop_at={steps}", f"--threads={threads}",
                                  f"--out_dir={out}", "--overwrite=true"])  # a killed run's
    finally:
        train.rl_step = rl_step
    return times, hist["records"], [x for batch in drawn for x in batch], seen["run"]


def trl_side(run, cfg_lr, drawn, steps, threads, out):
    """GRPOTrainer on the same warm start, prompts, shapes and reward; -> (step times, mean
    completion length per step)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from warmstart import cache_path

    folder = cache_path(run_cfg(out))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.pad_token = tok.pad_token or tok.eos_token
    texts = [run.tok.decode(run.train_ids[i]) for i, _ in drawn]
    for (i, _), t in zip(drawn, texts):  # the very same prompt tokens on both sides
        if tok.encode(t, add_special_tokens=False) != run.train_ids[i]:
            raise RuntimeError(f"prompt {i} does not tokenize back to zeros' ids: {t!r}")
    problems = [p for _, p in drawn]
    eos = tok.eos_token_id

    def reward(prompts, completions, completion_ids, pid, **kw):
        finish = ["stop" if eos in ids else "length" for ids in completion_ids]  # cut rows: 0
        return run.cascade.score_batch([problems[i] for i in pid], completions, group_size=8,
                                       finish=finish).rewards

    times, lens, t0 = [], [], {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            t0["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - t0["t"])

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lens.append(logs["completions/mean_length"])

    args = GRPOConfig(output_dir=out, per_device_train_batch_size=128, num_generations=8,
                      max_completion_length=64, temperature=1.0, top_p=1.0, top_k=0,
                      learning_rate=cfg_lr, lr_scheduler_type="constant", num_iterations=1,
                      beta=0.0, max_steps=steps, logging_steps=1, save_strategy="no",
                      report_to=[], use_cpu=True, bf16=False, shuffle_dataset=False, seed=0,
                      dataloader_num_workers=0, disable_tqdm=True)
    data = Dataset.from_dict({"prompt": texts, "pid": list(range(len(texts)))})
    trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    torch.set_num_threads(threads)
    trainer.train()
    return times, lens


def run_cfg(out):
    from config import parse_config
    return parse_config(BASE + [f"--out_dir={out}"])


def run(quick, cmd):
    """-> the table, head included: three rows per thread count."""
    try:
        import trl
    except ImportError:
        print(f"TRL is not installed: `{INSTALL}` to run this section; skipped")
        return TABLE_HEAD + [f"| whole RL step against TRL's GRPOTrainer | | | {SKIPPED} | | | "
                             f"`{cmd}` (`{INSTALL}` to run it) |"]
    steps = 3 if quick else 8
    rows = []
    for threads in (1,) if quick else (1, 2):
        out = os.path.join("out", "bench-step")  # the warm start's cache is shared whatever this is
        try:
            z_t, recs, drawn, run_ = zeros_side(steps, threads, out + "-zeros")
            t_t, t_len = trl_side(run_, run_cfg(out).lr, drawn, steps, threads, out + "-trl")
        finally:
            for d in (out + "-zeros", out + "-trl"):
                shutil.rmtree(d, ignore_errors=True)
        rows += step_rows(z_t, recs, t_t, t_len, threads, trl.__version__, cmd)
    for r in rows:
        print(r, flush=True)
    return TABLE_HEAD + rows


def step_rows(z_t, recs, t_t, t_len, threads, version, cmd):
    """Medians after the warm-up step: seconds per step, per generated token, mean length."""
    med = lambda xs: statistics.median(xs[1:] if len(xs) > 1 else xs)
    rollouts = 16 * 8
    z_len, t_len_m = med([r["len_mean"] for r in recs]), med(t_len)
    z_s, t_s = med(z_t), med(t_t)
    z_tok = med([t / max(1.0, r["len_mean"] * rollouts) for t, r in zip(z_t, recs)])
    t_tok = med([t / max(1.0, n * rollouts) for t, n in zip(t_t, t_len)])
    hw = hardware()  # names the thread count both sides ran with
    what = (f"zeros vs TRL {version} GRPOTrainer, 16 prompts x 8 rollouts, <= 64 new tokens, "
            f"median of {max(1, len(z_t) - 1)} steps after a warm-up, {threads} thread"
            + ("s" if threads > 1 else ""))
    end = f" | {hw} | `{cmd}` |"
    return [f"| whole RL step, s ({what}) | {z_s:.2f} | {t_s:.2f} | {z_s / t_s:.2f}x | <= 0.5x"
            + end,
            f"| per generated token, ms | {1e3 * z_tok:.3f} | {1e3 * t_tok:.3f} | "
            f"{z_tok / t_tok:.2f}x | <= 0.5x" + end,
            f"| mean completion length, tokens | {z_len:.1f} | {t_len_m:.1f} | "
            f"{z_len / t_len_m:.2f}x | about 1x" + end]
