"""
copies.py: stage 4, the rollout copy. A cheaper model generates; the trainer scores the same tokens
in full precision, and the loss corrects the mismatch with importance weights (update.is_weights).

    # form: "same" (the policy itself) | "bf16" | "fp8" | "nm2:4" (N:M-pruned)
    copy = make_rollout_copy(policy, "fp8")
    engine = Engine(copy, tokenizer)    # and after each optimizer step:
    refresh_rollout_copy(copy, policy)  # in place: fp8 re-quantises, nm re-masks;
                                        # policy may also be a dict of tensors
    describe_copy(copy)  # 'fp8: 0.02 MiB of weights, 0.29x fp32; 14 Linear in fp8 W8A8 (..)'
    python train.py --rollout_copy=fp8 --is_correction=tis  # in the loop

fp8 swaps each Linear for an FP8Linear (e4m3 weights with per-output-channel scales, inputs scaled
per token; torch._scaled_mm on GPUs of compute capability 8.9+, simulated elsewhere); nm applies
sparsity.apply_nm's magnitude masks. The head, the embeddings and the MoE router stay in the copy's
dtype. A bf16 copy can take sync.Sender(policy, dtype=torch.bfloat16) updates directly. fp8 and nm
copies hold other tensors than the policy's (fp8 weights and scales; masked weights), so a remote
one receives the bf16 delta into a dense staging dict and then runs
`refresh_rollout_copy(copy, staging)`.

Simplifications:
    1. The rollout copy is a whole second model, refreshed in full after every step.
    2. Off fp8 GPUs the fp8 copy dequantises in every forward (slower than bf16: it measures the
       mismatch, not the speed).
    3. N:M copies store their zeros (masked dense: no speed without a 2:4 kernel), with magnitude
       masks.
    4. With LoRA the copy is made from the merged weights, so the adapter is quantised or pruned
       with its layer.

    python -m pytest -q tests/test_copies.py
"""

import copy as copy_module
import functools
import re
from copy import deepcopy

import torch
import torch.nn as nn

from model import merge_lora, merged_state_dict
from sparsity import apply_nm


# ----------------------------------------------------------------- the rollout copy: bf16, fp8, N:M

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# kept in the copy's dtype: the head (tied embeddings), the MoE router
COPY_SKIP = ("lm_head", "embed", "gate.")


def parse_form(form):
    """'same' | 'bf16' | 'fp8' | 'nm<N>:<M>' ('nm' and '2:4' are accepted too) -> (kind, n, m,
    canonical name)."""
    if form in ("same", "bf16", "fp8"):
        return form, 0, 0, form
    hit = re.fullmatch(r"(?:nm)?(\d+):(\d+)", "nm2:4" if form == "nm" else str(form))
    if not hit or not 0 < int(hit[1]) <= int(hit[2]):
        raise ValueError(f"rollout copy form {form!r}: expected 'same', 'bf16', 'fp8' or "
                         f"'nm<N>:<M>' with 0 < N <= M, e.g. 'nm2:4'")
    n, m = int(hit[1]), int(hit[2])
    return "nm", n, m, f"nm{n}:{m}"


def quantize_fp8(w):
    """w (out, in) -> fp8 e4m3 (out, in), fp32 scales (out,): one scale per output row, amax / 448,
    so each row's largest weight lands on fp8's largest value and w ~= q * scale[:, None]."""
    scale = w.detach().abs().amax(1).float().clamp(min=1e-12) / FP8_MAX
    return ((w.detach().float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),
            scale)


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

    def __init__(self, in_features, out_features, bias=None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.scaled_mm = in_features, out_features, None
        self.register_buffer("weight", torch.empty(out_features, in_features,
                                                   dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, device=device))
        self.bias = bias  # a Parameter in the copy's dtype, or None

    @classmethod
    def from_linear(cls, linear):
        return cls(linear.in_features, linear.out_features, linear.bias,
                   linear.weight.device).requantize(linear.weight)

    @torch.no_grad()
    def requantize(self, w):
        q, s = quantize_fp8(w.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale.copy_(s)
        return self

    def dequantized(self):  # (out, in) fp32
        return self.weight.float() * self.weight_scale[:, None]

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, self.in_features)  # (M, in)
        # (M, 1) per token
        sx = x.detach().abs().amax(1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        xq = (x.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()
        use = self.scaled_mm
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


def make_rollout_copy(model, form="same"):
    """The model that generates rollouts: the policy itself ('same'), or a copy in bf16, in fp8
    (FP8Linear for every Linear but the head and the router; the rest bf16), or N:M-pruned ('nm2:4':
    the policy's dtype, masked). The copy is built without a full-precision duplicate (deepcopy with
    every parameter swapped for an empty one in the copy's dtype) and then filled by
    `refresh_rollout_copy`. Its log-probs differ from the policy's: train with truncated IS,
    min(p_train / p_rollout, C)."""
    kind, _, _, name = parse_form(form)
    model = getattr(model, "module", model)  # a DDP wrapper: copy what it wraps
    if kind == "same":
        return model
    dtype = torch.bfloat16 if kind in ("bf16", "fp8") else None

    def cast(t):
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    # deepcopy takes what the memo holds for an object it has already seen, so ties stay tied.
    # Parameters start empty (refresh fills them); buffers are small and some are not in the state
    # dict: cast them now.
    memo = {id(p): nn.Parameter(torch.empty_like(p, dtype=cast(p)), requires_grad=False)
            for p in model.parameters()}
    memo.update({id(b): b.detach().to(cast(b), copy=True) for b in model.buffers()})
    copy = deepcopy(model, memo)
    if kind == "fp8":
        for mname, mod in list(copy.named_modules()):
            if isinstance(mod, nn.Linear) and not any(s in f"{mname}.weight" for s in COPY_SKIP):
                parent, _, child = mname.rpartition(".")
                fp8 = FP8Linear(mod.in_features, mod.out_features, mod.bias, mod.weight.device)
                setattr(copy.get_submodule(parent), child, fp8)
    copy.rollout_form = name
    return refresh_rollout_copy(copy.eval(), model)


@torch.no_grad()
def refresh_rollout_copy(copy, source, form=None):
    """Re-derive the copy's weights from `source` (the policy, or a dict of its tensors, e.g. a
    Receiver's dense staging copy) in place: the same tensors, so the engine and any captured graph
    keep pointing at them. fp8 re-quantises; nm recomputes the magnitude masks on the new
    weights."""
    kind, n, m, name = parse_form(form or getattr(copy, "rollout_form", "same"))
    if name != getattr(copy, "rollout_form", "same"):
        raise ValueError(f"refresh_rollout_copy: form {name!r} but the copy was made as "
                         f"{getattr(copy, 'rollout_form', 'same')!r}")
    if kind == "same":
        return copy  # the copy is the policy: nothing to do
    source = getattr(source, "module", source)
    # a module, or a dict of tensors
    src = source.state_dict() if isinstance(source, nn.Module) else source
    fp8 = {k: v for k, v in copy.named_modules() if isinstance(v, FP8Linear)}
    dst = {k: v for k, v in copy.state_dict().items()
           if not (k.rpartition(".")[0] in fp8
                   and k.rpartition(".")[2] in ("weight", "weight_scale"))}
    missing = sorted(({f"{k}.weight" for k in fp8} | set(dst)) - set(src))
    if missing:
        raise KeyError(f"refresh_rollout_copy: the source lacks {missing[:5]} ({len(missing)} "
                       f"tensors)")
    for k, mod in fp8.items():
        mod.requantize(src[f"{k}.weight"])
    for k, v in dst.items():
        v.copy_(src[k])  # casts to the copy's dtype
    if kind == "nm":
        apply_nm(copy, n, m, skip=COPY_SKIP)
    return copy


def describe_copy(copy):
    """One short line for the log: the form, the bytes its weights take, and that against fp32."""
    name = getattr(copy, "rollout_form", "same")
    # tied weights counted once
    tensors = dict(copy.named_parameters(), **dict(copy.named_buffers()))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    fp32 = sum(t.numel() * 4 for k, t in tensors.items() if not k.endswith("weight_scale"))
    line = f"{name}: {nbytes / 2**20:.2f} MiB of weights, {nbytes / max(fp32, 1):.2f}x fp32"
    fp8 = [m for m in copy.modules() if isinstance(m, FP8Linear)]
    if fp8:
        w = fp8[0].weight
        path = "torch._scaled_mm" if w.is_cuda and _fp8_gpu(w.device) else "simulated"
        line += f"; {len(fp8)} Linear in fp8 W8A8 ({path})"
    if name.startswith("nm"):
        _, n, m, _ = parse_form(name)
        pruned = [k for k, v in copy.named_modules() if isinstance(v, nn.Linear)
                  and not any(s in f"{k}.weight" for s in COPY_SKIP)]
        line += f"; {len(pruned)} Linear masked {n}:{m} (zeros stored, dense compute)"
    return line


# ----------------------------------------------------------------------------- in the loop


def rollout_model_for(cfg, model):
    """The model that generates, from config key rollout_copy: the policy itself, or a bf16 / fp8 /
    N:M copy."""
    if cfg.rollout_copy == "same":
        return model
    return make_rollout_copy(merge_lora(copy_module.deepcopy(model)) if cfg.lora_r else model,
                             cfg.rollout_copy)


def refresh(rollout_model, model, lora):
    """After an update: re-derive the rollout copy from the policy (a no-op when they are the same
    object)."""
    if rollout_model is not model:
        refresh_rollout_copy(rollout_model, merged_state_dict(model) if lora else model)
