"""
memory.py: how much memory a run will hold on its device, predicted from the config and the model's
shapes before any weight loads, and the check that refuses a run that will not fit.

    python memory.py configs/countdown_qwen3.py               # the breakdown, on any machine
    python memory.py configs/gsm8k_qwen3.py --micro_batch=4   # ... with any config override
    python memory.py configs/gsm8k_qwen3_moe.py --gpu=H200    # against another card (H100, H200)
    shape, note = model_shape(cfg)         # the model's ModelConfig, from its config.json
    pred = predict(cfg, shape)             # Prediction: the terms in bytes, each phase, the peak
    check_fits(cfg, dev, log)              # train.py on a GPU: print it; refuse what will not fit

On a GPU, train.py prints the breakdown before the weights load and stops, in one line that gives
the figure and the config keys that lower it, when the predicted peak exceeds the device's memory
(torch.cuda.get_device_properties(dev).total_memory). `python -m bench gpu` puts the figure beside
torch.cuda.max_memory_allocated for five RL steps. tests/test_memory.py checks it on the CPU: an RL
step's peak against every byte torch allocates (within 5%), what a training forward saves against
autograd's own record (within 6%), and each term by hand.

What it counts, in bytes. Held for the whole run:
    weights             every parameter in config key dtype (tied embeddings once; LoRA adapters)
    optimizer           AdamW's two moments of every trainable parameter (LoRA: the adapters)
    reference           kl_coef > 0: a frozen copy of the policy
    rollout copy        rollout_copy: bf16 2 bytes a parameter; fp8 1 byte a Linear weight and a
                        4-byte scale a row, the rest bf16; N:M the policy's dtype; DistillSparse a
                        copy
    KV pool             kv_pool_tokens (0: one rollout batch, rollout.pool_pages) x 2 (K, V) x
                        layers x KV heads x head_dim x kv_dtype's bytes, and a sparse budget's page
                        metadata: allocated once, every generate call reuses it
Each phase adds its own on top; the peak is the largest phase:
    rollout             the gradients kept from the last step; autocast's cached bf16 casts of the
                        trainable weights (when the policy generates); the decode step's logits and
                        sampling for every row, or a prefill forward
    training            one micro-batch at the start of its backward: the saved activations
                        (layer_activations, per token and layer), the masked attention's extra
                        (KV heads repeated, the mask), the scored positions' hidden states, the
                        backward's largest moment (a logp_chunk projection recomputed and the
                        head's gradients, or one layer's), the gradients of the micro-batches
                        before it, and each Linear's bf16 weight under autocast, kept for the
                        backward
    held-out            the gradients, the cached casts, the greedy decode step of as many rows as
                        the pool holds
    optimizer step      the gradients and foreach AdamW's temporary (a trainable-sized list)

Simplifications:
    1. The data is not loaded yet when the check runs: the longest prompt is taken as PROMPT_TOKENS
       (a real prompt of the GPU configs is 100 to 250 tokens) unless the caller knows it.
    2. The figure is what torch.cuda.max_memory_allocated reads: allocator rounding and
       fragmentation, the CUDA context and cuBLAS's workspaces are not in it (about 1 GiB).
    3. One process. Under FSDP, the weights, gradients and optimizer state are divided among the
       ranks, plus a full replica to generate from; the disaggregated mode is counted as colocated.
    4. A layer's backward is counted as one more layer's saved activations; kernels' own
       workspaces are not counted; every row runs to max_new_tokens.
    5. A model from the Hub needs its config.json: from the Hub or its cache, else the shapes
       below (KNOWN) for the models the configs name; otherwise nothing is predicted.
    6. On a CPU, the engine's packed weight copies (model.packed) are not counted.
"""

import json
import os
import sys
from dataclasses import dataclass, field

import torch

from config import cli, parse_config
from model import ModelConfig, Transformer, add_lora, flash_attn_varlen_func
from rollout import PREFILL_TOKENS, pool_pages
from tasks import CHARS, SPECIAL_TOKENS

GiB = 2 ** 30
PROMPT_TOKENS = 256  # the longest prompt when the data is not loaded yet (simplification 1)
# total_memory as torch reports it, in GiB, for `python memory.py --gpu=NAME` (no GPU needed)
GPUS = {"H100": 79.1, "H200": 139.8}
# The shapes of the models the GPU configs name, from their config.json on the Hub, for when it
# cannot be reached (a machine offline): enough to predict, not to load
KNOWN = {
    "Qwen/Qwen3-0.6B": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                            intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                            tie_word_embeddings=True, rope_theta=1000000.0),
    "Qwen/Qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                               intermediate_size=6144, num_hidden_layers=48,
                               num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               max_position_embeddings=40960, tie_word_embeddings=False,
                               rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
                               moe_intermediate_size=768),
}


# ----------------------------------------------------------------------------- the model's shape


def model_shape(cfg):
    """-> (ModelConfig, where it came from), or (None, why not). The tiny model's from the config's
    keys; a local folder's from its config.json; a Hub model's through transformers' AutoConfig
    (from the cache when the Hub cannot be reached), else KNOWN."""
    if not cfg.model:
        moe = dict(num_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_active,
                   moe_intermediate_size=cfg.moe_ffn) if cfg.n_expert else {}
        return ModelConfig(vocab_size=len(SPECIAL_TOKENS) + len(CHARS), hidden_size=cfg.n_embd,
                           intermediate_size=cfg.ffn, num_hidden_layers=cfg.n_layer,
                           num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                           head_dim=cfg.n_embd // cfg.n_head, **moe), "the tiny model's keys"
    if os.path.isfile(os.path.join(cfg.model, "config.json")):
        with open(os.path.join(cfg.model, "config.json")) as f:
            return ModelConfig.from_hf(json.load(f)), f"{cfg.model}/config.json"
    try:  # lazy: seconds to import; offline, only the cache is asked (no retries against the Hub)
        from transformers import AutoConfig
        from warmstart import hub_state
        hf = AutoConfig.from_pretrained(cfg.model, local_files_only=bool(hub_state()))
        return ModelConfig.from_hf(hf.to_dict()), f"{cfg.model}'s config.json"
    except Exception as e:  # offline and not cached, or not a model transformers knows
        if cfg.model in KNOWN:
            return (ModelConfig.from_hf(KNOWN[cfg.model]),
                    f"memory.py's copy of {cfg.model}'s shapes (its config.json could not be "
                    f"read: offline)")
        return None, f"{cfg.model}'s config.json could not be read ({type(e).__name__})"


def count_params(cfg, shape):
    """The policy built on the meta device (no memory), as build() makes it (LoRA included) ->
    {"all", "trainable", "linear" (weights of the Linears an fp8 copy quantises), "rows" (their
    output rows: one fp8 scale each), "cast" (every Linear's weight but the head's), "cached" (the
    Linear weights that train: autocast caches their casts), "largest" (the largest trainable
    tensor)}."""
    with torch.device("meta"):
        model = Transformer(shape)
        if cfg.lora_r:
            add_lora(model, cfg.lora_r, cfg.lora_alpha)
    params = list(model.parameters())  # each once: a tied embedding is one parameter
    train = [p for p in params if p.requires_grad]
    lin = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    fp8 = [m for n, m in lin.items() if not n.endswith(("lm_head", "mlp.gate", "lora_A", "lora_B"))]
    return {"all": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in train),
            "linear": sum(m.weight.numel() for m in fp8), "rows": sum(m.out_features for m in fp8),
            "cast": sum(m.weight.numel() for n, m in lin.items() if not n.endswith("lm_head")),
            "cached": sum(m.weight.numel() for m in lin.values() if m.weight.requires_grad),
            "largest": max((p.numel() for p in train), default=0)}


# ----------------------------------------------------------------------------- the terms


@dataclass
class Term:
    name: str
    bytes: float
    how: str  # where the figure comes from, in a few words
    keys: tuple = ()  # the config keys that lower it


@dataclass
class Prediction:
    model: str  # what was predicted for, in words
    held: list  # Terms held for the whole run
    phases: dict  # {phase: [Terms on top of `held`]}
    notes: list = field(default_factory=list)

    def total(self, phase):
        return sum(t.bytes for t in self.held + self.phases[phase])

    @property
    def phase(self):  # the phase of the peak
        return max(self.phases, key=self.total)

    @property
    def peak(self):
        return self.total(self.phase)


def nbytes(dtype):
    return {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}[dtype]


def kv_bytes(cfg, device):
    """Bytes of a cached key or value element: kv_dtype, or auto: bf16 on CUDA, else the dtype of
    the weights that generate (a bf16 or fp8 copy's bf16)."""
    if cfg.kv_dtype != "auto":
        return nbytes(cfg.kv_dtype)
    if device == "cuda":
        return 2
    return 2 if cfg.rollout_copy in ("bf16", "fp8") or cfg.rollout_copy.endswith(".json") \
        else nbytes(cfg.dtype)


def pool_tokens(cfg, prompt):
    """The KV pool's tokens: kv_pool_tokens, or one rollout batch at `prompt` tokens the longest
    prompt (rollout.pool_pages, what the engine allocates)."""
    return pool_pages(cfg, prompt, longest_eval=prompt) * cfg.page_size


def held_terms(cfg, shape, n, device, prompt, world=1):
    """The terms held for the whole run: weights, optimizer state, the reference, the rollout
    copy, the KV pool."""
    w, shard = nbytes(cfg.dtype), (world if cfg.fsdp else 1)
    terms = [Term("weights", n["all"] * w / shard, f"{n['all'] / 1e6:,.0f}M x {cfg.dtype}"
                  + (f" / {shard} ranks" if shard > 1 else ""), ("dtype",)),
             Term("optimizer", 2 * n["trainable"] * w / shard,
                  f"AdamW: 2 x {n['trainable'] / 1e6:,.1f}M trainable x {cfg.dtype}",
                  ("lora_r", "dtype"))]
    if cfg.fsdp:
        terms.append(Term("replica", n["all"] * w, "FSDP: the full weights the engines read"))
    if cfg.kl_coef > 0:
        terms.append(Term("reference", n["all"] * w, "kl_coef > 0: a frozen copy", ("kl_coef",)))
    copy = rollout_copy_bytes(cfg, n)
    if copy:
        terms.append(Term("rollout copy", copy[0], copy[1], ("rollout_copy",)))
    tokens = pool_tokens(cfg, prompt)
    b = kv_bytes(cfg, device)
    per = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * b
    meta = 0 if cfg.kv_budget == "dense" else (3 if cfg.kv_scorer == "quest" else 1)
    how = (f"{tokens:,} tokens x {per / 1024:.0f} KiB ({8 * b}-bit, {shape.num_hidden_layers} "
           f"layers x {shape.num_key_value_heads} KV heads x {shape.head_dim} x K,V)"
           + (f", page metadata x {meta}" if meta else ""))
    terms.append(Term("KV pool", tokens * per * (1 + meta / (2 * cfg.page_size)), how,
                      ("kv_pool_tokens",) + (("kv_dtype",) if b > 2 else ())))
    return terms


def rollout_copy_bytes(cfg, n):
    """-> (bytes, how) of the copy that generates, or None when the policy generates itself."""
    w = nbytes(cfg.dtype)
    if cfg.distill_r:
        return n["all"] * w, "DistillSparse: a copy of the policy and its adapter"
    form = cfg.rollout_copy
    if form == "same":
        return None
    if form == "fp8":
        rest = n["all"] - n["linear"]
        return (n["linear"] + 4 * n["rows"] + 2 * rest,
                f"fp8: {n['linear'] / 1e6:,.0f}M Linear weights x 1 byte, the rest bf16")
    if form.startswith("nm") or ":" in form:
        return n["all"] * w, f"{form}: masked, dense, {cfg.dtype}"
    return 2 * n["all"], f"{form}: {n['all'] / 1e6:,.0f}M x bf16"  # bf16, or a plan's bf16 base


# ----------------------------------------------------------------------------- the training forward


def precision(cfg):
    """-> (w, a, cast): the bytes of a weight (and of the residual stream, which starts as the
    embedding's output), of what a matmul makes, and whether each Linear casts its input anew
    (autocast over fp32 weights)."""
    w, amp = nbytes(cfg.dtype), cfg.autocast == "bfloat16"
    return w, (2 if amp else w), amp and w == 4


def layer_activations(cfg, shape, moe=False):
    """Bytes that one token leaves saved for the backward in one layer, tensor by tensor as
    model.py makes them, for unmasked attention (SDPA's fused kernels, flash-attn). A Linear keeps
    its input only when its weight trains (LoRA: the adapter's lora_A keeps it instead), and, under
    autocast over fp32 weights, each Linear keeps its own bf16 cast of its input."""
    w, a, cast = precision(cfg)
    C, hd, lora = shape.hidden_size, shape.head_dim, bool(cfg.lora_r)
    Q, K = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    norm = lambda d, x: 4 * d + (0 if lora else x * d)  # F.rms_norm's fp32 input; the normed
    inputs = lambda n, d: n * 2 * d if cast else w * d  # n Linears that read one d-wide tensor
    attn = (2 * norm(C, w)  # input_layernorm, post_attention_layernorm
            + inputs(3, C)  # q, k and v read the normed input
            + norm(Q, a) + norm(K, a)  # q_norm, k_norm
            + 2 * a * Q + 2 * a * K  # SDPA keeps q, k, v and its output (o_proj's input)
            + 4 * shape.num_attention_heads  # ... and its logsumexp
            + (2 * Q if lora and cast else 0))  # o_proj's lora_A casts the output for itself
    if not moe:  # gate and up read the normed input; silu keeps gate, the product silu and up,
        return attn + inputs(2, C) + 4 * a * shape.intermediate_size  # down the product
    E, k, F = shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size
    router = 0 if lora else inputs(1, C)  # LoRA leaves the router frozen
    # each of the k picks: the token's gathered row read by gate and up, the expert's MLP, its
    # output unweighted (for the gate weight's gradient) and weighted in the residual's dtype
    pick = inputs(2, C) + 4 * a * F + (a + w) * C  # (index_add_ keeps it)
    return attn + router + 4 * E + k * pick  # the router's fp32 softmax


def attention_path(cfg, shape, device, flash=None):
    """How the training forward attends (update.token_logprobs, model.Attention): "flash-attn"
    (packed rows, flash-attn's varlen kernel: on CUDA in half precision), "packed mask" (pack=on
    without it: one block-diagonal mask over the micro-batch), "shared prompt" (a group's prompt
    once, its rows over it with a mask: update.PromptOnce) or "causal" (each row whole)."""
    flash = flash_attn_varlen_func is not None if flash is None else flash
    half = cfg.autocast == "bfloat16" or cfg.dtype == "bfloat16"
    runs = flash and device == "cuda" and half
    if cfg.pack == "on" or (cfg.pack == "auto" and runs):
        return "flash-attn" if runs else "packed mask"
    if cfg.share_prompt and not cfg.fsdp and not shape.num_experts and cfg.micro_batch > 1:
        return "shared prompt"
    return "causal"


def training_terms(cfg, shape, n, prompt, device, flash=None, shard=1):
    """One micro-batch's training forward at its peak, the start of its backward: what the forward
    saved, the backward's largest moment (the vocabulary projection's chunk and the head's
    gradients, or one layer's), the gradients of the micro-batches before it in the minibatch, and
    autocast's bf16 weights."""
    w, a, cast = precision(cfg)
    L, Hq, hd = shape.num_hidden_layers, shape.num_attention_heads, shape.head_dim
    B, new, path = cfg.micro_batch, cfg.max_new_tokens, attention_path(cfg, shape, device, flash)
    moe = sum(shape.is_moe_layer(i) for i in range(L))
    per = (L - moe) * layer_activations(cfg, shape) + moe * layer_activations(cfg, shape, True)
    per += 8 + 2 * w * hd + 4 * shape.hidden_size + (0 if cfg.lora_r else w * shape.hidden_size)
    U = -(-B // cfg.group_size)  # distinct prompts in a micro-batch (rows sorted by group)
    tokens = U * prompt + B * (new + 1) if path == "shared prompt" else B * (prompt + new)
    kv = 2 * a * shape.num_key_value_heads * hd  # what the unmasked path keeps of k and v
    if path == "shared prompt":  # each row's keys and values over its prompt, heads repeated
        extra = L * B * ((new + 1) * (2 * a * Hq * hd - kv) + (new + 1) * (prompt + new + 1) * a
                         + prompt * 2 * a * Hq * hd)  # ... and the mask, as SDPA converts it
        how = f"{B} rows of {new + 1} over {prompt} prompt tokens: KV heads repeated, the mask"
    elif path == "packed mask":
        T = tokens
        extra = L * (T * (2 * a * Hq * hd - kv) + T * T * a)
        how = f"{T:,} packed tokens: KV heads repeated, a ({T:,} x {T:,}) mask, every layer"
    else:
        extra, how = 0, f"{path}: no mask"
    M, chunk, V = B * new, min(cfg.logp_chunk, B * new), shape.vocab_size
    before = cfg.prompts_per_step * cfg.group_size // cfg.minibatches > B  # micro-batches before
    # the backward's largest moment: at its start a chunk's projection, recomputed (fp32 logits,
    # log-softmax, their gradients: 12 bytes a logit), the head's bf16 cast under autocast and,
    # where the head trains, two (V, C) gradients: the chunk's and the sum of those before, which
    # the engine holds until the embedding's arrives (tied) or the step's gradient takes it;
    # later one layer's (simplification 4), when the projection is gone
    hw, trains = V * shape.hidden_size, not cfg.lora_r
    head = 12 * chunk * V + (2 * hw if cast else 0) + (2 * w * hw if trains else 0)
    layer = (tokens * per + extra) / L
    terms = [Term("activations", tokens * per,
                  f"{tokens:,} tokens x {per / 1024:.0f} KiB ({L} layers; attention: {path})",
                  ("micro_batch", "max_new_tokens")),
             Term("attention", extra, how, ("micro_batch", "share_prompt", "pack")),
             Term("scored positions", M * shape.hidden_size * w,
                  f"{M:,} final hidden states, kept for the projection", ("micro_batch",)),
             Term("backward", max(head, layer),
                  f"{chunk:,} positions x {V:,} logits and the head's gradient" if head >= layer
                  else "one layer's (simplification 4)", ("logp_chunk",))]
    if before:
        terms.append(Term("gradients", n["trainable"] * w / shard, "the micro-batches before "
                          "this one made them", ("lora_r", "dtype")))
    if cast:  # every Linear's bf16 weight, kept for the backward (the head's is recomputed); a
        # frozen one (LoRA) is cast anew by each forward: the shared prompt's and its rows'
        twice = 2 if cfg.lora_r and path == "shared prompt" else 1
        terms.append(Term("autocast copies", 2 * n["cast"] * twice, "bf16 casts of the Linear "
                          "weights, kept for the backward", ("lora_r", "autocast")))
    return terms


# ----------------------------------------------------------------------------- generation, the step


def decode_bytes(cfg, shape, rows, greedy=False):
    """A decode step's logits and sampling for `rows` rows (rollout.Engine, speculative.sample): the
    head's output, its fp32 copy, the scaled logits and the log-softmax (greedy: argmax and the
    log-softmax), the probabilities; the top-k log-probs' own log-softmax when the rollout is
    measured against the policy. A speculative verify scores spec_k + 1 positions a row."""
    _, a, _ = precision(cfg)
    width = 1 if greedy or cfg.rollout_mode != "speculative" else cfg.spec_k + 1
    measured = not greedy and (cfg.rollout_copy != "same" or cfg.kv_budget != "dense")
    return rows * width * shape.vocab_size * (a + (8 if greedy else 12) + (8 if measured else 0))


def prefill_bytes(cfg, shape, prompt, rows):
    """The largest layer of a prefill forward (no gradient): at most PREFILL_TOKENS padded tokens;
    the residual stream, the MLP's gate, up and product (an MoE's picks), the casts."""
    w, a, _ = precision(cfg)
    T = min(PREFILL_TOKENS, rows * prompt)
    F = (shape.intermediate_size if not shape.num_experts
         else shape.num_experts_per_tok * shape.moe_intermediate_size)
    return T * (3 * a * F + 4 * w * shape.hidden_size)


def phase_terms(cfg, shape, n, prompt, device, flash=None, world=1):
    """{phase: [Terms]} on top of the held terms: rollout, training, held-out, optimizer step."""
    w, _, cast = precision(cfg)
    shard = world if cfg.fsdp else 1  # FSDP: each rank holds its share of the gradients
    grads = Term("gradients", n["trainable"] * w / shard,
                 f"{n['trainable'] / 1e6:,.1f}M x {cfg.dtype}, kept from the last step",
                 ("lora_r", "dtype"))
    policy = cfg.rollout_copy == "same" and not cfg.distill_r  # the policy itself generates
    cached = [Term("autocast copies", 2 * n["cached"], "bf16 casts of the trainable Linear "
                   "weights, cached", ("lora_r", "autocast"))] if cast else []
    N = cfg.prompts_per_step * cfg.group_size
    roll = max(decode_bytes(cfg, shape, N), prefill_bytes(cfg, shape, prompt, cfg.prompts_per_step))
    row = prompt + cfg.max_new_tokens  # held-out rows per call: as many as the pool holds
    k = (cfg.eval_k or cfg.group_size) if cfg.eval_sampled else 1
    rows = max(1, min(cfg.n_eval * k, pool_tokens(cfg, prompt) // row))
    held = max(decode_bytes(cfg, shape, rows, greedy=True), prefill_bytes(cfg, shape, prompt, rows))
    step = n["trainable"] * w if device == "cuda" else n["largest"] * w  # foreach: one list
    return {"rollout": [grads] + (cached if policy else [])
            + [Term("decode step", roll, f"{N} rows x {shape.vocab_size:,} logits, sampled; or "
                    "a prefill forward", ("prompts_per_step", "group_size"))],
            "training": training_terms(cfg, shape, n, prompt, device, flash, shard),
            "held-out": [grads] + cached + [Term("decode step", held, f"{rows} rows a call (the "
                                                 "pool's), greedy", ("kv_pool_tokens",))],
            "optimizer step": [grads, Term("AdamW's temporary", step, "foreach: a trainable-"
                                           "sized list" if device == "cuda" else "per tensor")]}


def predict(cfg, shape, prompt=PROMPT_TOKENS, device="cuda", flash=None, world=1):
    """-> Prediction for config `cfg` on a model of shape `shape` (model.ModelConfig): the terms
    held for the whole run and each phase's, in bytes. `prompt`: the longest prompt in tokens;
    `flash`: whether flash-attn is installed (None: whether it imports here)."""
    n = count_params(cfg, shape)
    name = cfg.model or "the tiny model"
    return Prediction(f"{name}, {n['all'] / 1e6:,.1f}M parameters, {device}",
                      held_terms(cfg, shape, n, device, prompt, world),
                      phase_terms(cfg, shape, n, prompt, device, flash, world))


# ----------------------------------------------------------------------------- printing, refusing


def gib(x):
    return f"{x / GiB:.2f} GiB"


def breakdown(pred, total=None, card="", short=False):
    """The prediction as lines: the held terms, each phase's own (short: the peak phase's only),
    the peak against `total` bytes."""
    lines = [f"memory, predicted (not measured) for {pred.model}:"]
    lines += [f"  {t.name:<22}{gib(t.bytes):>11}  {t.how}" for t in pred.held if t.bytes]
    for phase, terms in pred.phases.items():
        lines.append(f"  + {phase}: {gib(pred.total(phase))} in all")
        if not short or phase == pred.phase:
            lines += [f"    {t.name:<20}{gib(t.bytes):>11}  {t.how}" for t in terms if t.bytes]
    head = f"  peak {gib(pred.peak)}, in the {pred.phase}"
    if total:
        spare = total - pred.peak
        head += (f", of {gib(total)} on {card}: " + (f"fits, {gib(spare)} to spare" if spare >= 0
                                                       else f"DOES NOT FIT, {gib(-spare)} over"))
    return "\n".join(lines + [head] + [f"  note: {x}" for x in pred.notes])


def lowering_keys(pred):
    """The config keys that lower the peak, those of the largest terms first."""
    terms = sorted(pred.held + pred.phases[pred.phase], key=lambda t: -t.bytes)
    return list(dict.fromkeys(k for t in terms if t.bytes for k in t.keys))


def refusal(pred, total, card):
    """The one-line error of a run that will not fit."""
    big = sorted(pred.held + pred.phases[pred.phase], key=lambda t: -t.bytes)[:3]
    return (f"predicted peak memory {gib(pred.peak)} ({pred.phase}) exceeds the {gib(total)} of "
            f"{card} (largest: {', '.join(f'{t.name} {gib(t.bytes)}' for t in big)}); lower it "
            f"with {', '.join(lowering_keys(pred)[:8])} (python memory.py CONFIG prints the "
            f"breakdown)")


def check_fits(cfg, dev, log, world=1):
    """train.py on a GPU, before the weights load: log the breakdown, and refuse (ValueError, one
    line: the figure and the keys that lower it) a config whose predicted peak exceeds the device's
    memory. A model whose shapes cannot be read is only noted."""
    shape, source = model_shape(cfg)
    if shape is None:
        log(f"memory: not predicted: {source}")
        return None
    pred = predict(cfg, shape, device=dev.type, world=world)
    pred.notes.append(f"shapes: {source}; the longest prompt taken as {PROMPT_TOKENS} tokens")
    props = torch.cuda.get_device_properties(dev)
    log(breakdown(pred, props.total_memory, props.name, short=True))
    if pred.peak > props.total_memory:
        raise ValueError(refusal(pred, props.total_memory, props.name))
    return pred


def main(argv):
    """python memory.py [CONFIG] [--key=value ...] [--gpu=H100|H200] [--prompt=TOKENS]"""
    opts = {a.split("=")[0]: a.split("=", 1)[1] for a in argv if a.startswith(("--gpu=",
                                                                               "--prompt="))}
    cfg = parse_config([a for a in argv if a.split("=")[0] not in opts])
    card = opts.get("--gpu", "H100")
    if card not in GPUS:
        raise ValueError(f"--gpu must be one of {', '.join(GPUS)}, got {card!r}")
    shape, source = model_shape(cfg)
    if shape is None:
        raise ValueError(f"memory: {source}")
    pred = predict(cfg, shape, int(opts.get("--prompt", PROMPT_TOKENS)))
    pred.notes.append(f"shapes: {source}; the longest prompt taken as "
                      f"{opts.get('--prompt', PROMPT_TOKENS)} tokens")
    print(breakdown(pred, GPUS[card] * GiB, f"an {card} ({GPUS[card]} GiB as torch reports it)"))


if __name__ == "__main__":
    sys.exit(cli(main, sys.argv[1:], lambda argv: __doc__))
