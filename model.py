"""
model.py: a compact Qwen3-family decoder (dense and MoE) shared by the trainer and the
rollout engine.

What it is:
    RMSNorm, rotary position embeddings, grouped-query attention with per-head q/k RMSNorm, a SwiGLU
    MLP, and the Qwen3-MoE block (moe.py: softmax router, top-k experts, optional renormalisation of
    the top-k weights; router replay). Parameter names mirror Hugging Face's, so a checkpoint maps
    one to one onto `state_dict()`.

    model = Transformer.from_pretrained("Qwen/Qwen3-0.6B")  # hub name (online) or a local folder
    logits = model(idx)                 # (B, T, V) training forward, right padding ok
    model.save_pretrained("out/ckpt")   # config.json + model.safetensors, loads in transformers

Where the attention happens:
    `Attention.forward` computes q, k, v and then makes exactly one call: SDPA (training),
    flash-attn varlen (packed training on a GPU in half precision), or `cache.attend(layer, q, k,
    v)` when a KV cache is passed. q, k and v reach it in one dtype: autocast's under autocast
    (the q/k RMSNorm's fp32 weight would otherwise promote q and k to fp32). Packed rows without
    flash-attn go to SDPA with one block-diagonal mask, made once per forward; a masked SDPA call
    repeats the KV heads for the query heads (`repeat_kv`), so it is not left to the math kernel.
    An unmasked call keeps SDPA's grouped-query attention, which its flash kernel takes in half
    precision only: in fp32 (no autocast, fp32 weights) it too runs on the math kernel.
    The rollout engine owns the cache object, so it decides there whether a decode step
    reads every KV page or a sparse subset. It also generates inside `model.packed()`: on a CPU the
    weight matmuls (q|k|v and gate|up stacked, o, down, lm_head) run on packed copies: for a step of
    at most 8 rows, zeros_kernels/linear_cpu.py's C++ loop, which streams each weight once (oneDNN's
    kernel is built for larger batches); above, oneDNN's packed kernel, about 1.6x MKL's F.linear at
    decode sizes. Their sums are ordered differently from F.linear's: last bits.

LoRA (stage 4, sparse updates) lives in lora.py; its names are re-exported here (add_lora,
load_adapter, merge_lora, ...), so `from model import add_lora` works as before.

Simplifications:
    1. No sliding-window attention, no rope scaling variants (Qwen3's dense and MoE checkpoints use
       neither).
    2. MoE experts run as a loop over the experts that received tokens, like the reference
       implementation (moe.py); good enough for small expert counts, not a grouped-GEMM kernel.
    3. No dropout (RL fine-tuning runs without it), except LoRA's optional input dropout.
    4. The packed CPU path calls torch.ops.mkldnn (not a public API), for plain fp32 nn.Linears of
       models 256 wide or more; it holds another copy of those weights while generating, two where
       a run decodes both small and large batches (oneDNN's and the C++ kernel's).
"""

import contextlib
import json
import os
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from zeros_kernels.linear_cpu import SMALL_ROWS, linear_cpu, linear_cpu_pack
from lora import (LORA_TARGETS, LoRALinear, add_lora, load_adapter, lora_modules,  # noqa: F401
                  lora_state_dict, merge_lora, merged_state_dict, save_adapter, set_lora_enabled,
                  swap_module)  # re-exported: LoRA's home is lora.py
from moe import MoE

try:  # optional: packed (no padding) training on a CUDA machine
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or a broken CUDA install
    flash_attn_varlen_func = None


@dataclass
class ModelConfig:
    vocab_size: int = 128
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    # MoE (num_experts == 0 means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, d):
        """Read a transformers config.json dict (Qwen3 or Qwen3-MoE, old and new key spellings)."""
        if d.get("model_type") not in ("qwen3", "qwen3_moe"):
            raise ValueError(f"model_type {d.get('model_type')!r} is not supported: zeros "
                             f"implements qwen3 and qwen3_moe")
        d = dict(d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported (only "
                             f"'default')")
        d.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        experts = d.get("num_experts", d.get("num_local_experts", 0))  # either spelling
        d["num_experts"] = experts if d["model_type"] == "qwen3_moe" else 0
        if d.get("head_dim") is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_hf(self):
        moe = self.num_experts > 0
        d = {k: getattr(self, k) for k in (f.name for f in fields(self))}
        if not moe:
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                d.pop(k)
        d.update(model_type="qwen3_moe" if moe else "qwen3",
                 architectures=["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
                 hidden_act="silu", torch_dtype="float32", use_sliding_window=False,
                 sliding_window=None, rope_scaling=None)
        return d

    def is_moe_layer(self, i):
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalise in fp32 (F.rms_norm: the reference's bits), scale in the input dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(pos, head_dim, theta, dtype):
    """pos: (B, T) integer positions -> cos, sin: (B, 1, T, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device,
                                             dtype=torch.float32) / head_dim))
    freqs = pos.float()[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)  # HF's rotate_half: dim i pairs with i + D/2, not with i + 1
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Packed:
    """One group of Linears' weights stacked (Transformer.packed), as one matmul: in
    zeros_kernels/linear_cpu's layout for a batch of at most SMALL_ROWS rows (a small decode step), else
    in oneDNN's. Each layout is made on its first use, so a run whose batches are all large (or all
    small) packs its weights once, not twice."""

    def __init__(self, lins):
        self.lins, self.n = lins, sum(m.out_features for m in lins)
        self.onednn = self.small = None
        self.tried_small = False  # small stays None after a try where there is no C++ kernel

    def __call__(self, x):
        if x.numel() <= SMALL_ROWS * x.shape[-1]:
            if not self.tried_small:
                self.small = linear_cpu_pack(torch.cat([m.weight.detach() for m in self.lins]))
                self.tried_small = True
            if self.small is not None:
                return linear_cpu(x, self.small, self.n)
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight(), None, "none", [], "")

    def onednn_weight(self):
        """The group's weights stacked in oneDNN's layout, made on first use (zeros_kernels/layer_cpu
        passes it to the same kernel from C++)."""
        if self.onednn is None:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(
                torch.cat([m.weight.detach() for m in self.lins]), None)
        return self.onednn


def linears(x, mods, packed=None):
    """[m(x) for m in mods], or one matmul on `packed` (a Packed): their weights stacked."""
    if packed is None:
        return [m(x) for m in mods]
    y = packed(x)
    return (y,) if len(mods) == 1 else y.split_with_sizes([m.out_features for m in mods], -1)


def packed_causal_mask(cu_seqlens, total, device):
    """Block-diagonal causal mask for sequences packed back to back: (1, 1, total, total) bool,
    made once per forward (dense: the reference path where flash-attn does not run)."""
    seg = torch.zeros(total, dtype=torch.long, device=device)
    seg[cu_seqlens[1:-1].long()] = 1  # a 1 where each sequence but the first starts
    seg = seg.cumsum(0)  # segment id of every packed token
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    return (causal & (seg[:, None] == seg[None, :]))[None, None]


def repeat_kv(k, v, heads):
    """k, v (B, Hkv, S, D) -> (B, heads, S, D): each KV head repeated for its query heads. SDPA
    takes grouped-query attention (enable_gqa) only in its flash and math kernels, and flash takes
    no mask: a masked call with enable_gqa gets the math kernel (fp32 scores of every head). With
    the heads repeated, the memory-efficient kernel takes the mask."""
    n = heads // k.shape[1]
    return (k, v) if n == 1 else (k.repeat_interleave(n, 1), v.repeat_interleave(n, 1))


def flash_runs(device, dtype):
    """Whether packed rows go to flash-attn's varlen kernel: installed, on CUDA, and in half
    precision (`dtype`: the dtype attention runs in): it takes no fp32."""
    return (flash_attn_varlen_func is not None and torch.device(device).type == "cuda"
            and dtype in (torch.float16, torch.bfloat16))


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx, self.hd = layer_idx, cfg.head_dim
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=b)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    PACKS, packs = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",)}, {}

    def forward(self, x, cos, sin, cache=None, cu_seqlens=None, max_seqlen=None, mask=None):
        B, T, _ = x.shape
        q, k, v = linears(x, (self.q_proj, self.k_proj, self.v_proj), self.packs.get("qkv"))
        # (B, Hq, T, D) and (B, Hkv, T, D); Qwen3 RMS-normalises each head's q and k before RoPE
        q = self.q_norm(q.view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # under autocast q and k leave their RMSNorm in fp32 (an fp32 weight times a bf16 output
        # promotes) and v comes in the autocast dtype: every attention call gets one dtype (SDPA
        # casts for itself, flash-attn's varlen and the engine's kernels do not)
        q, k = q.to(v.dtype), k.to(v.dtype)
        # --- the one attention call: the engine's cache (dense or sparse), packed, or causal ---
        if cache is not None:
            y = cache.attend(self.layer_idx, q, k, v)  # (B, Hq, T, D)
        elif cu_seqlens is not None:  # Transformer.forward chose flash-attn (flash_runs)
            # packed rows come as B = 1; varlen wants (total, H, D) and the sequence boundaries
            y = flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                       v[0].transpose(0, 1), cu_seqlens, cu_seqlens, max_seqlen,
                                       max_seqlen, causal=True)
            y = y.transpose(0, 1)[None]  # (1, Hq, total, D)
        elif mask is not None:
            # the same packing on SDPA, with the forward's block-diagonal mask (reference path)
            y = F.scaled_dot_product_attention(q, *repeat_kv(k, v, self.nh), attn_mask=mask)
        else:
            # right padding is safe under a causal mask: real tokens never see the pads after them
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(B, T, self.nh * self.hd)  # heads -> channels
        return linears(y, (self.o_proj,), self.packs.get("o"))[0]


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    PACKS, packs = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}, {}

    def forward(self, x):
        gate, up = linears(x, (self.gate_proj, self.up_proj), self.packs.get("gate_up"))
        return linears(F.silu(gate) * up, (self.down_proj,), self.packs.get("down"))[0]


class Block(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, i)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (MoE(cfg, lambda: MLP(cfg.hidden_size, cfg.moe_intermediate_size))
                    if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size))

    def forward(self, x, cos, sin, **kw):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, **kw)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init)

    PACKS, packs = {"lm_head": ("lm_head",)}, {}  # as in Attention and MLP: see packed()
    # narrower models run unpacked: their weights stay in cache, where MKL is as fast (0.8-1.2x)
    PACK_MIN_HIDDEN = 256

    def _init(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, pos=None, cache=None, cu_seqlens=None, max_seqlen=None, hidden=False):
        """idx (B, T) -> logits (B, T, V) in fp32; `pos` (B, T) defaults to 0..T-1 (or what the
        cache says). With `hidden=True` the final hidden states (B, T, C) are returned instead (the
        loss projects in chunks)."""
        B, T = idx.shape
        if pos is None:
            pos = (cache.positions(T) if cache is not None
                   else torch.arange(T, device=idx.device).expand(B, T))
        x = self.model.embed_tokens(idx)
        cos, sin = rope_cos_sin(pos, self.config.head_dim, self.config.rope_theta, x.dtype)
        # packed rows (cu_seqlens): flash-attn's varlen kernel where it runs, else SDPA with one
        # block-diagonal (1, 1, total, total) mask, made here once for every layer
        mask, dev = None, idx.device.type
        amp = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        if cu_seqlens is not None and not flash_runs(idx.device, amp):
            mask, cu_seqlens = packed_causal_mask(cu_seqlens, T, idx.device), None
        for block in self.model.layers:
            x = block(x, cos, sin, cache=cache, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                      mask=mask)
        if cache is not None:
            cache.advance(T)
        x = self.model.norm(x)
        return x if hidden else linears(x, (self.lm_head,), self.packs.get("lm_head"))[0].float()

    @contextlib.contextmanager
    def packed(self):
        """On a CPU, each module with PACKS gets `packs`: its Linears' weights stacked per group,
        packed (`Packed`: for oneDNN or zeros_kernels/linear_cpu, each on first use; bias-free fp32
        nn.Linears only: a LoRA, fp8 or N:M layer keeps its own forward). Made on entry, dropped on
        exit (updated weights read fresh); no_grad only."""
        on = (self.lm_head.weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
              and self.config.hidden_size >= self.PACK_MIN_HIDDEN)
        mods = [m for m in self.modules() if hasattr(m, "PACKS")] if on else []
        plain = (lambda m: type(m) is nn.Linear and m.bias is None
                 and m.weight.dtype == torch.float32)
        try:
            for m in mods:
                groups = {k: [getattr(m, n) for n in names] for k, names in m.PACKS.items()}
                m.packs = {k: Packed(lins) for k, lins in groups.items() if all(map(plain, lins))}
            yield self
        finally:
            for m in mods:
                m.__dict__.pop("packs", None)  # back to the class's empty dict

    # ---------------------------------------------------------------------- Hugging Face in and out

    @classmethod
    def from_pretrained(cls, name_or_path, dtype=torch.float32, device="cpu"):
        """Load a Qwen3 / Qwen3-MoE checkpoint: a local folder, or a hub name (needs a network)."""
        from safetensors.torch import load_file
        path = name_or_path
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download
            path = snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors",
                                                                   "tokenizer*", "*.txt"])
        with open(os.path.join(path, "config.json")) as f:
            cfg = ModelConfig.from_hf(json.load(f))
        index, files = os.path.join(path, "model.safetensors.index.json"), ["model.safetensors"]
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        sd = {k: v for fn in files for k, v in load_file(os.path.join(path, fn)).items()}
        with torch.device("meta"):  # no init: every tensor is loaded
            model = cls(cfg).to_empty(device=device)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
            sd.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"checkpoint {name_or_path} does not match the model: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        return model.to(dtype)

    def save_pretrained(self, out_dir):
        """Write config.json and model.safetensors that transformers' AutoModelForCausalLM loads.
        Enabled LoRA adapters are folded into a copy of the weights (disabled ones are left out):
        the file holds what forward computes."""
        from safetensors.torch import save_file
        os.makedirs(out_dir, exist_ok=True)
        sd = {k: v.detach().contiguous().cpu() for k, v in merged_state_dict(self).items()}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        hf = self.config.to_hf()
        hf["torch_dtype"] = str(next(self.parameters()).dtype).replace("torch.", "")
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


def weight_checksum(model):
    """A cheap fingerprint of every parameter's bytes: equal on two ranks iff they hold the same
    weights (up to hash collisions). Used by the DDP test and, later, by weight sync."""
    import hashlib
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
