"""
sync.py: stage 5, moving weights from the trainer to the rollout copy.
Ship the delta, not the model.

What it does:
    After each optimizer step the trainer's Sender builds a weight update, a transport moves it, and
    the rollout side's Receiver applies it and proves with a checksum that both sides now hold the
    same bytes.

    # trainer side; dtype = the rollout copy's dtype
    sender = Sender(policy, dtype=torch.bfloat16, mode="delta")
    receiver = Receiver(rollout_model)    # rollout side: a module or a state dict
    receiver.apply(sender.make_update())  # a FullUpdate first, DeltaUpdates after it
    # {'bytes': .., 'full_bytes': .., 'ratio': .., 'changed_fraction': .., ...}
    print(sender.stats())

    FullUpdate     every tensor, cast to the receiver's dtype.
    DeltaUpdate    only the elements whose bits changed since the last update shipped, compared
                   after the cast (most small fp32 steps vanish in bf16). Per tensor the cheapest
                   of: a bitmask (numel/8 bytes) + new values, int32 indices (int64 from 2^31
                   elements) + new values, all values when nearly everything changed, or "zdiff":
                   zlib over the bitmask and each changed element's step in bit patterns (mostly
                   +-1: one unit in the last place). Each is exact: the receiver ends on the
                   sender's bits. Unchanged tensors cost nothing. A delta applies only on its
                   base_version (and the checksum checks it).
    AdapterUpdate  only the LoRA tensors (names containing "lora_"): the receiver keeps them (an
                   engine that serves LoRA) or, given lora_scaling, merges them into its weights:
                   W + scaling * B @ A (`merge_lora`).

    Transports: `send_local(update, receiver)` (colocated); `broadcast_update(update_or_None, src)`,
    `send_update`, `recv_update` (torch.distributed, gloo or NCCL: one uint8 buffer);
    `FileTransport(folder)`: `.publish(update)` writes safetensors shards + manifest.json that
    appear complete (atomic rename), `.latest()`, `.poll(version)`.

The rollout copy that receives the updates (bf16, fp8, N:M) is copies.py's.

Simplifications:
    1. The sender keeps a shadow copy of what it shipped: one more copy of the model, in the
       receiver's dtype, on the model's device. That is the price of diffing against exactly what
       the receiver holds.
    2. The checksum hashes every synced tensor after every update, on the CPU (about a second per
       GB). The sender compresses every changed tensor's zdiff with zlib on the CPU, tens of MB/s.
    3. The distributed transport serialises the whole update into one buffer in memory.
    4. Adapter updates ship the whole adapter (it is small), and both checksums then cover the
       adapter; the merge is a deterministic local function of (base, adapter), tested against a
       merged full sync.
    5. One writer per FileTransport folder. A failed checksum leaves the receiver's weights unknown:
       resync with `sender.make_update(full=True)`.
    6. Tied weights (lm_head = embed_tokens) are shipped once; a receiver whose copies are not tied
       gets a copy.

Run:
    python sync.py  # delta vs full bytes for simulated Adam steps, fp32 and bf16 receivers
    python -m pytest -q tests/test_sync.py
"""

import hashlib
import json
import os
import re
import shutil
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load as st_load, load_file, save as st_save, save_file


# -------------------------------------------------------------------------- tensors, bits, checksum


def _state(x):
    """Name -> tensor, detached but sharing storage with the module's parameters, so writes land in
    the model."""
    if isinstance(x, nn.Module):
        return x.state_dict()
    if isinstance(x, dict):
        return {k: v.detach() for k, v in x.items()}
    raise TypeError(f"expected an nn.Module or a dict of tensors, got {type(x).__name__}")


def find_aliases(sd):
    """Tied names: {alias: name shipped}. Two names alias when they are the same storage, shape and
    stride."""
    seen, aliases = {}, {}
    for k in sorted(sd):
        v = sd[k]
        key = (v.device, v.data_ptr(), v.dtype, tuple(v.shape), v.stride())
        if v.numel() and key in seen:
            aliases[k] = seen[key]
        else:
            seen[key] = k
    return aliases


def state_checksum(sd):
    """sha256 over each tensor's name and bytes, in name order, as stored (so: in the receiver's
    dtype). Its first 16 hex digits equal model.weight_checksum on the same weights."""
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        # the bytes as stored, so equal hashes mean equal bits (CPU-GPU sync point)
        h.update(sd[k].detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return h.hexdigest()


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# most significant bit first, like numpy.packbits
# made once on the host on purpose, moved to a tensor's device where it is used
_SHIFT = torch.arange(7, -1, -1, dtype=torch.uint8, device="cpu")


def _bits(t):
    # compare bit patterns, not values: -0.0 == 0.0 and NaN != NaN would both break bit-exactness
    return t.reshape(-1).view(_INT[t.element_size()])


def pack_bits(mask):
    """bool (n,) -> uint8 (ceil(n/8),) in numpy.packbits' layout (numpy on the CPU: about 100x
    faster there)."""
    m = mask.reshape(-1)
    if m.device.type == "cpu":
        return torch.from_numpy(np.packbits(m.numpy()))
    # pad to a whole number of bytes, then one row of 8 bits per byte, shifted into place
    m = torch.cat([m.to(torch.uint8), m.new_zeros(-m.numel() % 8, dtype=torch.uint8)]).view(-1, 8)
    return (m << _SHIFT.to(m.device)).sum(1).to(torch.uint8)  # distinct bits: sum == OR


def unpack_bits(packed, n):
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n).view(np.bool_))
    # (bytes, 8) bits, most significant first; [:n] drops the padding bits of the last byte
    return ((packed.view(-1, 1) >> _SHIFT.to(packed.device)) & 1).reshape(-1)[:n].bool()


def delta_costs(numel, changed, elsize):
    """Bytes of each delta encoding of one tensor; the sender ships the cheapest."""
    idx = 4 if numel < 2**31 else 8  # int32 indices while they can address every element
    return {"dense": numel * elsize, "mask": (numel + 7) // 8 + changed * elsize,
            "index": changed * (idx + elsize)}


def zdiff_encode(old, new, diff):
    """zlib over the bitmask of `diff` and, at those elements, new bits - old bits as integers mod
    2^bits (signed, so a step of one unit in the last place is 1 or -1: bytes 0x00 and 0xff)."""
    mod = 1 << 8 * new.element_size()
    d = (_bits(new)[diff].long() - _bits(old)[diff].long()) % mod
    d = torch.where(d >= mod // 2, d - mod, d).to(_INT[new.element_size()])
    raw = pack_bits(diff.cpu()).numpy().tobytes() + d.cpu().numpy().tobytes()
    return torch.frombuffer(bytearray(zlib.compress(raw, 6)), dtype=torch.uint8)


def zdiff_apply(flat, packed):
    """zdiff_encode's inverse, in place on `flat` (the receiver's old bits): old + step."""
    n, mod = flat.numel(), 1 << 8 * flat.element_size()
    raw = zlib.decompress(packed.numpy().tobytes())
    m = (n + 7) // 8  # the mask's bytes, then the steps
    mask = unpack_bits(torch.frombuffer(bytearray(raw[:m]), dtype=torch.uint8), n)
    step = torch.frombuffer(bytearray(raw[m:]), dtype=_INT[flat.element_size()])
    bits = _bits(flat)  # a view: the writes land in the receiver's own tensor
    mask, step = mask.to(flat.device), step.to(flat.device).long()
    v = (bits[mask].long() + step) % mod
    bits[mask] = torch.where(v >= mod // 2, v - mod, v).to(bits.dtype)


def _desc(t, enc, changed=None):
    d = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "enc": enc}
    return d if changed is None else {**d, "changed": changed}

# ----------------------------------------------------------------------------- updates


@dataclass
class Update:
    """Payload tensors plus a JSON header. `tensors` holds "name" (full, adapter) or "name|values"
    with "name|mask" or "name|index", or "name|zdiff" (delta); `info[name]` gives each weight's
    shape, dtype and encoding."""
    version: int
    base_version: int | None
    checksum: str  # the sender's state_checksum after this update; the receiver must reproduce it
    tensors: dict
    info: dict
    aliases: dict = field(default_factory=dict)  # tied name -> the name that is shipped
    full_bytes: int = 0  # what a full update would have cost, for the stats
    kind = "?"

    @property
    def nbytes(self):
        """Payload bytes; the header (names, shapes) comes on top: a few hundred bytes per changed
        tensor."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def header(self):
        return dict(kind=self.kind, version=self.version, base_version=self.base_version,
                    checksum=self.checksum, info=self.info, aliases=self.aliases,
                    full_bytes=self.full_bytes)

    def to_bytes(self):
        return st_save(self.tensors, metadata={"update": json.dumps(self.header())})

    @staticmethod
    def from_parts(h, tensors):
        cls = {"full": FullUpdate, "delta": DeltaUpdate, "adapter": AdapterUpdate}[h["kind"]]
        return cls(h["version"], h["base_version"], h["checksum"], tensors, h["info"], h["aliases"],
                   h["full_bytes"])

    @staticmethod
    def from_bytes(buf):
        # safetensors: u64 header length, then the JSON header
        n = int.from_bytes(buf[:8], "little")
        h = json.loads(json.loads(buf[8:8 + n])["__metadata__"]["update"])
        return Update.from_parts(h, st_load(bytes(buf)))

    def check(self, weights):
        """Refuse before anything is written: the same names (all of them for a full update), shapes
        and dtypes."""
        for k in list(self.info) + list(self.aliases):
            if k not in weights:
                raise KeyError(f"{self.kind} update v{self.version}: the receiver has no tensor "
                               f"{k!r}")
        extra = (sorted(set(weights) - set(self.info) - set(self.aliases)) if self.kind == "full"
                 else [])
        if extra:
            raise KeyError(f"full update v{self.version} lacks tensors the receiver holds: "
                           f"{extra[:5]}")
        for name, d in self.info.items():
            w, dtype = weights[name], str(weights[name].dtype).removeprefix("torch.")
            if (list(w.shape), dtype) != (d["shape"], d["dtype"]):
                raise ValueError(f"{self.kind} update v{self.version}, tensor {name!r}: update has "
                                 f"{d['dtype']} {d['shape']}, receiver holds {dtype} "
                                 f"{list(w.shape)} (make the Sender with dtype=torch.{dtype})")
            if self.kind == "delta" and not w.is_contiguous():
                raise ValueError(f"tensor {name!r}: a delta is written through a flat view, it "
                                 f"must be contiguous")

    def apply_to(self, weights):
        for name in self.info:
            weights[name].copy_(self.tensors[name])


class FullUpdate(Update):
    kind = "full"


class AdapterUpdate(Update):
    kind = "adapter"


class DeltaUpdate(Update):
    kind = "delta"

    def apply_to(self, weights):
        for name, d in self.info.items():
            flat = weights[name].view(-1)  # a view: the writes land in the receiver's own tensor
            if d["enc"] == "zdiff":
                zdiff_apply(flat, self.tensors[name + "|zdiff"])
                continue
            values = self.tensors[name + "|values"].to(flat.device)
            if d["enc"] == "dense":
                flat.copy_(values)
            elif d["enc"] == "mask":  # values are the changed elements in flat order
                flat[unpack_bits(self.tensors[name + "|mask"].to(flat.device),
                                 flat.numel())] = values
            else:
                flat[self.tensors[name + "|index"].to(flat.device).long()] = values

# ----------------------------------------------------------------------------- LoRA


def lora_pairs(adapter_sd, base_sd):
    """Adapted weight name in base_sd -> {"A": name, "B": name}. PEFT names the adapter tensors
    <module>.lora_A[.<adapter>].weight (r, in) and <module>.lora_B[.<adapter>].weight (out, r);
    <module> may carry PEFT's "base_model.model." prefix, and a PEFT-wrapped base keeps its weight
    at <module>.base_layer.weight."""
    pairs = {}
    for k in sorted(adapter_sd):
        mod, _, rest = k.partition(".lora_")
        part = rest.split(".")[0]
        if part not in ("A", "B"):
            raise ValueError(f"adapter tensor {k!r}: only lora_A / lora_B are supported (not DoRA, "
                             f"not embeddings)")
        cands = [m + s for m in (mod, mod.removeprefix("base_model.model."))
                 for s in (".weight", ".base_layer.weight")]
        target = next((c for c in cands if c in base_sd), None)
        if target is None:
            raise KeyError(f"adapter tensor {k!r}: the base model has no weight "
                           f"{mod + '.weight'!r}")
        pairs.setdefault(target, {})[part] = k
    for target, p in pairs.items():
        if len(p) != 2:
            raise ValueError(f"weight {target!r} has {list(p.values())} but needs both lora_A and "
                             f"lora_B")
    return pairs


def merge_lora(base_sd, adapter_sd, scaling):
    """A copy of base_sd with W + scaling * B @ A for each adapted weight; fp32 math, one rounding
    to W's dtype."""
    out = dict(base_sd)
    for target, p in lora_pairs(adapter_sd, base_sd).items():
        W = base_sd[target]
        A = adapter_sd[p["A"]].to(W.device, torch.float32)
        B = adapter_sd[p["B"]].to(W.device, torch.float32)
        if A.shape[0] != B.shape[1] or (B.shape[0], A.shape[1]) != tuple(W.shape):
            raise ValueError(f"{target!r} {list(W.shape)}: lora_B {list(B.shape)} @ lora_A "
                             f"{list(A.shape)} won't fit")
        out[target] = (W.float() + (B @ A) * scaling).to(W.dtype)
    return out

# ----------------------------------------------------------------------------- sender and receiver


class Sender:
    """Trainer side. `dtype` is the receiver's (None: each tensor's own); mode is "delta", "full" or
    "adapter". synced=True: the receiver already holds these weights as version 0 (both loaded the
    same checkpoint)."""

    def __init__(self, source, dtype=None, mode="delta", synced=False):
        if mode not in ("delta", "full", "adapter"):
            raise ValueError(f"mode {mode!r}: expected 'delta', 'full' or 'adapter'")
        self.source, self.dtype, self.mode = source, dtype, mode
        self.version, self.aliases, self.last = 0, {}, {}
        # What the receiver holds. Invariant: its tensors are replaced, never written in place,
        # because updates already handed out may share their storage.
        self.shadow = {k: self._cast(v) for k, v in self._current().items()} if synced else None

    def _current(self):
        sd = _state(self.source)
        if self.mode == "adapter":
            sd = {k: v for k, v in sd.items() if "lora_" in k}
            if not sd:
                raise ValueError("mode='adapter' but the model has no LoRA tensors (no name "
                                 "contains 'lora_')")
        self.aliases = find_aliases(sd)
        return {k: v for k, v in sd.items() if k not in self.aliases}

    def _cast(self, v):
        # a private copy even when the dtype is unchanged; integer tensors keep theirs
        dtype = self.dtype if self.dtype is not None and v.is_floating_point() else v.dtype
        return v.detach().to(dtype, copy=True)

    def checksum(self):
        return state_checksum({**self.shadow,
                               **{a: self.shadow[n] for a, n in self.aliases.items()}})

    def make_update(self, full=False, version=None):
        """The update that takes the receiver from the last shipped version to the current
        weights."""
        version = self.version + 1 if version is None else version
        if version <= self.version:
            raise ValueError(f"update version {version} must be above the last shipped version "
                             f"{self.version}")
        cur = self._current()
        if self.mode == "delta" and self.shadow is not None and not full:
            update, changed = self._delta(cur, version)
        else:
            self.shadow = {k: self._cast(v) for k, v in cur.items()}
            info = {k: _desc(v, "full") for k, v in self.shadow.items()}
            cls = AdapterUpdate if self.mode == "adapter" else FullUpdate
            update = cls(version, None, "", {k: v.cpu() for k, v in self.shadow.items()}, info)
            changed = sum(v.numel() for v in cur.values())
        self.version = version
        update.aliases, update.checksum = dict(self.aliases), self.checksum()
        update.full_bytes = sum(v.numel() * v.element_size() for v in self.shadow.values())
        total = sum(v.numel() for v in self.shadow.values())
        self.last = dict(version=version, kind=update.kind, bytes=update.nbytes,
                         full_bytes=update.full_bytes,
                         ratio=update.nbytes / max(update.full_bytes, 1),
                         changed_fraction=changed / max(total, 1), tensors=len(update.info),
                         encodings=dict(Counter(d["enc"] for d in update.info.values())))
        return update

    def _delta(self, cur, version):
        # check every name before the shadow changes: a failed update must leave it as it was
        odd = set(self.shadow) ^ set(cur)
        odd |= {k for k in cur if k in self.shadow and cur[k].shape != self.shadow[k].shape}
        if odd:
            raise KeyError(f"tensors {sorted(odd)[:5]} appeared, vanished or changed shape since "
                           f"v{self.version}: send a full update (make_update(full=True))")
        tensors, info, changed = {}, {}, 0
        for name, v in cur.items():
            old, new = self.shadow[name], self._cast(v)
            diff = _bits(new) != _bits(old)
            k = int(diff.sum())  # CPU-GPU sync point
            if k == 0:
                continue  # unchanged tensors cost nothing
            costs = delta_costs(new.numel(), k, new.element_size())
            packed = zdiff_encode(old, new, diff) if new.element_size() in (2, 4) else None
            costs["zdiff"] = packed.numel() if packed is not None else float("inf")
            enc = min(costs, key=costs.get)
            flat = new.reshape(-1)
            if enc == "zdiff":
                tensors[name + "|zdiff"] = packed
            else:  # new values, in flat order; mask or index says where they go
                tensors[name + "|values"] = (flat if enc == "dense" else flat[diff]).cpu()
            if enc == "mask":
                tensors[name + "|mask"] = pack_bits(diff).cpu()
            elif enc == "index":
                idx_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
                tensors[name + "|index"] = diff.nonzero().view(-1).to(idx_dtype).cpu()
            info[name] = _desc(new, enc, changed=k)
            self.shadow[name] = new  # now what the receiver will hold after this update
            changed += k
        return DeltaUpdate(version, self.version, "", tensors, info), changed

    def stats(self):
        return dict(self.last)


class Receiver:
    """Rollout side: applies updates in place to a module's (or a dict's) own tensors. lora_scaling:
    merge adapter updates into the weights (W + scaling * B @ A) instead of only keeping them in
    `self.adapter`."""

    def __init__(self, target, lora_scaling=None):
        self.weights = _state(target)
        self.version, self.adapter, self.lora_scaling = 0, {}, lora_scaling
        self._base = {}  # pristine copies of the weights that LoRA merges into

    def checksum(self):
        return state_checksum(self.adapter if self.adapter else self.weights)

    @torch.no_grad()
    def apply(self, update):
        if isinstance(update, DeltaUpdate) and update.base_version != self.version:
            raise ValueError(f"delta update v{update.base_version}->v{update.version} needs the "
                             f"receiver on version {update.base_version}, but it is on version "
                             f"{self.version}: apply the missing updates or a full update")
        if isinstance(update, AdapterUpdate):
            self._apply_adapter(update)
        else:
            update.check(self.weights)
            update.apply_to(self.weights)
            for alias, name in update.aliases.items():
                if self.weights[alias].data_ptr() != self.weights[name].data_ptr():
                    # untied on this side
                    self.weights[alias].copy_(self.weights[name])
        got = self.checksum()
        if got != update.checksum:
            raise RuntimeError(f"checksum mismatch after applying {update.kind} update "
                               f"v{update.base_version}->v{update.version}: receiver {got[:16]} != "
                               f"sender {update.checksum[:16]}; resync with a full update")
        self.version = update.version
        return self

    def _apply_adapter(self, update):
        if self.lora_scaling is None and all(k in self.weights for k in update.info):
            # a model that serves LoRA
            update.check(self.weights)
            update.apply_to(self.weights)
            self.adapter = {k: self.weights[k] for k in update.info}
            return
        adapter = {k: v.clone() for k, v in update.tensors.items()}
        if self.lora_scaling is not None:
            for name in lora_pairs(adapter, self.weights):
                # the first adapter merges into pristine weights: keep them
                self._base.setdefault(name, self.weights[name].clone())
            merged = merge_lora(self._base, adapter, self.lora_scaling)
            for name, w in merged.items():
                self.weights[name].copy_(w)
        self.adapter = adapter

# ----------------------------------------------------------------------------- transports


def send_local(update, receiver):
    """Colocated: the object is handed over as is; the apply still checks the version and the
    checksum."""
    return receiver.apply(update)


def _move(update, peer, op, group):
    """Move one update as an int64 length and then one uint8 buffer: two messages whatever the model
    size. op is dist.broadcast (peer = src), dist.send (peer = dst) or dist.recv (peer = src);
    update is None to receive."""
    import torch.distributed as dist
    dev = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
           else "cpu")
    buf = (None if update is None
           else torch.frombuffer(bytearray(update.to_bytes()), dtype=torch.uint8).to(dev))
    size = torch.tensor([0 if buf is None else buf.numel()], dtype=torch.int64, device=dev)
    op(size, peer, group=group)
    if buf is None:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    op(buf, peer, group=group)
    return update if update is not None else Update.from_bytes(buf.cpu().numpy().tobytes())


def broadcast_update(update, src, group=None):
    """Every rank calls this; rank `src` (a global rank) passes its update, the others None; all
    return it."""
    import torch.distributed as dist
    if dist.get_rank() == src and update is None:
        raise ValueError(f"broadcast_update: rank {src} is the source and must pass an update, not "
                         f"None")
    return _move(update if dist.get_rank() == src else None, src, dist.broadcast, group)


def send_update(update, dst, group=None):
    import torch.distributed as dist
    _move(update, dst, dist.send, group)


def recv_update(src, group=None):
    import torch.distributed as dist
    return _move(None, src, dist.recv, group)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)  # works for folders too (POSIX): makes a rename durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path, text):
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class FileTransport:
    """folder/updates/v000012/{manifest.json, shard-00001-of-00002.safetensors, ..} and
    folder/LATEST ("v000012"). A version folder is written as .tmp-v000012, fsynced, and appears by
    one atomic rename, so readers never see half an update; LATEST is replaced atomically after it.
    A full update's shards are a plain safetensors checkpoint (one name per weight, listed in the
    manifest's weight_map) that another engine can load.
    keep: how many versions to keep (None: all); a receiver that falls behind the kept deltas needs
    a full update."""

    def __init__(self, folder, shard_bytes=512 << 20, keep=None, pause_between_shards=0.0):
        self.folder, self.updates = folder, os.path.join(folder, "updates")
        self.shard_bytes, self.keep = shard_bytes, keep
        # a test hook: lets a test kill the writer mid-update
        self.pause_between_shards = pause_between_shards

    def _shards(self, tensors):
        parts, size = [{}], 0
        for k in sorted(tensors):
            n = tensors[k].numel() * tensors[k].element_size()
            if parts[-1] and size + n > self.shard_bytes:
                parts, size = parts + [{}], 0
            parts[-1][k], size = tensors[k].contiguous(), size + n
        return parts if parts[0] else []

    def publish(self, update):
        name = f"v{update.version:06d}"
        final, tmp = os.path.join(self.updates, name), os.path.join(self.updates, ".tmp-" + name)
        if os.path.exists(final):
            raise FileExistsError(f"update version {update.version} is already published at "
                                  f"{final}")
        os.makedirs(self.updates, exist_ok=True)
        for d in os.listdir(self.updates):
            if d.startswith(".tmp-"):
                # left by a writer that died mid-write (one writer per folder)
                shutil.rmtree(os.path.join(self.updates, d))
        os.makedirs(tmp)
        parts, weight_map = self._shards(update.tensors), {}
        for i, part in enumerate(parts):
            fn = f"shard-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            save_file(part, os.path.join(tmp, fn), metadata={"format": "pt"})
            _fsync(os.path.join(tmp, fn))
            weight_map.update({k: fn for k in part})
            if self.pause_between_shards:
                time.sleep(self.pause_between_shards)
        manifest = {**update.header(), "shards": sorted(set(weight_map.values())),
                    "weight_map": weight_map}
        _write_synced(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=1))
        _fsync(tmp)
        os.rename(tmp, final)  # the publish: the folder appears complete or not at all
        _fsync(self.updates)
        _write_synced(os.path.join(self.folder, "LATEST.tmp"), name + "\n")
        os.replace(os.path.join(self.folder, "LATEST.tmp"), os.path.join(self.folder, "LATEST"))
        _fsync(self.folder)
        for v in self.versions()[:-self.keep] if self.keep else []:
            shutil.rmtree(os.path.join(self.updates, f"v{v:06d}"))
        return final

    def versions(self):
        """Complete versions on disk, oldest first (temporary folders never match)."""
        if not os.path.isdir(self.updates):
            return []
        return sorted(int(d[1:]) for d in os.listdir(self.updates) if re.fullmatch(r"v\d+", d))

    def manifest(self, version):
        with open(os.path.join(self.updates, f"v{version:06d}", "manifest.json")) as f:
            return json.load(f)

    def load(self, version):
        m, tensors = self.manifest(version), {}
        for fn in m["shards"]:
            tensors.update(load_file(os.path.join(self.updates, f"v{version:06d}", fn)))
        return Update.from_parts(m, tensors)

    def latest(self):
        """The update LATEST names, or None before the first publish."""
        try:
            with open(os.path.join(self.folder, "LATEST")) as f:
                name = f.read().strip()
        except FileNotFoundError:
            return None
        return self.load(int(name[1:]))

    def poll(self, after_version):
        """The updates a receiver on `after_version` needs, in order, starting at the newest full
        (or adapter) one."""
        vs = [v for v in self.versions() if v > after_version]
        fulls = [v for v in vs if self.manifest(v)["kind"] != "delta"]
        return [self.load(v) for v in (vs[vs.index(fulls[-1]):] if fulls else vs)]

# ------------------------------------------------------------------------ demo: a simulated RL step


def simulate_rl_sync(steps=4, lr=1e-5, dtype=torch.bfloat16, seed=0, cfg=None):
    """Adam steps on a tiny model, each synced by a delta to a receiver in `dtype`; returns each
    step's stats."""
    from model import ModelConfig, Transformer
    torch.manual_seed(seed)
    cfg = cfg or ModelConfig()
    policy, rollout = Transformer(cfg), Transformer(cfg).to(dtype)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    sender, receiver = Sender(policy, dtype=dtype), Receiver(rollout)
    receiver.apply(sender.make_update())  # the first sync is full
    out = []
    for _ in range(steps):
        idx = torch.randint(0, cfg.vocab_size, (4, 32), device="cpu")  # the demo runs there
        loss = torch.nn.functional.cross_entropy(policy(idx[:, :-1]).flatten(0, 1),
                                                 idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        receiver.apply(sender.make_update())
        out.append(sender.stats())
    return out


if __name__ == "__main__":
    print(f"{'receiver':>9} {'lr':>7} {'changed':>8} {'delta bytes':>12} {'full bytes':>11} ratio")
    for dtype in (torch.float32, torch.bfloat16):
        for lr in (1e-6, 1e-5, 1e-4, 1e-3):
            s = simulate_rl_sync(steps=3, lr=lr, dtype=dtype)[-1]
            print(f"{str(dtype)[6:]:>9} {lr:7.0e} {s['changed_fraction']:8.2%} {s['bytes']:12,d} "
                  f"{s['full_bytes']:11,d} {s['ratio']:.3f} {s['encodings']}")
