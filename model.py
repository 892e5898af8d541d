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
    flash-attn varlen (packed training on a GPU), or `cache.attend(layer, q, k, v)` when a KV cache
    is passed. The rollout engine owns the cache object, so it decides there whether a decode step
    reads every KV page or a sparse subset. It also generates inside `model.packed()`: on a CPU the
    weight matmuls (q|k|v and gate|up stacked, o, down, lm_head) run on packed copies: for a step of
    at most 8 rows, zeros_kernels/linear_cpu.py's C++ loop, which streams each weight once (oneDNN's
    kernel is built for larger batches); above, oneDNN's packed kernel, about 1.6x MKL's F.linear at
    decode sizes. Their sums are ordered differently from F.linear's: last bits.

LoRA (stage 4, sparse updates):
    add_lora(model, r=8, alpha=16)      # q,k,v,o,gate,up,down (MoE experts too; never lm_head,
                                        # not the router); every other parameter is frozen
    save_adapter(model, "out/adapter", "Qwen/Qwen3-0.6B")  # PEFT's files:
                                        # PeftModel.from_pretrained loads them
    load_adapter(model, "out/adapter")  # add_lora with the folder's config, then its tensors
                                        # (ours, or PEFT's on nn.Linear modules: see its doc)
    merge_lora(model)                   # folds W + alpha/r * B @ A in place: plain Linears again
    `state_dict()` keeps PEFT's names (q_proj.base_layer.weight, q_proj.lora_A.weight), which
    sync.py's adapter mode ships. `save_pretrained` folds the enabled adapters into a copy, so a
    LoRA model's checkpoint is a plain one that transformers loads. `LoRALinear.enabled = False` (or
    `set_lora_enabled(model, False)`) gives the base output exactly. MoE experts keep one adapter
    per expert linear, under per-expert names; PEFT folds them onto transformers' fused expert
    tensors when it loads the adapter (tested with peft 0.21, transformers 5). PEFT takes every
    gate/up/down_proj target for the experts, so on a Qwen3-MoE with dense layers
    (mlp_only_layers, decoder_sparse_step) save_adapter names the dense MLPs' weights in
    target_parameters instead. PEFT's own adapters on the fused experts do not load here.

Simplifications:
    1. No sliding-window attention, no rope scaling variants (Qwen3's dense and MoE checkpoints use
       neither).
    2. MoE experts run as a loop over the experts that received tokens, like the reference
       implementation (moe.py); good enough for small expert counts, not a grouped-GEMM kernel.
    3. No dropout (RL fine-tuning runs without it), except LoRA's optional input dropout.
    4. LoRA: one adapter per model, one rank and alpha for every target; no DoRA, no rsLoRA, no
       embedding adapters.
    5. The packed CPU path calls torch.ops.mkldnn (not a public API), for plain fp32 nn.Linears of
       models 256 wide or more; it holds another copy of those weights while generating, two where
       a run decodes both small and large batches (oneDNN's and the C++ kernel's).
"""

import contextlib
import json
import math
import os
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from zeros_kernels.linear_cpu import SMALL_ROWS, linear_cpu, linear_cpu_pack
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
        if self.onednn is None:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(
                torch.cat([m.weight.detach() for m in self.lins]), None)
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, None, "none", [], "")


def linears(x, mods, packed=None):
    """[m(x) for m in mods], or one matmul on `packed` (a Packed): their weights stacked."""
    if packed is None:
        return [m(x) for m in mods]
    y = packed(x)
    return (y,) if len(mods) == 1 else y.split_with_sizes([m.out_features for m in mods], -1)


def packed_causal_mask(cu_seqlens, total, device):
    """Block-diagonal causal mask for sequences packed back to back: (1, 1, total, total) bool."""
    seg = torch.zeros(total, dtype=torch.long, device=device)
    seg[cu_seqlens[1:-1].long()] = 1  # a 1 where each sequence but the first starts
    seg = seg.cumsum(0)  # segment id of every packed token
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    return (causal & (seg[:, None] == seg[None, :]))[None, None]


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

    def forward(self, x, cos, sin, cache=None, cu_seqlens=None, max_seqlen=None):
        B, T, _ = x.shape
        q, k, v = linears(x, (self.q_proj, self.k_proj, self.v_proj), self.packs.get("qkv"))
        # (B, Hq, T, D) and (B, Hkv, T, D); Qwen3 RMS-normalises each head's q and k before RoPE
        q = self.q_norm(q.view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # --- the one attention call: the engine's cache (dense or sparse), packed, or causal ---
        if cache is not None:
            y = cache.attend(self.layer_idx, q, k, v)  # (B, Hq, T, D)
        elif cu_seqlens is not None and flash_attn_varlen_func is not None and x.is_cuda:
            # packed rows come as B = 1; varlen wants (total, H, D) and the sequence boundaries
            y = flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                       v[0].transpose(0, 1), cu_seqlens, cu_seqlens, max_seqlen,
                                       max_seqlen, causal=True)
            y = y.transpose(0, 1)[None]  # (1, Hq, total, D)
        elif cu_seqlens is not None:
            # the same packing on SDPA, with a block-diagonal mask (reference path)
            mask = packed_causal_mask(cu_seqlens, T, x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
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
        for block in self.model.layers:
            x = block(x, cos, sin, cache=cache, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
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


# ------------------------------------------------------------------- LoRA (stage 4: sparse updates)

# all but lm_head, router
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """y = base(x) + B(A(dropout(x))) * alpha / r with the base frozen. The submodule names are
    PEFT's, so the state_dict keys (base_layer.weight, lora_A.weight (r, in), lora_B.weight
    (out, r)) are what PEFT and sync.py use."""

    def __init__(self, base: nn.Linear, r, alpha, dropout=0.0):
        super().__init__()
        self.base_layer, self.r, self.alpha = base, r, alpha
        self.scaling, self.enabled = alpha / r, True
        kw = dict(bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(base.in_features, r, **kw)
        self.lora_B = nn.Linear(r, base.out_features, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.train(base.training)  # a model in eval mode stays so: no dropout after add_lora
        # PEFT's init: A random, B zero, so the adapted model starts as the base model
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        y = self.base_layer(x)
        if not self.enabled:
            # exactly the base output: the dense policy can ignore a rollout-only adapter
            return y
        # adapter weights may be kept in fp32 over a bf16 base
        x = self.lora_dropout(x.to(self.lora_A.weight.dtype))
        return y + (self.lora_B(self.lora_A(x)) * self.scaling).to(y.dtype)

    def merged_weight(self):
        """W + scaling * B @ A in fp32, rounded once to W's dtype: the same bits as
        sync.merge_lora."""
        W = self.base_layer.weight
        return (W.float() + (self.lora_B.weight.float() @ self.lora_A.weight.float())
                * self.scaling).to(W.dtype)

    def extra_repr(self):
        return f"r={self.r}, alpha={self.alpha}, enabled={self.enabled}"


def lora_modules(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def swap_module(model, name, new):
    """Put `new` where the submodule called `name` was (LoRA, N:M and RoI wrappers use it)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def _target_of(name, targets):
    """The first target that names module `name`: the name itself or a dotted suffix of it (PEFT's
    rule for a target list, and for its exclude list)."""
    return next((t for t in targets if name == t or name.endswith("." + t)), None)


def add_lora(model, r=8, alpha=16, dropout=0.0, targets=LORA_TARGETS):
    """Wrap, in place, every nn.Linear whose name is a target or ends in "." + target (PEFT's rule)
    in a LoRALinear, freeze every other parameter, and return the model. lm_head stays a plain
    Linear: the trainer and the rollout engine read lm_head.weight and call it on hidden states."""
    if not (isinstance(r, int) and r >= 1):
        raise ValueError(f"add_lora: r must be an int >= 1, got {r!r}")
    if lora_modules(model):
        raise ValueError("add_lora: the model already has LoRA adapters (merge_lora(model) first)")
    targets = [targets] if isinstance(targets, str) else list(targets)
    hits = {t: [] for t in targets}
    for name, m in model.named_modules():
        t = _target_of(name, targets)
        if t is None:
            continue
        if m is getattr(model, "lm_head", None):
            raise ValueError(f"add_lora: target {t!r} matches lm_head, which must stay a plain "
                             f"nn.Linear")
        if type(m) is not nn.Linear:
            raise TypeError(f"add_lora: target {t!r} matches {name!r}, a {type(m).__name__}, not "
                            f"an nn.Linear")
        hits[t].append(name)
    missing = [t for t, names in hits.items() if not names]
    if missing:
        raise ValueError(f"add_lora: targets {missing} match no nn.Linear in the model")
    model.requires_grad_(False)
    for name in (n for names in hits.values() for n in names):
        swap_module(model, name, LoRALinear(model.get_submodule(name), r, alpha, dropout))
    # for save_adapter
    model.lora_config = dict(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets)
    return model


def set_lora_enabled(model, enabled):
    for _, m in lora_modules(model):
        m.enabled = enabled


def lora_state_dict(model):
    """The adapter tensors under PEFT's file names: base_model.model.<module>.lora_{A,B}.weight."""
    return {f"base_model.model.{n}.lora_{ab}.weight": getattr(m, "lora_" + ab).weight.detach()
            for n, m in lora_modules(model) for ab in "AB"}


@torch.no_grad()
def merged_state_dict(model):
    """state_dict() under the plain names, with the enabled adapters folded in (disabled ones left
    out)."""
    sd = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()
          if ".lora_" not in k}
    sd.update({n + ".weight": m.merged_weight() for n, m in lora_modules(model) if m.enabled})
    return sd


@torch.no_grad()
def merge_lora(model):
    """Fold every adapter into its base weight and put the plain nn.Linear back, in place; returns
    the model. requires_grad flags stay as add_lora left them."""
    mods = lora_modules(model)
    off = [n for n, m in mods if not m.enabled]
    if off:
        # folding would change the output, dropping would lose the adapter: make the caller choose
        raise ValueError(f"merge_lora: the adapter on {off[0]!r} (and {len(off) - 1} more) is "
                         f"disabled; enable it")
    for name, m in mods:
        m.base_layer.weight.copy_(m.merged_weight())
        swap_module(model, name, m.base_layer)
    model.__dict__.pop("lora_config", None)
    return model


MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def _moe_adapter_targets(model):
    """The adapter_config.json entries that make PEFT adapt, on transformers' Qwen3-MoE, exactly the
    modules this (MoE) model adapts.

    With transformers 5, PEFT reads every target that is or ends in gate_proj / up_proj / down_proj
    as the fused expert tensors (gate_up_proj, down_proj) of every MoE layer, and drops it as a
    module target: a dense layer's MLP (mlp_only_layers, decoder_sparse_step) would lose its
    adapter. So the dense layers' MLP adapters are written as target_parameters by full weight name
    (PEFT applies those as written, with the same lora_A / lora_B tensors), and the MLP names in
    target_modules are the expert kinds alone. Raises where PEFT cannot express the model's
    adapters: experts of one kind adapted in some layers or experts only, or gate_proj without
    up_proj (they are one fused tensor)."""
    cfg, adapted = model.config, {n for n, _ in lora_modules(model)}
    layers = range(cfg.num_hidden_layers)
    experts = {k: [f"model.layers.{i}.mlp.experts.{e}.{k}" for i in layers if cfg.is_moe_layer(i)
                   for e in range(cfg.num_experts)] for k in MLP_LINEARS}
    kinds = [k for k in MLP_LINEARS if any(n in adapted for n in experts[k])]
    partial = [n for k in kinds for n in experts[k] if n not in adapted]
    if partial or len({"gate_proj", "up_proj"} & set(kinds)) == 1:
        raise ValueError(f"save_adapter: PEFT adapts a Qwen3-MoE's experts through transformers' "
                         f"fused tensors, every expert of every MoE layer at once and gate_proj "
                         f"with up_proj; this model adapts {kinds} on the experts but not "
                         f"{partial[:3] or ['up_proj' if 'gate_proj' in kinds else 'gate_proj']}")
    dense = [f"model.layers.{i}.mlp.{k}" for i in layers if not cfg.is_moe_layer(i)
             for k in MLP_LINEARS]
    params = [n + ".weight" for n in dense if n in adapted]
    targets = [t for t in model.lora_config["target_modules"]
               if t.rpartition(".")[2] not in MLP_LINEARS] + kinds
    # where PEFT does not rewrite them (transformers 4), the kinds would match the dense MLPs
    # too
    exclude = [n for n in dense if n.rpartition(".")[2] in kinds]
    out = dict(target_modules=targets, target_parameters=params or None,
               exclude_modules=exclude or None)
    if kinds or params:
        # PEFT refuses input dropout on a parameter target; dropout only acts in training
        out["lora_dropout"] = 0.0
    return out


def save_adapter(model, out_dir, base_model_name_or_path):
    """adapter_config.json + adapter_model.safetensors, the files
    peft.PeftModel.from_pretrained(hf_model, out_dir) loads onto the transformers model of the same
    checkpoint. On a Qwen3-MoE the config says which MLPs are experts and which dense (see
    _moe_adapter_targets), and its lora_dropout is 0."""
    from safetensors.torch import save_file
    if not lora_modules(model) or not hasattr(model, "lora_config"):
        raise ValueError("save_adapter: the model has no LoRA adapters (call add_lora first)")
    targets = _moe_adapter_targets(model) if model.config.num_experts else {}
    cfg = dict(peft_type="LORA", task_type="CAUSAL_LM",
               base_model_name_or_path=base_model_name_or_path,
               **{**model.lora_config, **targets}, bias="none",
               fan_in_fan_out=False, inference_mode=True, init_lora_weights=True, use_rslora=False,
               use_dora=False, modules_to_save=None, layers_to_transform=None, layers_pattern=None,
               rank_pattern={}, alpha_pattern={}, revision=None)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    sd = {k: v.contiguous().cpu() for k, v in lora_state_dict(model).items()}
    save_file(sd, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})


def _adapter_targets(model, cfg, adapter_dir):
    """The add_lora targets that an adapter config names: its target_modules, less its
    exclude_modules, plus the weights in target_parameters (as save_adapter writes them for a
    Qwen3-MoE's dense MLPs). Raises on what one rank per nn.Linear cannot hold."""
    params = cfg.get("target_parameters") or []
    # (already wrapped on resume)
    linears = {n for n, m in model.named_modules()
               if type(m) is nn.Linear or isinstance(m, LoRALinear)}
    fused = [p for p in params if not (p.endswith(".weight") and p[:-len(".weight")] in linears)]
    if fused:
        # PEFT's adapter on a fused (E, 2 * I, C) gate_up_proj has one rank over gate and up
        # together: gate's and up's parts are not two adapters of that rank each
        raise ValueError(f"adapter {adapter_dir}: target_parameters {fused} are not nn.Linear "
                         f"weights of this model (PEFT's adapters on transformers' fused MoE "
                         f"experts do not load: LoRA here has one rank per nn.Linear)")
    odd = {k: cfg.get(k) for k in ("use_dora", "use_rslora", "fan_in_fan_out", "rank_pattern",
                                   "alpha_pattern", "layers_to_transform") if cfg.get(k)}
    tm, ex = cfg.get("target_modules"), cfg.get("exclude_modules") or []
    if cfg.get("peft_type") != "LORA" or odd or not isinstance(tm, list) or isinstance(ex, str):
        raise ValueError(f"adapter {adapter_dir}: only plain LoRA with target_modules (and any "
                         f"exclude_modules) as lists is supported (peft_type "
                         f"{cfg.get('peft_type')!r}, target_modules {tm!r}, exclude_modules "
                         f"{ex!r}, {odd})")
    if not params and not ex:
        return tm
    names = [n for n, _ in model.named_modules() if _target_of(n, tm) and not _target_of(n, ex)]
    return list(dict.fromkeys(names + [p[:-len(".weight")] for p in params]))


@torch.no_grad()
def load_adapter(model, adapter_dir):
    """add_lora with an adapter folder's config (unless the model has adapters already, e.g. on
    resume), then its tensors; returns the model.

    What loads: save_adapter's files, and PEFT's plain LoRA (no DoRA, rsLoRA, rank or alpha
    patterns) whose targets are nn.Linear modules: any adapter on a dense Qwen3, and on a
    Qwen3-MoE one on the attention only, or on the experts in the per-expert layout that
    save_adapter writes. Refused, with an error that says so: PEFT's adapters on a Qwen3-MoE's
    fused experts, which transformers 5 makes (target_parameters gate_up_proj / down_proj)."""
    from safetensors.torch import load_file
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    targets = _adapter_targets(model, cfg, adapter_dir)
    if not lora_modules(model):
        add_lora(model, cfg["r"], cfg["lora_alpha"], cfg.get("lora_dropout", 0.0), targets)
    own, sd = (lora_state_dict(model),
               load_file(os.path.join(adapter_dir, "adapter_model.safetensors")))
    if set(own) != set(sd):
        raise ValueError(f"adapter {adapter_dir} does not match the model: missing "
                         f"{sorted(set(own) - set(sd))[:3]}, unexpected "
                         f"{sorted(set(sd) - set(own))[:3]}")
    for k, v in own.items():
        v.copy_(sd[k])
    return model
