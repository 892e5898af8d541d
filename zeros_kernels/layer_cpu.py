"""
zeros_kernels/layer_cpu.py: a decode step's forward on a CPU with each decoder layer's work outside
attention in two C++ calls (layer_cpu.cpp), beside its reference, model.Transformer.forward.

    why = fused_refusals(model)             # [] where the fused forward runs
    logits = fused_forward(model, idx, cache)   # as model(idx, cache=cache), (B, T, V) fp32

Why: a small model's eager decode step is its fixed cost. The bench model's dense step at 8 rows
dispatches about 500 PyTorch ops, about 110 a layer, and at a few microseconds each they cost more
than the matmuls they feed; on the CPU that time sits outside attention, where no sparse read can
save it. Here a layer is:
    pre_attn    RMSNorm, the q|k|v matmul, q and k's per-head RMSNorm, RoPE (one call)
    attention   cache.attend(layer, q, k, v): the engine's own, dense or sparse, unchanged
    post_attn   o, the residual, RMSNorm, gate|up, SiLU times up, down, the residual (one call)
and the final norm one more call. The weight matmuls are the model's own: F.linear on plain
weights, or the oneDNN-packed weights that Transformer.packed() made.

Where it runs (decode.Runner mode "fused"; "auto" on a CPU picks it): fp32 dense models whose
linears are plain bias-free nn.Linears, outside autocast, with the C++ kernels built. Elsewhere
(`fused_refusals` says why) the step runs eagerly: LoRA, fp8 or N:M copies, MoE, bf16, and the
small-batch packed kernel (linear_cpu, on AVX-512 machines for models 256 wide or more), which
this file does not call.

Simplifications:
    1. The loops' sums run in another order than ATen's: logits agree with the eager forward to
       about 1e-6 (tests/test_decode_step.py holds them to 1e-5 and the greedy tokens equal).
    2. Decode steps, draft steps and the speculative verify (k + 1 tokens a row,
       model_forward); the prefill stays eager.
"""

import torch
import torch.nn as nn

from zeros_kernels.cpu_ext import load_cpu_ext
from zeros_kernels.linear_cpu import SMALL_ROWS


def _plain(m):
    return type(m) is nn.Linear and m.bias is None and m.weight.dtype == torch.float32


def fused_refusals(model):
    """Why the fused forward would not run `model` (empty: it runs). One more case is checked at
    each step (`small_packs`): packs that a step of its rows would run on linear_cpu."""
    mods = [m for b in model.model.layers for m in (b.self_attn, b.mlp)]
    lins = [getattr(m, n) for m in mods for names in getattr(m, "PACKS", {}).values()
            for n in names]
    why = {"not on a CPU": model.lm_head.weight.device.type != "cpu",
           "MoE": getattr(model.config, "num_experts", 0),
           "not fp32": model.lm_head.weight.dtype != torch.float32,
           "autocast": torch.is_autocast_enabled("cpu"),
           "a linear that is not a plain fp32 nn.Linear (LoRA, fp8, N:M, bias)":
               not all(map(_plain, lins)),
           "no C++ kernel": load_cpu_ext("layer_cpu") is None}
    return [k for k, v in why.items() if v]


def small_packs(model, rows):
    """Whether a step of `rows` rows would run the model's packed linears on linear_cpu (AVX-512,
    at most SMALL_ROWS rows, inside Transformer.packed()), which the fused forward does not call."""
    from zeros_kernels.linear_cpu import linear_cpu_available
    packed = any(b.self_attn.packs or b.mlp.packs for b in model.model.layers)
    return packed and rows <= SMALL_ROWS and linear_cpu_available()


def model_forward(mode, model, ids, cache):
    """model(ids, cache=cache) as a decode.Runner of `mode` runs it: fused where the mode is,
    unless its rows would take the small-batch packed linears (small_packs); else the model's
    own. The engine's decode steps and the speculative verify (k + 1 tokens a row) call it."""
    if mode == "fused" and not small_packs(model, ids.numel()):
        return fused_forward(model, ids, cache)
    return model(ids, cache=cache)


def group(mod, key, names):
    """A group of linears as the C++ side takes it: (kind, weights): the oneDNN-packed stack
    (kind 1) where Transformer.packed() made one, else the plain weights (kind 0)."""
    p = mod.packs.get(key)
    return (0, [getattr(mod, n).weight for n in names]) if p is None else (1, [p.onednn_weight()])


def fused_forward(model, idx, cache):
    """model(idx, cache=cache) with each layer's work outside attention in C++ (layer_cpu.cpp):
    the same attention calls, the same cache updates. -> logits (B, T, V) fp32."""
    from model import linears, rope_cos_sin
    ext, cfg = load_cpu_ext("layer_cpu"), model.config
    B, T = idx.shape
    x = model.model.embed_tokens(idx)
    cos, sin = (t[:, 0].contiguous() for t in rope_cos_sin(cache.positions(T), cfg.head_dim,
                                                           cfg.rope_theta, x.dtype))
    eps, nh, nkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    for i, block in enumerate(model.model.layers):
        at, mlp = block.self_attn, block.mlp
        q, k, v = ext.pre_attn(x, block.input_layernorm.weight,
                               *group(at, "qkv", ("q_proj", "k_proj", "v_proj")),
                               at.q_norm.weight, at.k_norm.weight, cos, sin,
                               nh, nkv, eps)
        y = cache.attend(i, q, k, v)
        x = ext.post_attn(x, y, *group(at, "o", ("o_proj",)),
                          block.post_attention_layernorm.weight,
                          *group(mlp, "gate_up", ("gate_proj", "up_proj")),
                          *group(mlp, "down", ("down_proj",)), mlp.gate_proj.out_features, eps)
    cache.advance(T)
    x = ext.rms_norm(x, model.model.norm.weight, eps)
    return linears(x, (model.lm_head,), model.packs.get("lm_head"))[0].float()
