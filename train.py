"""
train.py: the entry point and THE loop. Read `main` top to bottom: build the run, then every step
goes signal -> rollout -> rewards -> update -> sync, writes its log lines, and now and then
evaluates and saves.

    python train.py                                       # the embedded default: tiny model, CPU
    python train.py configs/gsm8k_qwen3.py                # a config file of overrides
    python train.py configs/tiny.py --steps=20 --lr=1e-3  # ... plus command-line overrides
    python train.py --help                                # every key by stage: value, what it does
    torchrun --nproc_per_node=2 train.py --threads=1      # data parallel (gloo CPU, NCCL GPU)
    torchrun --nproc_per_node=3 train.py --rollout_ranks=1  # disaggregated: 1 generates, 2 train

One step (`rl_step`):
    1 signal   the sampler draws prompts from the growth zone (pass rate neither ~0 nor ~1)
    2 rollout  G completions each, the prompt prefilled once per group; stage 2's sparse budget,
               mismatch figures and speculative mode behind one object (sparse_rollout.py); on an
               MoE, every token's experts, and the routing and mismatch with and without replay
    3 rewards  the verifier cascade; every rank tells the sampler every group's rewards. Groups
               whose rewards are all equal carry no gradient: they are dropped and refilled with
               fresh prompts up to `refill_tries` times; then the batch trains short, never padded
    4 update   advantages -> dense log-probs -> clipped policy-gradient loss with IS weights;
               router_replay routes the trainer's MoE forwards through the rollout's experts
    5 sync     colocated: the rollout copy follows the policy in place; disaggregated: trainer 0
               ships a checked weight delta to the ranks that only generate. A bf16 copy takes its
               delta in bf16 either way (only the weights whose bf16 bits changed)
The rank's role (parallel.Role) decides which of stages 1-3 and 4 it runs; colocated, it runs both.
Each step logs a few lines with every stage's figures (a tqdm bar on a terminal); metrics.jsonl has
every number. A run ends with a summary table, out_dir/run.png and every rank's weight checksum.

Simplifications:
    1. Colocated by default: the policy and the rollout engine share a process (and, with
       rollout_copy=same, the module). `fsdp=true` shards training, with a full replica to generate.
    2. The embedded default builds its own warm start (warmstart.py), cached by its settings.
    3. Held-out accuracy (heldout.py) is greedy, on the policy itself, scored by the same cascade.
    4. A config or data error stops the run in one line that names the key, before any training, as
       does an out_dir that holds a run; Ctrl-C prints the last checkpoint and the resume command.

`Config` in config.py is the one source of truth; a run writes its config to out_dir/config.json.
"""

import copy
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

import copies
import ledger
import memory
import parallel
from checkpoint import claim_out_dir, load_checkpoint, resume_note, save_checkpoint
from config import RG_PREFIX, TASK_CONFIGS, TRACE_TOKENS, cli, last_step, parse_config
from heldout import before_rl, during_rl
from model import add_lora
from moe import moe_layers, replay_batch
from prompts import group_has_signal, make_sampler, refill_size
from report import (Tracker, difficulty_name, help_text, idle_keys, kv_reads_all, plot,
                    run_figures, step_lines, summary, write_summary)
from reward import Cascade, combine, load_judge, overlong_penalty
from rollout import Engine
from sparse_rollout import SparseRollout
from sparsity import MaskedParams, apply_nm
from sync import Receiver, Sender, send_local
from tasks import encode_pool, load_problems
from update import Group, batch_from_groups, lr_at, pg_loss, replay_mismatch, train_on
from warmstart import build_policy, cache_path
from zeros_kernels.cpu_ext import prefetch_cpu_ext

@dataclass
class Run:
    """Everything a run holds besides its config, built once by `build` and passed to every step."""
    role: parallel.Role  # what this rank does: collect (stages 1-3), train (stage 4), or both
    world: int
    dev: torch.device
    model: torch.nn.Module  # the policy being trained (sharded under FSDP)
    tok: object
    sparse: SparseRollout  # stage 2's budget, controller, DistillSparse, dense comparison, mode
    greedy: Engine  # held-out evaluation, dense, on the full policy
    cascade: Cascade
    opt: torch.optim.Optimizer
    sampler: object
    # the autocast context of rollouts and training forwards, entered afresh around forwards only:
    # autocast keeps its bf16 weight copies until the outermost context exits (a forward after an
    # optimizer step in the same context would see the old weights)
    amp: object
    train_ids: list  # token ids of the training pool
    eval_p: list  # held-out problems, and their ids
    eval_ids: list
    replica: torch.nn.Module = None  # FSDP: the full-weight copy that the engines read
    ref_model: torch.nn.Module = None  # kl_coef > 0: the frozen reference policy
    sender: object = None  # disaggregated: stage 5's ends (a Sender on trainer 0, Receivers)
    receiver: object = None
    masked: MaskedParams = None  # nm: the policy's fixed N:M masks (only active weights train)
    ships_copy: bool = False  # a bf16 copy that follows the policy by deltas in bf16 (stage 5)
    step: int = None  # the step the loop is at (None: before the first), for Ctrl-C's note


def build(cfg, rank, world, dev, role, log):
    """The policy, its data, its engines and its optimizer. The order sets what the seed draws."""
    random.seed(cfg.seed)
    if dev.type == "cuda":  # the predicted peak memory, before any weight loads: refused if over
        memory.check_fits(cfg, dev, log, world)
    model, tok = build_policy(cfg, dev, log, rank, world)
    if cfg.router_replay != "off" and not moe_layers(model):
        raise ValueError(f"config key 'router_replay' ({cfg.router_replay}) needs an MoE model "
                         f"(n_expert > 0, or a Qwen3-MoE checkpoint)")
    # the run's own draws (a LoRA init, ...) must not depend on whether the warm start was built
    torch.manual_seed(cfg.seed)  # here or loaded from its cache
    train_p, eval_p = load_problems(cfg)
    ctx = model.config.max_position_embeddings
    train_p, train_ids = encode_pool(tok, train_p, cfg, ctx, log)
    eval_p, eval_ids = encode_pool(tok, eval_p, cfg, ctx, log)
    if cfg.lora_r:
        add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
    n_m = [int(x) for x in cfg.nm.split(":")] if cfg.nm else None  # pruned before ranks sync
    masked = MaskedParams(model, apply_nm(model, *n_m)) if n_m else None
    if world > 1:  # the ranks start from the same weights (the adapter's random init included)
        for p in model.parameters():
            torch.distributed.broadcast(p.data, 0)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    replica = parallel.shard(cfg, model, dev) if cfg.fsdp else None
    full = replica or model  # full weights: what the engines read
    # stage 2. Every run generates through it: the default (rollout_mode=sparse, kv_budget=dense)
    # selects every page, so its "sparse" decode is plain dense decoding
    sparse = SparseRollout.for_run(cfg, full, tok, train_ids, log, rank, world, eval_ids)
    model.eval()  # dropout only in the training forwards (update.train_on turns it on and off)
    gen = dict(tokenizer=tok, max_new_tokens=cfg.max_new_tokens, stop=[cfg.stop] if cfg.stop else [])
    greedy = Engine(full, temperature=0.0, kv_dtype=cfg.kv_dtype, pool=sparse.pool,  # one KV pool
                    step=cfg.decode_step, **gen)  # held-out accuracy is the policy's own
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    sampler = make_sampler(cfg, train_p)
    amp = torch.autocast(dev.type, torch.bfloat16, enabled=cfg.autocast == "bfloat16")
    cascade = Cascade(max_chars=cfg.max_chars or None, math_verify=cfg.math_verify,
                      judge=load_judge(cfg.judge), judge_timeout_s=cfg.judge_timeout_s)
    ships_copy = cfg.rollout_copy == "bf16" and not cfg.lora_r and sparse.distill is None
    roll = sparse.rollout_model
    sender, receiver = parallel.shipper(model, role, roll if ships_copy else None)
    if ships_copy and not role.split:  # colocated: the copy follows by bf16 deltas too (counted)
        sender, receiver = Sender(full, dtype=torch.bfloat16, synced=True), Receiver(roll)
    return Run(role, world, dev, model, tok, sparse, greedy, cascade, opt, sampler, amp, train_ids,
               eval_p, eval_ids, replica, ref_model, sender, receiver, masked, ships_copy)


def main(argv):
    cfg = parse_config(argv)
    rank, world, dev = parallel.setup_dist(cfg)
    role = parallel.split_roles(cfg, rank, world)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    log = (lambda s: s and tqdm.write(s)) if rank == 0 else (lambda s: None)  # rank 0 prints
    if claim_out_dir(cfg, rank, log):  # no run overwritten, no resume without a checkpoint
        return None  # ... and a finished run resumed: "already complete"
    log(idle_keys(cfg))  # the keys set that do nothing in this run, before the warm start
    log(notes(cfg))  # settings that work but may surprise: a long warm-up, a long warm start
    if dev.type == "cpu":  # a fresh machine compiles the decode kernels while the warm start trains
        prefetch_cpu_ext("sparse_decode_cpu", "layer_cpu")
    run = None
    try:  # the cascade holds worker processes: close them however the run ends
        run = build(cfg, rank, world, dev, role, log)
        log(kv_reads_all(cfg, run.model, run.train_ids))  # a sparse budget that drops no page
        history = train(cfg, run, rank, log)
    except KeyboardInterrupt as e:  # Ctrl-C: the step, the last checkpoint, the command to resume
        e.args = (resume_note(cfg, run and run.step, argv, last_step(cfg)),)
        raise
    finally:
        if run is not None:
            run.cascade.close()
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return history


def notes(cfg):
    """Log lines on settings that work but may surprise ("" if none): a warm-up that outlasts the
    steps that run, so the learning rate never reaches lr; a warm start, not yet cached, that
    trains on many times the default's tokens (hours on a CPU)."""
    out, runs = [], last_step(cfg) + 1
    if cfg.warmup_steps > runs:  # update.lr_at: lr * (step + 1) / warmup_steps until then
        out.append(f"note: warmup_steps={cfg.warmup_steps} outlasts the run ({runs} step"
                   f"{'s' * (runs > 1)}): the learning rate ends at "
                   f"{runs / cfg.warmup_steps:.2f} of lr={cfg.lr:g} (--warmup_steps={runs} "
                   f"reaches it at the last step)")
    if (not cfg.model and cfg.task.startswith(RG_PREFIX) and not cfg.sft_init
            and not os.path.exists(cache_path(cfg))):
        times = sft_tokens(cfg) / sft_tokens(parse_config([]))
        if times > 10:
            out.append(f"note: the warm start trains on about {times:.0f} times the default's "
                       f"tokens (the default's takes about 4 minutes on 2 CPU cores): hours; "
                       f"{TASK_CONFIGS[cfg.task[len(RG_PREFIX):]]} has settings that fit the task")
    return "\n".join(out)


def sft_tokens(cfg):
    """About how many tokens the tiny model's warm start trains on for a reasoning-gym task:
    sft_steps x sft_batch sequences of a prompt and a teacher trace, sized from 16 of the
    generator's items (config.TRACE_TOKENS; the prompt: the question or its last paragraph, the
    short expression prompts not counted)."""
    from reasoning_gym.factory import DATASETS  # lazy, as in checks.check_task
    name, size = cfg.task[len(RG_PREFIX):], 0
    kwargs = {**cfg.rg_kwargs, **cfg.sft_rg_kwargs, "size": 16, "seed": cfg.seed}
    for item in DATASETS[name][0](DATASETS[name][1](**kwargs)):
        q = item["question"]
        prompt = {"question": q, "last_paragraph": q.strip().split("\n\n")[-1]}.get(cfg.rg_prompt)
        size += TRACE_TOKENS[name](item["metadata"]) + len(prompt or "")
    return cfg.sft_steps * cfg.sft_batch * size / 16


def train(cfg, run, rank, log):
    """Evaluate the start (or resume), run the steps (log, metrics, checkpoints), check that the
    ranks agree."""
    start, history = 0, {"records": [], "acc0": None, "start": {}, "examples": []}
    extra = run.sparse.extra  # checkpointed with the policy: what a resumed run must find
    if cfg.resume:
        start, history = load_checkpoint(cfg, run.model, run.opt, run.sampler, run.dev, extra)
        refresh_rollout(cfg, run)  # the copy was made from the weights before the checkpoint
        log(f"resumed from step {start}")
    elif run.role.trains:
        with run.amp:
            before_rl(cfg, run, history, log)  # the warm start's held-out figures and examples
    if run.role.split:
        log(f"{len(run.role.trainers)} trainer and {len(run.role.rollouts)} rollout ranks, "
            f"max staleness {cfg.max_staleness}")
    log(f"policy: {run.model.num_params() / 1e6:.2f}M parameters on {run.dev} ({cfg.dtype}), "
        f"world size {run.world}; {len(run.train_ids)} training prompts")
    metrics_path, track = os.path.join(cfg.out_dir, "metrics.jsonl"), Tracker(cfg, rank)
    if rank == 0:  # rewrite the log up to the resume point, so a resumed run does not repeat steps
        with open(metrics_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in history["records"])
        figures = run_figures(history, run.eval_p)  # the warm start's, for a script to read
        write_summary(cfg.out_dir, figures)
        track.figures(figures, step=start)
    t_start, end, skipped = time.perf_counter(), last_step(cfg) + 1, 0
    bar = rank == 0 and sys.stderr.isatty()  # a bar in a file is one endless line: terminals only
    for step in tqdm(range(start, end), desc="rl", initial=start, total=end, disable=not bar,
                     dynamic_ncols=True):
        run.step = step
        for g in run.opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        last = step == end - 1
        rec = rl_step(cfg, step, run)  # each stage enters run.amp around its own forwards
        if run.role.trains and ((step + 1) % cfg.eval_every == 0 or last):
            t_eval = time.perf_counter()
            with run.amp:  # a context of its own, after the step's: it casts the updated weights
                during_rl(cfg, run, history, rec, last)  # held-out accuracy; at the end, more
            rec["eval_s"] = time.perf_counter() - t_eval
        if not run.role.trains:  # a rollout rank: its figures are the trainers' to log
            continue
        if rec["tokens"]:  # optimizer steps skipped in a row for NaN/inf: a diverged run stops
            went_through = rec["skipped_nonfinite"] < cfg.passes * cfg.minibatches
            skipped = 0 if went_through else skipped + rec["skipped_nonfinite"]
        history["records"].append(rec)
        log(step_lines(rec))
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            track.log(rec)  # the same record, to the tracker (tracker=none: nothing)
        if skipped >= cfg.max_skipped:  # before saving: weights that diverged are not checkpointed
            raise FloatingPointError(
                f"stopped at step {step}: the last {skipped} optimizer steps had a NaN or inf "
                f"loss or gradient (max_skipped={cfg.max_skipped}); lower lr or check the "
                f"rewards. The last checkpoint is in {cfg.out_dir}/ckpt")
        if rank == 0 and ((step + 1) % cfg.save_every == 0 or last):
            save_checkpoint(cfg, run.replica or run.model, run.tok, run.opt, run.sampler, step + 1,
                            history, extra, base=cfg.model or cache_path(cfg))
    held = run.replica or run.model
    if run.ships_copy and run.role.split:  # the rollout ranks hold only the bf16 copy: compare
        if run.role.trains:  # it with the trainers' copies, made by a local refresh
            copies.refresh(run.sparse.rollout_model, held, cfg.lora_r)
        held = run.sparse.rollout_model
    history["checksums"] = parallel.check_ranks_agree(held, run.world, log)
    if rank == 0:
        seconds = time.perf_counter() - t_start
        log(summary(history, seconds, cfg.group_size))
        book = ledger.ledger(history["records"][start:], ledger.run_facts(cfg, run), seconds)
        log(ledger.text(book))  # what each stage skipped, beside the naive loop
        if cfg.plot:
            plot(history, os.path.join(cfg.out_dir, "run.png"), difficulty_name(cfg))
            ledger.plot(book, os.path.join(cfg.out_dir, "ledger.png"))
        figures = run_figures(history, run.eval_p, seconds, book)
        write_summary(cfg.out_dir, figures)  # the end's figures, the ledger among them
        track.finish(os.path.join(cfg.out_dir, "run.png"), figures)
    return history


def rl_step(cfg, step, run):
    """One step, stage by stage. Returns the step's metrics record."""
    with run.amp:  # stages 1-3 (forwards only); the update enters run.amp per forward itself
        collected = collect(cfg, step, run) if run.role.collects else None
    kept, rec = parallel.exchange(collected, run.role)  # colocated: the same groups, same rank
    rec["step"] = step
    sync(cfg, step, run, rec, before_update=True)
    if run.role.trains:
        rec.update(learn(cfg, run, kept))  # stage 4
    t_sync = time.perf_counter()
    sync(cfg, step, run, rec, before_update=False)  # stage 5
    rec["sync_s"] = time.perf_counter() - t_sync
    return rec


def collect(cfg, step, run):
    """Stages 1-3 with DAPO's dynamic sampling: draw prompts, generate G completions each, score
    them, and keep the groups whose rewards have spread. Refill with fresh prompts up to
    `refill_tries` more times; when the tries run out the batch trains short (never padded with
    zero-advantage groups). Every collecting rank draws the same prompts and takes its slice, and
    observes the whole batch, so the samplers stay identical. -> (kept groups, their figures)."""
    me, n, group = run.role.me, run.role.n, run.role.group
    n_local = max(1, cfg.prompts_per_step // n)
    t_start = time.perf_counter()
    kept, results, rec = [], [], {"gen_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "tries": 0}
    lens, nll, finish_length, rewards_all, zone, zero_adv = [], [], 0, [], [], 0
    n_draw, drawn, signals = n_local, 0, 0  # per rank this try; drawn, with spread: all ranks
    for t in range(1 + (cfg.refill_tries if cfg.dynamic_sampling else 0)):
        batch = run.sampler.next_batch(n_draw * n, refill=t > 0)  # stage 1: every rank the same...
        batch = batch[me * n_draw:(me + 1) * n_draw]  # ...and each takes its slice
        zone.append(run.sampler.stats().get("zone", float("nan")))
        ro, res, r = generate_and_score(cfg, step, t, batch, run, rec)  # stages 2 and 3
        results.append(res)
        rewards_all.append(r.flatten())
        lens.append(ro.mask.sum(1).float())
        nll.append(-ro.logp[ro.mask])  # the sampled tokens' -log p: its mean estimates entropy
        finish_length += sum(f == "length" for f in ro.finish)
        has = [group_has_signal(g, cfg.min_spread) for g in r.tolist()]  # this rank's groups
        everyone = parallel.gather(([i for i, _ in batch], r.tolist(), has), n, group)
        run.sampler.observe([i for idx, _, _ in everyone for i in idx],
                            [g for _, rs, _ in everyone for g in rs])
        drawn += sum(len(h) for *_, h in everyone)
        signals += sum(sum(h) for *_, h in everyone)
        zero_adv += keep_groups(cfg, batch, ro, r, has, kept, n_local)
        rec["tries"] = t + 1
        n_kept = parallel.gather(len(kept), n, group)
        if min(n_kept) >= n_local:  # a global decision: every rank runs the same collectives
            break
        n_draw = refill_size(n_local, min(n_kept), drawn, signals)  # missing / the keep rate
    rew = torch.cat(rewards_all)
    rec["kv_read"] = rec["pages_read"] / max(1, rec["pages_dense"])  # KV pages decode read
    rec.update(reward=rew.mean().item(), groups_kept=sum(n_kept), groups=n_local * n,
               short=int(sum(n_kept) < n_local * n), len_mean=torch.cat(lens).mean().item(),
               zero_adv_groups=sum(parallel.gather(zero_adv, n, group)), rollouts=len(rew) * n,
               groups_drawn=drawn, groups_signal=signals,  # every rank's, every try's
               entropy=torch.cat(nll).sum().item() / max(1, len(torch.cat(nll))),  # nats a token
               finish_length=finish_length / len(rew), zone=sum(zone) / len(zone),
               **combine(results).summary(), collect_s=time.perf_counter() - t_start)
    rec.update(run.sparse.observe(n, group))  # the mismatch; the controller moves the table
    return kept, rec


def generate_and_score(cfg, step, t, batch, run, rec):
    """One try's stages 2 and 3: G rollouts of each prompt, their rewards (with DAPO's overlong
    penalty), and stage 2's figures (alpha, the dense comparison) -> (ro, cascade result, rewards
    (prompts, G)). Adds the try's timings and figures to rec."""
    me, n, G = run.role.me, run.role.n, cfg.group_size
    t0, seed = time.perf_counter(), rollout_seed(cfg.seed, step, t, me)
    prompt_ids = [run.train_ids[i] for i, _ in batch]
    ro = run.sparse.engine.generate(prompt_ids, G, seed=seed)
    rec["gen_s"] += time.perf_counter() - t0
    if t == 0 and ro.experts is not None and run.role.trains:  # MoE: routing vs the trainer's
        rec.update(replay_mismatch(run.replica or run.model, prompt_ids, ro, cfg.temperature,
                                   cfg.micro_batch, run.sparse.engine.pad_id))
    for k in ("prefill_s", "decode_s", "new_tokens", "pages_read", "pages_dense", "prefill_tokens",
              "prefill_tokens_naive", "drafted", "accepted", "verifies"):  # (the ledger's counts)
        rec[k] = rec.get(k, 0) + ro.timings.get(k, 0)  # no drafts outside the lossless mode: 0
    res = run.cascade.score_batch([p for _, p in batch for _ in range(G)], ro.texts,
                                  group_size=G, finish=ro.finish)  # cut rows score 0
    # a rollout rank that holds only the bf16 copy measures against its own dense decode
    ref = run.sparse.rollout_model if run.ships_copy and run.role.split else run.replica or run.model
    for k, v in run.sparse.after_rollout(step, t, ro, batch, prompt_ids, seed, res.rewards,
                                         run.cascade, ref, me, n).items():
        rec[k] = rec.get(k, 0.0) + v if k == "alpha_s" else v
    # host on purpose: the sampler and the groups read them there (batch_from_groups copies them)
    r = torch.tensor(res.rewards, dtype=torch.float32, device="cpu")
    if cfg.overlong_buffer:  # DAPO's soft overlong punishment, on top of the verifier's reward
        r += torch.tensor(overlong_penalty(ro.mask.sum(1).tolist(), cfg.max_new_tokens,
                                           cfg.overlong_buffer, cfg.overlong_penalty),
                          device="cpu")
    return ro, res, r.view(-1, G)


def keep_groups(cfg, batch, ro, r, has, kept, n_local):
    """Append to `kept` the groups with reward spread (every group, without dynamic sampling), up
    to n_local -> how many kept groups have no spread (zero advantage)."""
    G, zero_adv = cfg.group_size, 0
    for g, signal in enumerate(has):
        if (signal or not cfg.dynamic_sampling) and len(kept) < n_local:
            zero_adv += not signal
            rows = slice(g * G, (g + 1) * G)
            kept.append(Group(
                batch[g][0], ro.tokens[rows], ro.mask[rows], r[g], ro.logp[rows],
                None if ro.read_pages is None else ro.read_pages[rows],
                torch.tensor([f == "length" for f in ro.finish[rows]], device="cpu"),  # host
                None if ro.experts is None else ro.experts.take(range(len(ro))[rows])))
    return zero_adv


def rollout_seed(seed, step, try_, rank):
    """A distinct generator seed for every (run seed, step, refill try, rank): a 63-bit hash."""
    return hash((seed, step, try_, rank)) & (2**63 - 1)  # ints hash the same in every process


def learn(cfg, run, kept):
    """Stage 4 on the kept groups: the optimizer passes (update.train_on), DistillSparse's adapter
    step, and the figures for the log. Every trainer calls it, kept groups or not (collectives)."""
    n, group = run.role.n, run.role.group
    t0, rec = time.perf_counter(), {}
    drop = torch.cat([k.cut for k in kept]) if kept and cfg.overlong_filter else None  # cut rows
    ids, tmask, adv, roll = batch_from_groups(kept, run.train_ids, cfg.group_size,
                                              run.sparse.engine.pad_id, cfg.adv_eps,
                                              run.model.lm_head.weight.device, cfg.adv_norm, drop)
    routes = (replay_batch([k.routes for k in kept], [k.mask for k in kept], ids.shape)
              .to(ids.device) if kept and kept[0].routes is not None else None)  # MoE's experts
    out = train_on(cfg, run.model, run.opt, ids, tmask, adv, n, roll, group, run.ref_model,
                   dense_dist=run.sparse.distill is not None, masked=run.masked, routes=routes,
                   amp=run.amp)
    stats = out.pop("stats")  # loss sum, tokens, clipped, skipped, grad norm
    dense_full = out.pop("_dense_full", None)
    pg = lambda lp, rows: pg_loss(lp, roll[rows], adv[rows], tmask[rows], cfg.clip_low,
                                  cfg.clip_high)[0]  # DistillSparse's optional reward term
    rec.update(run.sparse.after_update(kept, [len(run.train_ids[k.prompt]) for k in kept], ids, tmask,
                                       dense_full, pg))
    rec.update(out)
    if n > 1:
        torch.distributed.all_reduce(stats, group=group)
    tokens = stats[1].clamp(min=1)
    rec.update(loss=(stats[0] / tokens).item(), tokens=int(stats[1]),
               clipfrac=(stats[2] / tokens).item(), skipped_nonfinite=int(stats[3]) // n,
               grad_norm=stats[4].item() / n, lr=run.opt.param_groups[0]["lr"],
               train_s=time.perf_counter() - t0)
    return rec


def sync(cfg, step, run, rec, before_update):
    """Stage 5. Colocated, after the update: the rollout copy follows the policy in place.
    Disaggregated: trainer 0 ships the weights' delta to the rollout ranks, after every update with
    max_staleness 0; with 1, before the update (the weights after step - 1, so the next batch is
    generated while this one trains) and once more after the last step, so all ranks end equal."""
    if not run.role.split:
        if not before_update:
            parallel.pull_full(run.replica, run.model)  # FSDP: the shards into the engines' replica
            rec.update(refresh_rollout(cfg, run))
        return
    stale = cfg.max_staleness == 1
    due = (stale and step >= 1) if before_update else (not stale or step == last_step(cfg))
    version = step if before_update else step + 1
    shipped = due and parallel.ship(run.sender, run.receiver, run.role, version, rec)
    if shipped and not run.ships_copy:  # received the policy: re-derive the copy (a bf16 copy
        refresh_rollout(cfg, run)  # received its own bf16 delta and is done)


def refresh_rollout(cfg, run):
    """Re-derive what generates from the policy's new weights (nothing if the policy generates).
    A colocated bf16 copy takes a delta in bf16 instead (bit-exact with a refresh): -> its bytes."""
    full = run.replica or run.model
    if run.sparse.refresh(full):  # DistillSparse: new base weights under the kept adapter
        return {}
    if run.sender is not None and not run.role.split:
        send_local(run.sender.make_update(), run.receiver)  # checks the copy's checksum
        st = run.sender.stats()
        return dict(sync_bytes=st["bytes"], sync_full_bytes=st["full_bytes"],
                    sync_ratio=st["ratio"], sync_changed=st["changed_fraction"])
    copies.refresh(run.sparse.rollout_model, full, cfg.lora_r)
    return {}


if __name__ == "__main__":
    sys.exit(cli(main, sys.argv[1:], lambda argv: help_text(argv, __doc__)))
