"""
lora.py: LoRA adapters on the policy (stage 4, sparse updates), in PEFT's layout, so that an adapter
trained here loads in PEFT and one trained by PEFT (on nn.Linear modules) loads here.

    add_lora(model, r=8, alpha=16)      # q,k,v,o,gate,up,down (MoE experts too; never lm_head,
                                        # not the router); every other parameter is frozen
    save_adapter(model, "out/adapter", "Qwen/Qwen3-0.6B")  # PEFT's files:
                                        # PeftModel.from_pretrained loads them
    load_adapter(model, "out/adapter")  # add_lora with the folder's config, then its tensors
                                        # (ours, or PEFT's on nn.Linear modules: see its doc)
    merge_lora(model)                   # folds W + alpha/r * B @ A in place: plain Linears again
    `state_dict()` keeps PEFT's names (q_proj.base_layer.weight, q_proj.lora_A.weight), which
    sync.py's adapter mode ships. model.py's `save_pretrained` folds the enabled adapters into a
    copy, so a LoRA model's checkpoint is a plain one that transformers loads.
    `LoRALinear.enabled = False` (or `set_lora_enabled(model, False)`) gives the base output
    exactly. MoE experts keep one adapter per expert linear, under per-expert names; PEFT folds
    them onto transformers' fused expert tensors when it loads the adapter (tested with peft 0.21,
    transformers 5). PEFT takes every gate/up/down_proj target for the experts, so on a Qwen3-MoE
    with dense layers (mlp_only_layers, decoder_sparse_step) save_adapter names the dense MLPs'
    weights in target_parameters instead. PEFT's own adapters on the fused experts do not load
    here.

Simplifications:
    1. One adapter per model, one rank and alpha for every target; no DoRA, no rsLoRA, no
       embedding adapters.

model.py re-exports these names, so `from model import add_lora` and `from lora import add_lora`
are the same function. Tests: `python -m pytest -q tests/test_lora.py tests/test_adapter_ckpt.py`.
"""

import json
import math
import os

import torch
import torch.nn as nn


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
