"""
copies.py: stage 4, the rollout copy. A cheaper model generates; the trainer scores the same tokens
in full precision, and the loss corrects the mismatch with importance weights (update.is_weights).

    # form: "same" (the policy itself) | "bf16" | "fp8" | "nm2:4" (N:M-pruned) | "PLAN.json"
    copy = make_rollout_copy(policy, "fp8")
    copy = make_rollout_copy(policy, "nm2:4", mask="wanda", calib=batches)  # or a mask file
    engine = Engine(copy, tokenizer)    # and after each optimizer step:
    refresh_rollout_copy(copy, policy)  # in place: fp8/int8 re-quantise, nm re-masks;
                                        # policy may also be a dict of tensors
    describe_copy(copy)  # 'fp8: 0.02 MiB of weights, 0.29x fp32; 14 Linear in fp8 W8A8 (..)'
    python train.py --rollout_copy=fp8 --is_correction=tis  # in the loop
    python train.py --rollout_copy=nm2:4 --rollout_copy_mask=wanda  # | magnitude | MASK_FILE
    python train.py --rollout_copy=out/hirelc/plan.json  # a per-block plan (examples/hirelc.py)

fp8 swaps each Linear for an FP8Linear (e4m3 weights with per-output-channel scales, inputs scaled
per token; torch._scaled_mm on GPUs of compute capability 8.9+, simulated elsewhere); int8 (plans
only) for an Int8Linear, the same with int8 and rounding, always simulated. The head, the embeddings
and the MoE router stay in the copy's dtype. A bf16 copy can take sync.Sender(policy,
dtype=torch.bfloat16) updates directly. fp8, int8 and nm copies hold other tensors than the policy's
(quantised weights and scales; masked weights), so a remote one receives the bf16 delta into a dense
staging dict and then runs `refresh_rollout_copy(copy, staging)`.

Where an N:M copy's masks come from (`mask`, config key rollout_copy_mask):
    magnitude  the n largest |w| of every m, recomputed from the new weights at every refresh
    wanda      |w| * ||x||_2: the input norms from a forward pre-hook over calibration batches
               (a few of the task's prompts) on the policy the copy is made from, fixed for the
               run; the scores follow |w| at every refresh
    PATH       fixed masks from a file: `python roi.py learn|apply ... --out=DIR` writes
               DIR/masks.pt (PATH may be the file or DIR); a mask must have its layer's shape and
               keep exactly n of every m, or the copy is refused with the layer named

A plan (JSON, written by examples/hirelc.py) gives each block (a module prefix such as
"model.layers.3") an N:M pattern or "dense" and a precision, bf16, fp8 or int8:
    {"blocks": {"model.layers.0": {"nm": "2:4", "precision": "fp8"}, ...}}
Linears outside every block stay bf16 and dense; N:M masks are applied before quantising.

Simplifications:
    1. The rollout copy is a whole second model, refreshed in full after every step.
    2. Off fp8 GPUs the fp8 copy dequantises in every forward (slower than bf16: it measures the
       mismatch, not the speed); int8 is simulated everywhere.
    3. N:M copies store their zeros (masked dense: no speed without a 2:4 kernel).
    4. With LoRA the copy is made from the merged weights, so the adapter is quantised or pruned
       with its layer.
    5. Wanda's calibration statistic is taken once, from the policy the run starts with.

    python -m pytest -q tests/test_copies.py
"""

import copy as copy_module
import functools
import json
import os
import pickle
import re
from copy import deepcopy

import torch
import torch.nn as nn

from model import merge_lora, merged_state_dict
from sparsity import input_norms, nm_mask


# ----------------------------------------------------------------- the rollout copy: bf16, fp8, N:M

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric int8: -127..127
# kept in the copy's dtype: the head (tied embeddings), the MoE router
COPY_SKIP = ("lm_head", "embed", "gate.")
PRECISIONS = ("bf16", "fp8", "int8")
WANDA_PROMPTS = 32  # calibration prompts for rollout_copy_mask=wanda


def parse_form(form):
    """'same' | 'bf16' | 'fp8' | 'nm<N>:<M>' ('nm' and '2:4' are accepted too) | a plan's path
    ('*.json') -> (kind, n, m, canonical name)."""
    if form in ("same", "bf16", "fp8"):
        return form, 0, 0, form
    if str(form).endswith(".json"):
        return "plan", 0, 0, str(form)
    hit = re.fullmatch(r"(?:nm)?(\d+):(\d+)", "nm2:4" if form == "nm" else str(form))
    if not hit or not 0 < int(hit[1]) <= int(hit[2]):
        raise ValueError(f"rollout copy form {form!r}: expected 'same', 'bf16', 'fp8', "
                         f"'nm<N>:<M>' with 0 < N <= M (e.g. 'nm2:4') or a plan file '*.json'")
    n, m = int(hit[1]), int(hit[2])
    return "nm", n, m, f"nm{n}:{m}"


def to_grid(x, qdtype, qmax):
    """x already divided by its scale -> qdtype: clamped to +-qmax; int8 rounds to nearest first
    (a float -> int8 cast would truncate)."""
    x = x.clamp(-qmax, qmax)
    return (x.round() if qdtype == torch.int8 else x).to(qdtype)


def quantize(w, qdtype=torch.float8_e4m3fn, qmax=FP8_MAX):
    """w (out, in) -> q (out, in) in qdtype, fp32 scales (out,): one scale per output row,
    amax / qmax, so each row's largest weight lands on the grid's largest value and
    w ~= q * scale[:, None]."""
    scale = w.detach().abs().amax(1).float().clamp(min=1e-12) / qmax
    return to_grid(w.detach().float() / scale[:, None], qdtype, qmax), scale


def quantize_fp8(w):
    return quantize(w, torch.float8_e4m3fn, FP8_MAX)


@functools.cache
def _fp8_gpu(device):
    # Ada and Hopper have fp8 tensor cores
    return torch.cuda.get_device_capability(device) >= (8, 9)


class FP8Linear(nn.Module):
    """A Linear with an fp8 weight and per-output-channel scales, run W8A8 as FP8 rollout engines
    do: each forward also quantises its input per token (amax / 448), multiplies in fp8 and
    accumulates in fp32. torch._scaled_mm does it on a GPU of compute capability 8.9 or more (for
    bf16 inputs and dimensions divisible by 16); elsewhere the same numbers are simulated by
    dequantising both operands to fp32. `scaled_mm`: None picks by device and shape, True or False
    forces a path (the tests compare them on the CPU, whose _scaled_mm is a reference)."""
    QDTYPE, QMAX = torch.float8_e4m3fn, FP8_MAX

    def __init__(self, in_features, out_features, bias=None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.scaled_mm = in_features, out_features, None
        self.register_buffer("weight", torch.empty(out_features, in_features,
                                                   dtype=self.QDTYPE, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, device=device))
        self.bias = bias  # a Parameter in the copy's dtype, or None

    @classmethod
    def from_linear(cls, linear):
        return cls(linear.in_features, linear.out_features, linear.bias,
                   linear.weight.device).requantize(linear.weight)

    @torch.no_grad()
    def requantize(self, w):
        q, s = quantize(w.to(self.weight.device), self.QDTYPE, self.QMAX)
        self.weight.copy_(q)
        self.weight_scale.copy_(s)
        return self

    def dequantized(self):  # (out, in) fp32
        return self.weight.float() * self.weight_scale[:, None]

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, self.in_features)  # (M, in)
        # (M, 1) per token
        sx = x.detach().abs().amax(1, keepdim=True).float().clamp(min=1e-12) / self.QMAX
        xq = to_grid(x.float() / sx, self.QDTYPE, self.QMAX).contiguous()
        use = self.scaled_mm if self.QDTYPE == torch.float8_e4m3fn else False
        if use is None:
            use = (x.is_cuda and x.dtype == torch.bfloat16 and _fp8_gpu(x.device)
                   and self.in_features % 16 == 0 and self.out_features % 16 == 0)
        if use:  # weight.t() is the column-major (in, out) operand that _scaled_mm wants
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=sx, scale_b=self.weight_scale[None],
                                 out_dtype=x.dtype)
        else:
            y = ((xq.float() * sx) @ self.dequantized().t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


class Int8Linear(FP8Linear):
    """FP8Linear's W8A8 on a symmetric int8 grid (scales amax / 127, round to nearest), always
    simulated in fp32 (an int8 GEMM would give the same sums exactly, up to fp32 rounding)."""
    QDTYPE, QMAX = torch.int8, INT8_MAX


QUANTIZED = {"fp8": FP8Linear, "int8": Int8Linear}


# ----------------------------------------------------------------------- plans and mask files


def load_plan(path):
    """A plan file -> {block prefix: (n, m, precision)}, n = m = 0 for dense. Every entry checked,
    each error naming the file and the block."""
    try:
        with open(path) as f:
            blocks = json.load(f)["blocks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"rollout copy plan {path}: cannot read its 'blocks' ({e})") from None
    plan = {}
    for name, b in blocks.items():
        hit = re.fullmatch(r"(\d+):(\d+)", str(b.get("nm", "dense")))
        if (b.get("precision") not in PRECISIONS
                or not (hit and 0 < int(hit[1]) <= int(hit[2]) or b.get("nm") == "dense")):
            raise ValueError(f"rollout copy plan {path}: block {name!r} wants nm 'dense' or 'N:M' "
                             f"and precision {'|'.join(PRECISIONS)}, got {b}")
        plan[name] = (int(hit[1]), int(hit[2]), b["precision"]) if hit else (0, 0, b["precision"])
    return plan


def block_of(wname, plan):
    """The plan's block that holds weight `wname` (the longest matching prefix), or None."""
    hits = [b for b in plan if wname.startswith(b + ".")]
    return max(hits, key=len) if hits else None


def load_masks(path):
    """A mask file (roi.py writes OUT_DIR/masks.pt; PATH may be that folder) -> (n, m, {weight
    name: bool mask})."""
    if os.path.isdir(path):
        path = os.path.join(path, "masks.pt")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        return int(saved["n"]), int(saved["m"]), dict(saved["masks"])
    except (OSError, KeyError, TypeError, RuntimeError, pickle.UnpicklingError) as e:
        raise ValueError(f"rollout copy mask file {path}: not a mask file from roi.py "
                         f"(want n, m and masks): {e}") from None


def check_mask_task(path, cfg):
    """A mask file fitted on another task is refused: roi.py records the task and order it
    learned on (files without the record pass)."""
    if os.path.isdir(path):
        path = os.path.join(path, "masks.pt")
    try:
        task = torch.load(path, map_location="cpu", weights_only=True).get("task")
    except (OSError, AttributeError, RuntimeError, pickle.UnpicklingError):
        return  # load_masks names what is wrong with the file
    if task and (task.get("task"), task.get("order")) != (str(cfg.task), str(cfg.order)):
        raise ValueError(f"rollout copy mask file {path} was fitted on task {task.get('task')}, "
                         f"order {task.get('order')}; this run is task {cfg.task}, order "
                         f"{cfg.order}: learn a mask on this run's model (python roi.py learn)")


def check_masks(masks, layers, path):
    """Mask-file masks against the copy's pruned layers ({weight name: (weight, n, m)}): same
    names, same shapes, exactly n of every m kept. -> the masks, on the weights' devices."""
    missing = sorted(set(layers) - set(masks))
    if missing:
        raise ValueError(f"rollout copy mask file {path}: no mask for {missing[:3]} "
                         f"({len(missing)} layers)")
    out = {}
    for k, (w, n, m) in layers.items():
        mask = masks[k]
        if tuple(mask.shape) != tuple(w.shape):
            raise ValueError(f"rollout copy mask file {path}: {k} is {tuple(mask.shape)}, the "
                             f"model's weight is {tuple(w.shape)}")
        kept = mask.bool().reshape(w.shape[0], -1, m).sum(-1)
        if not (kept == n).all():
            raise ValueError(f"rollout copy mask file {path}: {k} does not keep exactly {n} of "
                             f"every {m}")
        out[k] = mask.bool().to(w.device)
    return out


# ------------------------------------------------------------------------------ making the copy


def pruned_layers(copy, kind, n, m, plan):
    """{weight name: (n, m)} of the copy's N:M layers: every prunable Linear for an nm form, the
    blocks with a pattern for a plan."""
    names = [f"{k}.weight" for k, mod in copy.named_modules()
             if isinstance(mod, nn.Linear) and not any(s in f"{k}.weight" for s in COPY_SKIP)]
    if kind == "nm":
        return {k: (n, m) for k in names}
    out = {}
    for k in names:
        b = block_of(k, plan or {})
        if b is not None and plan[b][0]:
            out[k] = plan[b][:2]
    return out


def make_rollout_copy(model, form="same", mask="magnitude", calib=None):
    """The model that generates rollouts: the policy itself ('same'), or a copy in bf16, in fp8
    (FP8Linear for every Linear but the head and the router; the rest bf16), N:M-pruned ('nm2:4':
    the policy's dtype, masked), or a plan's per-block mix (bf16 base). `mask` says where N:M masks
    come from: 'magnitude', 'wanda' (input norms over `calib`, batches for sparsity.input_norms) or
    a mask file's path. The copy is built without a full-precision duplicate (deepcopy with every
    parameter swapped for an empty one in the copy's dtype) and then filled by
    `refresh_rollout_copy`. Its log-probs differ from the policy's: train with truncated IS,
    min(p_train / p_rollout, C)."""
    kind, n, m, name = parse_form(form)
    model = getattr(model, "module", model)  # a DDP wrapper: copy what it wraps
    if kind == "same":
        return model
    plan = load_plan(form) if kind == "plan" else None
    dtype = torch.bfloat16 if kind in ("bf16", "fp8", "plan") else None

    def cast(t):
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    # deepcopy takes what the memo holds for an object it has already seen, so ties stay tied.
    # Parameters start empty (refresh fills them); buffers are small and some are not in the state
    # dict: cast them now.
    memo = {id(p): nn.Parameter(torch.empty_like(p, dtype=cast(p)), requires_grad=False)
            for p in model.parameters()}
    memo.update({id(b): b.detach().to(cast(b), copy=True) for b in model.buffers()})
    copy = deepcopy(model, memo)
    linears = {k: mod for k, mod in copy.named_modules() if isinstance(mod, nn.Linear)
               and not any(s in f"{k}.weight" for s in COPY_SKIP)}
    unused = [b for b in plan or {} if not any(k.startswith(b + ".") for k in linears)]
    if unused:
        raise ValueError(f"rollout copy plan {form}: the model has no Linear under {unused[:3]}")
    copy.rollout_form, copy.rollout_nm = name, pruned_layers(copy, kind, n, m, plan)
    for k, mod in linears.items():  # after pruned_layers: it looks for nn.Linear
        prec = "fp8" if kind == "fp8" else (plan[block_of(f"{k}.weight", plan)][2]
                                            if block_of(f"{k}.weight", plan or {}) else "bf16")
        if prec in QUANTIZED:
            parent, _, child = k.rpartition(".")
            q = QUANTIZED[prec](mod.in_features, mod.out_features, mod.bias, mod.weight.device)
            setattr(copy.get_submodule(parent), child, q)
    copy.rollout_mask, copy.rollout_norms, copy.rollout_masks = str(mask), None, None
    if mask == "wanda" and copy.rollout_nm:
        if calib is None:
            raise ValueError("rollout_copy_mask=wanda needs calibration batches (calib)")
        norms = input_norms(model, calib, skip=COPY_SKIP)
        copy.rollout_norms = {k: norms[k] for k in copy.rollout_nm}
    elif mask not in ("magnitude", "wanda") and copy.rollout_nm:
        fn, fm, saved = load_masks(mask)
        if any((fn, fm) != nm for nm in copy.rollout_nm.values()):
            raise ValueError(f"rollout copy mask file {mask}: its masks are {fn}:{fm}, the copy "
                             f"wants {sorted(set(copy.rollout_nm.values()))}")
        weights = dict(model.named_parameters())
        copy.rollout_masks = check_masks(
            saved, {k: (weights[k], *nm) for k, nm in copy.rollout_nm.items()}, mask)
    return refresh_rollout_copy(copy.eval(), model)


def copy_mask(copy, wname, w):
    """The N:M mask of one of the copy's pruned layers for source weight w: fixed (a mask file),
    Wanda's |w| * ||x|| with the copy's fixed input norms, or magnitude."""
    n, m = copy.rollout_nm[wname]
    if copy.rollout_masks is not None:
        return copy.rollout_masks[wname]
    if copy.rollout_norms is not None:
        return nm_mask(w, n, m, scores=w.detach().float().abs()
                       * copy.rollout_norms[wname][None].to(w.device))
    return nm_mask(w, n, m)


@torch.no_grad()
def refresh_rollout_copy(copy, source, form=None):
    """Re-derive the copy's weights from `source` (the policy, or a dict of its tensors, e.g. a
    Receiver's dense staging copy) in place: the same tensors, so the engine and any captured graph
    keep pointing at them. fp8 and int8 re-quantise; N:M layers are re-masked (masks recomputed from
    the new weights, or fixed ones) before quantising."""
    kind, _, _, name = parse_form(form or getattr(copy, "rollout_form", "same"))
    if name != getattr(copy, "rollout_form", "same"):
        raise ValueError(f"refresh_rollout_copy: form {name!r} but the copy was made as "
                         f"{getattr(copy, 'rollout_form', 'same')!r}")
    if kind == "same":
        return copy  # the copy is the policy: nothing to do
    source = getattr(source, "module", source)
    # a module, or a dict of tensors
    src = source.state_dict() if isinstance(source, nn.Module) else source
    quant = {k: v for k, v in copy.named_modules() if isinstance(v, FP8Linear)}
    dst = {k: v for k, v in copy.state_dict().items()
           if not (k.rpartition(".")[0] in quant
                   and k.rpartition(".")[2] in ("weight", "weight_scale"))}
    missing = sorted(({f"{k}.weight" for k in quant} | set(dst)) - set(src))
    if missing:
        raise KeyError(f"refresh_rollout_copy: the source lacks {missing[:5]} ({len(missing)} "
                       f"tensors)")
    nm = getattr(copy, "rollout_nm", {})
    for k, mod in quant.items():
        w = src[f"{k}.weight"]
        if f"{k}.weight" in nm:  # prune, then quantise what is kept
            w = w * copy_mask(copy, f"{k}.weight", w).to(w.device)
        mod.requantize(w)
    for k, v in dst.items():
        v.copy_(src[k])  # casts to the copy's dtype
        if k in nm:
            v.masked_fill_(~copy_mask(copy, k, src[k]).to(v.device), 0)
    return copy


def describe_copy(copy):
    """One short line for the log: the form, the bytes its weights take, and that against fp32."""
    name = getattr(copy, "rollout_form", "same")
    # tied weights counted once
    tensors = dict(copy.named_parameters(), **dict(copy.named_buffers()))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    fp32 = sum(t.numel() * 4 for k, t in tensors.items() if not k.endswith("weight_scale"))
    line = f"{name}: {nbytes / 2**20:.2f} MiB of weights, {nbytes / max(fp32, 1):.2f}x fp32"
    for cls, what in ((Int8Linear, "int8 W8A8 (simulated)"), (FP8Linear, "fp8 W8A8")):
        q = [m for m in copy.modules() if type(m) is cls]
        if q and cls is FP8Linear:
            w = q[0].weight
            what += " (torch._scaled_mm)" if w.is_cuda and _fp8_gpu(w.device) else " (simulated)"
        if q:
            line += f"; {len(q)} Linear in {what}"
    nm = getattr(copy, "rollout_nm", {})
    for pattern in sorted(set(nm.values())):
        count = sum(v == pattern for v in nm.values())
        line += (f"; {count} Linear masked {pattern[0]}:{pattern[1]} ({copy.rollout_mask} masks, "
                 f"zeros stored, dense compute)")
    return line


# ----------------------------------------------------------------------------- in the loop


def calib_batches(prompt_ids, n=WANDA_PROMPTS, batch=16):
    """Wanda's calibration data for the copy: the first n prompts, right-padded, as (ids, valid)
    batches for sparsity.input_norms (padding does not count)."""
    rows, out = [list(p) for p in prompt_ids[:n]], []
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        ids = torch.zeros(len(part), max(map(len, part)), dtype=torch.long)
        valid = torch.zeros(ids.shape, dtype=torch.bool)
        for j, r in enumerate(part):
            ids[j, :len(r)], valid[j, :len(r)] = torch.tensor(r), True
        out.append((ids, valid))
    return out


def rollout_model_for(cfg, model, prompt_ids=None):
    """The model that generates, from config keys rollout_copy and rollout_copy_mask: the policy
    itself, or a bf16 / fp8 / N:M / plan copy. `prompt_ids` (the task's prompts) calibrate Wanda."""
    if cfg.rollout_copy == "same":
        return model
    mask = getattr(cfg, "rollout_copy_mask", "magnitude")
    if mask == "wanda" and not prompt_ids:
        raise ValueError("config key 'rollout_copy_mask' = wanda needs the task's prompts")
    calib = calib_batches(prompt_ids) if mask == "wanda" else None
    if mask not in ("magnitude", "wanda"):
        check_mask_task(mask, cfg)
    return make_rollout_copy(merge_lora(copy_module.deepcopy(model)) if cfg.lora_r else model,
                             cfg.rollout_copy, mask, calib)


def refresh(rollout_model, model, lora):
    """After an update: re-derive the rollout copy from the policy (a no-op when they are the same
    object)."""
    if rollout_model is not model:
        refresh_rollout_copy(rollout_model, merged_state_dict(model) if lora else model)
