"""
parallel.py: the ways to run on several processes (all under torchrun, with torch.distributed only).

    torchrun --nproc_per_node=2 train.py                    # data parallel: train.py sums gradients itself
    torchrun --nproc_per_node=2 train.py --fsdp=true        # FSDP2: sharded training, a full replica to generate
    torchrun --nproc_per_node=3 train.py --rollout_ranks=1  # disaggregated: 1 rank generates, 2 train

What is here:
    shard / pull_full        FSDP2 `fully_shard` of every block and the root, and the full-weight replica that
                             the engines read (generation runs a different number of forwards on each rank,
                             which sharded weights, one all-gather per forward, cannot)
    split_roles / run_split  the disaggregated loop: rollout ranks run stages 1-3 and broadcast the groups they
                             keep; trainers run stage 4; trainer 0 ships checked weight deltas (stage 5, sync.py)

Simplifications:
    1. Neither FSDP nor the disaggregated mode resumes from a checkpoint yet, or trains LoRA; both say so.
    2. Deltas are shipped in the policy's dtype into the rollout ranks' replica, whatever the rollout copy's form.
    3. max_staleness is 0 or 1.
"""

import json
import os
import time

import torch


def shard(cfg, model, dev):
    """FSDP2: shard every block and the root over all ranks, in place. Returns a full, unsharded replica for the
    rollout and evaluation engines: generation runs a different number of forwards on each rank, which sharded
    weights (an all-gather per forward) cannot. `pull_full` refreshes it after every update."""
    import copy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if cfg.lora_r or cfg.resume or cfg.rollout_ranks:
        raise ValueError("config key 'fsdp' does not combine with lora_r, resume or rollout_ranks yet")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world == 1:
        raise ValueError("config key 'fsdp' needs torchrun with at least 2 processes")
    replica = copy.deepcopy(model).requires_grad_(False)
    mesh = init_device_mesh(dev.type, (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return replica


@torch.no_grad()
def pull_full(cfg, model):
    """FSDP: all-gather the sharded weights into the full replica (the same collectives on every rank)."""
    if cfg._replica is None:
        return
    dst = cfg._replica.state_dict()
    for k, v in model.state_dict().items():
        dst[k].copy_(v.full_tensor())


def split_roles(cfg, rank, world):
    """Disaggregated mode: (is_rollout, trainer ranks, rollout ranks), with cfg._group set to this rank's role
    group; None when colocated (every rank generates and trains)."""
    if cfg.rollout_ranks == 0:
        return None
    if not 0 < cfg.rollout_ranks < world:
        raise ValueError(f"config key 'rollout_ranks' must leave at least one trainer: {cfg.rollout_ranks} of "
                         f"{world} ranks (run under torchrun with more processes)")
    if cfg.max_staleness not in (0, 1) or cfg.resume or cfg.lora_r or cfg.kv_controller:
        raise ValueError("disaggregated mode (rollout_ranks > 0) supports max_staleness 0 or 1, and not yet "
                         "resume, lora_r or kv_controller")
    trainers, rollouts = list(range(world - cfg.rollout_ranks)), list(range(world - cfg.rollout_ranks, world))
    groups = [torch.distributed.new_group(trainers), torch.distributed.new_group(rollouts)]  # every rank, in order
    is_rollout = rank in rollouts
    cfg._group = groups[is_rollout]
    return is_rollout, trainers, rollouts


def run_split(cfg, model, tok, rollout_model, engine, greedy, cascade, opt, sampler, amp, data, roles, log):
    """Disaggregated: rollout ranks run stages 1-3 and broadcast the kept groups; trainer ranks run stage 4 on
    them and trainer 0 ships weight deltas (stage 5, sync.py) that the rollout ranks apply and check. With
    max_staleness 1 a rollout rank generates batch s with the weights after step s - 2 while the trainers work on
    batch s - 1 (overlap; TIS corrects the staleness); with 0 it waits for the weights after step s - 1."""
    from tqdm import tqdm
    import train as T  # the loop's stages; imported here because train.py imports this file
    from sync import Receiver, Sender, broadcast_update
    dist = torch.distributed
    is_rollout, trainers, rollouts = roles
    rank = dist.get_rank()
    me, n = (rollouts.index(rank), len(rollouts)) if is_rollout else (trainers.index(rank), len(trainers))
    train_ids, eval_p, eval_ids = data
    sender = Sender(model, mode="delta", synced=True) if rank == trainers[0] else None
    receiver = Receiver(model) if is_rollout else None
    history = {"records": [], "acc0": None}
    if not is_rollout:
        with amp:
            history["acc0"] = T.evaluate(cfg, greedy, cascade, eval_p, eval_ids, me, n)
        log(f"held-out accuracy before RL: {history['acc0']:.3f}; {len(trainers)} trainer and "
            f"{len(rollouts)} rollout ranks, max staleness {cfg.max_staleness}")

    def ship(version, rec):  # every rank: trainer 0 sends what changed, the rollout ranks apply and verify it
        upd = broadcast_update(sender.make_update(version=version) if sender else None, trainers[0])
        if receiver:
            receiver.apply(upd)
            T.refresh_rollout(cfg, rollout_model, model)
        if sender:
            st = sender.stats()
            rec.update(sync_bytes=st["bytes"], sync_ratio=st["ratio"])

    t_start, metrics = time.perf_counter(), os.path.join(cfg.out_dir, "metrics.jsonl")
    if rank == 0:
        open(metrics, "w").close()
    for step in tqdm(range(cfg.steps), desc="rl", disable=rank != 0, dynamic_ncols=True):
        for g in opt.param_groups:
            g["lr"] = T.lr_at(cfg, step)
        rec = {"step": step}
        with amp:
            payload = T.collect(cfg, step, engine, cascade, sampler, train_ids, me, n) if is_rollout else None
        parts = []
        for src in rollouts:  # each rollout rank broadcasts its kept groups
            obj = [payload if rank == src else None]
            dist.broadcast_object_list(obj, src=src)
            parts.append(obj[0])
        if cfg.max_staleness == 1 and step >= 1:
            ship(step, rec)  # the weights after step - 1, while the trainers work on this batch
        if not is_rollout:
            rec.update(parts[0][1], step=step)  # collect's figures are already summed over the rollout ranks
            kept = [k for kk, _ in parts for k in kk][me::n]  # the rollout ranks' groups, dealt to the trainers
            with amp:
                rec.update(T.learn(cfg, model, opt, kept, train_ids, engine.pad_id, n))
                if (step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1:
                    rec["acc"] = T.evaluate(cfg, greedy, cascade, eval_p, eval_ids, me, n)
        if cfg.max_staleness == 0 or step == cfg.steps - 1:
            ship(step + 1, rec)  # stale 0: every step; stale 1: once more at the end, so all ranks agree
        if rank == 0:
            history["records"].append(rec)
            log(T.fmt(rec) + (f" | sync {rec['sync_bytes'] / 1e3:.1f} kB ({rec['sync_ratio']:.3f} of full)"
                            if "sync_bytes" in rec else ""))
            with open(metrics, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if (step + 1) % cfg.save_every == 0 or step == cfg.steps - 1:
                T.save_checkpoint(cfg, model, tok, opt, sampler, step + 1, history)
    history["checksums"] = T.check_ranks_agree(model, dist.get_world_size(), log)
    if rank == 0:
        T.summarize(cfg, history, time.perf_counter() - t_start, log)
    return history
