"""
parallel.py: the ways to run on several processes (all under torchrun, with torch.distributed only).
On one process every function here is an identity or a no-op, so train.py's loop reads the same
either way.

    torchrun --nproc_per_node=2 train.py                    # data parallel: update.py sums
                                                            # gradients itself
    torchrun --nproc_per_node=2 train.py --fsdp=true        # FSDP2: sharded training, a full
                                                            # replica to generate
    torchrun --nproc_per_node=3 train.py --rollout_ranks=1  # disaggregated: 1 rank generates,
                                                            # 2 train

What is here:
    setup_dist / gather      join the process group; every rank's object, in rank order
    Role / split_roles       what this rank does. Colocated, every rank collects (stages 1-3) and
                             trains (stage 4). Disaggregated, the last `rollout_ranks` ranks only
                             collect and the others only train; each role has its own process group
                             for its collectives
    exchange                 stages 1-3 -> 4: the rollout ranks broadcast the groups they kept, the
                             trainers deal them out (colocated: a rank trains on what it collected)
    ship                     stage 5 across ranks: trainer 0 broadcasts a checked weight delta
                             (sync.py) that the rollout ranks apply
    shard / pull_full        FSDP2 `fully_shard` of every block and the root, and the full-weight
                             replica that the engines read (generation runs a different number of
                             forwards on each rank, which sharded weights, one all-gather per
                             forward, cannot)
    check_ranks_agree        every rank's weight checksum, logged

Simplifications:
    1. Neither FSDP nor the disaggregated mode resumes from a checkpoint yet, or trains LoRA; both
       say so.
    2. Deltas are shipped in the policy's dtype into the rollout ranks' replica, whatever the
       rollout copy's form.
    3. max_staleness is 0 or 1, and "overlap" is an ordering of blocking collectives: with staleness
       1 the rollout ranks generate step s on the weights after step s - 2.
"""

import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from model import weight_checksum
from sync import Receiver, Sender, broadcast_update


def setup_dist(cfg):
    """Returns (rank, world, device). Under torchrun, joins the process group (gloo on CPU, NCCL on
    CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    dev = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"config key 'device' is cuda, but this torch ({torch.__version__}) sees "
                         f"no CUDA device: --device=cpu, or --device=auto (CUDA where found)")
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dev = f"cuda:{torch.cuda.current_device()}"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.startswith("cuda") else "gloo")
    return rank, world, torch.device(dev)


def gather(obj, world, group=None):
    """Every rank's `obj` (of `group`, by default all), in rank order (a list of one on a single
    process)."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


# ----------------------------------------------------------------------------- roles


@dataclass
class Role:
    """What this rank does, and with whom. `me` / `n`: its index among, and the count of, the ranks
    that share its role; `group`: their process group (None: every rank). `trainers` / `rollouts`
    list the ranks of each role in disaggregated mode, and are None when colocated."""
    collects: bool
    trains: bool
    me: int
    n: int
    group: object = None
    trainers: list = None
    rollouts: list = None

    @property
    def split(self):
        return self.rollouts is not None


def split_roles(cfg, rank, world):
    """The Role of this rank: colocated unless config key rollout_ranks > 0."""
    if cfg.rollout_ranks == 0:
        return Role(collects=True, trains=True, me=rank, n=world)
    if not 0 < cfg.rollout_ranks < world:
        raise ValueError(f"config key 'rollout_ranks' must leave at least one trainer: "
                         f"{cfg.rollout_ranks} of {world} ranks (run under torchrun with more "
                         f"processes)")
    if cfg.max_staleness not in (0, 1) or cfg.resume or cfg.lora_r or cfg.kv_controller:
        raise ValueError("disaggregated mode (rollout_ranks > 0) supports max_staleness 0 or 1, "
                         "and not yet resume, lora_r or kv_controller")
    trainers, rollouts = (list(range(world - cfg.rollout_ranks)),
                          list(range(world - cfg.rollout_ranks, world)))
    # every rank creates both, in order
    groups = [dist.new_group(trainers), dist.new_group(rollouts)]
    mine = rollouts if rank in rollouts else trainers
    return Role(collects=rank in rollouts, trains=rank in trainers, me=mine.index(rank),
                n=len(mine), group=groups[rank in rollouts], trainers=trainers, rollouts=rollouts)


def exchange(collected, role):
    """Stages 1-3 -> 4. `collected` is this rank's (kept groups, figures), or None where it does not
    collect. Colocated: returned as is. Disaggregated: each rollout rank broadcasts its kept groups;
    the trainers deal them out and take the figures of the first rollout rank (already summed over
    the rollout ranks)."""
    if not role.split:
        return collected
    parts = []
    for src in role.rollouts:  # every rank joins every broadcast
        obj = [collected if dist.get_rank() == src else None]
        dist.broadcast_object_list(obj, src=src)
        parts.append(obj[0])
    if not role.trains:
        return [], {}
    return [k for kept, _ in parts for k in kept][role.me::role.n], dict(parts[0][1])


def shipper(model, role, copy=None):
    """Disaggregated mode's two ends of stage 5: (a Sender on trainer 0, a Receiver on each rollout
    rank), each None elsewhere. Both start from the same weights, so the first update is already a
    delta. With `copy` (a bf16 rollout copy) the deltas ship in the copy's dtype, into the copy."""
    if not role.split:
        return None, None
    dtype = None if copy is None else next(copy.parameters()).dtype
    sender = (Sender(model, dtype=dtype, mode="delta", synced=True)
              if dist.get_rank() == role.trainers[0] else None)
    return sender, Receiver(model if copy is None else copy) if role.collects else None


def ship(sender, receiver, role, version, rec):
    """Every rank: trainer 0 broadcasts what changed since the last shipment, the rollout ranks
    apply and verify it. Trainer 0 adds the bytes shipped to `rec`. Returns True where the weights
    changed (a rollout rank)."""
    upd = broadcast_update(sender.make_update(version=version) if sender else None,
                           role.trainers[0])
    if sender:
        st = sender.stats()
        rec.update(sync_bytes=st["bytes"], sync_full_bytes=st["full_bytes"], sync_ratio=st["ratio"])
    if receiver:
        receiver.apply(upd)
    return receiver is not None


def check_ranks_agree(model, world, log):
    """Every rank's weight checksum, logged: the ranks must hold the same weights, so check instead
    of trusting."""
    sums = gather(weight_checksum(model), world)
    log(f"weight checksum per rank: {' '.join(sums)}"
        + (" (identical)" if len(set(sums)) == 1 else " (DIFFERENT)"))
    return sums


# ----------------------------------------------------------------------------- FSDP


def shard(cfg, model, dev):
    """FSDP2: shard every block and the root over all ranks, in place. Returns a full, unsharded
    replica for the rollout and evaluation engines: generation runs a different number of forwards
    on each rank, which sharded weights (an all-gather per forward) cannot. `pull_full` refreshes it
    after every update."""
    if cfg.lora_r or cfg.resume or cfg.rollout_ranks:
        raise ValueError("config key 'fsdp' does not combine with lora_r, resume or rollout_ranks "
                         "yet")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        raise ValueError("config key 'fsdp' needs torchrun with at least 2 processes")
    replica = copy.deepcopy(model).requires_grad_(False)
    mesh = init_device_mesh(dev.type, (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return replica


@torch.no_grad()
def pull_full(replica, model):
    """FSDP: all-gather the sharded weights into the full replica (the same collectives on every
    rank)."""
    if replica is None:
        return
    dst = replica.state_dict()
    for k, v in model.state_dict().items():
        dst[k].copy_(v.full_tensor())
