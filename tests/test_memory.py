"""The memory model (memory.py) against what torch really allocates, on the CPU: every byte of every
tensor storage alive (LiveBytes, a dispatch mode that counts each storage torch makes until it is
freed: the CPU's stand-in for torch.cuda.max_memory_allocated) over an RL step of a 9M-parameter
model, where the weights, gradients and optimizer state dominate; what autograd saves for the
backward (saved_tensors_hooks) in every precision and path of the training forward; each term by
hand on a model small enough to count; and the refusal, which names the figure and the keys."""
import dataclasses
import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import memory
import train
import warmstart
from config import Config
from model import ModelConfig, Transformer, add_lora
from rollout import Engine, pool_pages
from update import build_batch, token_logprobs, train_on

# the predictions must come this close to the measurements (a fraction of the measured bytes)
STEP_TOLERANCE = 0.05  # a whole step's peak: weights, gradients, AdamW, the pool, the phase's own
SAVED_TOLERANCE = 0.06  # what one training forward saves, in each precision and path


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their peak: a storage counts from the op that
    returns it (or `add`) until it is freed."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.ids = set()

    def add(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        s = t.untyped_storage()
        if id(s) in self.ids:
            return
        self.ids.add(id(s))
        self.now += s.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(s, self.free, id(s), s.nbytes())

    def free(self, key, n):
        self.ids.discard(key)
        self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.add(t)
        return out


class _Tok:  # the engine needs a pad id and a decoder; EOS never comes (every row runs full)
    pad_token_id, eos_token_id = 0, None

    def batch_decode(self, rows, **kw):
        return ["" for _ in rows]


def _shape(**kw):
    base = dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                max_position_embeddings=512)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("autocast", ["none", "bfloat16"])
def test_an_rl_step_on_the_cpu_within_tolerance(monkeypatch, autocast):
    """A rollout (the engine, its KV pool) and an update (train_on: 2 micro-batches, AdamW) as
    train.py runs them, the second step measured (the first makes the gradients and AdamW's
    state): each phase's peak within STEP_TOLERANCE of the prediction."""
    monkeypatch.setattr(Transformer, "PACK_MIN_HIDDEN", 10 ** 9)  # the CPU's packed copies: off
    torch.manual_seed(0)
    shape, P = _shape(), 32
    cfg = Config(model="x", prompts_per_step=2, group_size=4, max_new_tokens=32, micro_batch=4,
                 logp_chunk=64, autocast=autocast, lr=1e-4)
    model = Transformer(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    eng = Engine(model, _Tok(), max_new_tokens=cfg.max_new_tokens, eos_ids=[],
                 pool_tokens=pool_pages(cfg, P) * cfg.page_size)
    prompts = [torch.randint(3, shape.vocab_size, (P,)).tolist() for _ in range(2)]
    amp = torch.autocast("cpu", torch.bfloat16, enabled=autocast == "bfloat16")
    live, seen = LiveBytes(), {}
    for p in model.parameters():
        live.add(p)
    with live:
        for step in range(2):
            live.peak = live.now
            with amp:
                ro = eng.generate(prompts, cfg.group_size, seed=step)
            seen["rollout"], live.peak = live.peak, live.now
            ids, tmask = build_batch([prompts[i // 4] for i in range(len(ro))], list(ro.tokens),
                                     list(ro.mask), 0)
            roll = torch.zeros(tmask.shape)
            roll[tmask] = ro.logp[ro.mask]
            train_on(cfg, model, opt, ids, tmask, torch.randn(len(ro)), 1, roll, amp=amp)
            seen["training"] = live.peak
    pred = memory.predict(cfg, shape, prompt=P, device="cpu")
    want = {"rollout": pred.total("rollout"),
            "training": max(pred.total("training"), pred.total("optimizer step"))}
    held = sum(t.bytes for t in pred.held)
    assert held > 0.5 * seen["rollout"]  # the model's terms dominate, as meant
    for phase, got in seen.items():
        print(phase, want[phase] / got)
        assert abs(want[phase] - got) <= STEP_TOLERANCE * got, (phase, want[phase], got)


def _saved(model, ids, tmask, cfg):
    """Bytes autograd saves for the backward of one training forward (update.token_logprobs),
    each storage once, the parameters' own left out (the autocast casts of them counted)."""
    params = {id(p.untyped_storage()) for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if id(s) not in params:
            seen[id(s)] = s.nbytes()
        return t

    amp = torch.autocast("cpu", torch.bfloat16, enabled=cfg.autocast == "bfloat16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        token_logprobs(model, ids, tmask, packed=cfg.pack == "on",
                       share_prompt=cfg.share_prompt, chunk=cfg.logp_chunk)
    return sum(seen.values())


MODES = {"fp32": {}, "autocast": dict(autocast="bfloat16"), "bf16 weights": dict(dtype="bfloat16"),
         "lora": dict(lora_r=4), "lora, autocast": dict(lora_r=4, autocast="bfloat16"),
         "each row whole": dict(share_prompt=False), "packed mask": dict(pack="on"),
         "moe": dict(experts=4), "moe, autocast": dict(experts=4, autocast="bfloat16"),
         "moe, lora, autocast": dict(experts=4, lora_r=4, autocast="bfloat16")}


@pytest.mark.parametrize("mode", MODES)
def test_what_the_training_forward_saves(mode):
    """memory.layer_activations and the attention's extra, tensor by tensor, against
    saved_tensors_hooks: every precision (fp32, autocast over fp32, bf16 weights), LoRA, the
    shared prompt, each row whole, packed with a mask, an MoE."""
    kw = dict(MODES[mode])
    E = kw.pop("experts", 0)
    shape = _shape(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                   num_attention_heads=4, head_dim=32, num_experts=E,
                   num_experts_per_tok=2 if E else 0, moe_intermediate_size=64 if E else 0)
    cfg = Config(model="x", group_size=4, max_new_tokens=40, micro_batch=4, **kw)
    torch.manual_seed(0)
    model = Transformer(shape).to(getattr(torch, cfg.dtype))
    if cfg.lora_r:
        add_lora(model, cfg.lora_r, cfg.lora_alpha)
    P, B = 24, cfg.micro_batch
    ids = torch.cat([torch.randint(3, 512, (P,)).expand(B, P),
                     torch.randint(3, 512, (B, cfg.max_new_tokens))], 1)
    tmask = torch.zeros(ids.shape, dtype=torch.bool)
    tmask[:, P - 1:-1] = True
    got = _saved(model, ids, tmask, cfg)
    terms = {t.name: t.bytes for t in memory.training_terms(
        cfg, shape, memory.count_params(cfg, shape), P, "cpu")}
    want = sum(terms.get(k, 0) for k in ("activations", "attention", "scored positions",
                                         "autocast copies"))
    assert abs(want - got) <= SAVED_TOLERANCE * got, (want, got)


def _hand_shape():
    # 176 parameters: embedding 40 (tied head); a layer: q 16, k 8, v 8, o 16, q/k norms 2 + 2,
    # MLP 72, its two norms 8 -> 132; the final norm 4
    return ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=2)


def test_each_term_by_hand():
    shape = _hand_shape()
    cfg = Config(model="x", prompts_per_step=2, group_size=3, max_new_tokens=20, page_size=16,
                 micro_batch=3, logp_chunk=8, share_prompt=False)
    n = memory.count_params(cfg, shape)
    assert (n["all"], n["trainable"], n["linear"], n["rows"], n["largest"]) == (176, 176, 120, 28,
                                                                                  40)
    held = {t.name: t.bytes for t in memory.held_terms(cfg, shape, n, "cuda", prompt=20)}
    assert held["weights"] == 176 * 4 and held["optimizer"] == 2 * 176 * 4
    # the pool: per prompt its full page (20 // 16) and 3 rows of ceil((15 + 20) / 16) = 3 pages;
    # 20 pages of 16 tokens x 2 (K, V) x 1 layer x 1 KV head x 2 (head_dim) x 2 bytes (bf16)
    assert held["KV pool"] == 2 * (1 + 3 * 3) * 16 * 8
    copies = {form: memory.rollout_copy_bytes(dataclasses.replace(cfg, rollout_copy=form), n)[0]
              for form in ("bf16", "fp8", "nm2:4")}
    # fp8: 120 Linear weights at 1 byte and a 4-byte scale for each of their 28 rows; the
    # embedding and the norms (56) in bf16
    assert copies == {"bf16": 2 * 176, "fp8": 120 + 4 * 28 + 2 * 56, "nm2:4": 4 * 176}
    # fp32, a token in the layer: 24 C + 16 (Q + K + F) + 4 H_q (SDPA's logsumexp) bytes
    assert memory.layer_activations(cfg, shape) == 24 * 4 + 16 * (4 + 2 + 6) + 4 * 2
    amp = dataclasses.replace(cfg, autocast="bfloat16")  # each Linear keeps its own bf16 input
    assert memory.layer_activations(amp, shape) == 26 * 4 + 10 * (4 + 2) + 8 * 6 + 4 * 2
    phases = memory.phase_terms(cfg, shape, n, 20, "cuda")
    terms = {p: {t.name: t.bytes for t in ts} for p, ts in phases.items()}
    assert terms["rollout"]["gradients"] == 176 * 4
    # 6 rows, each step's logits (fp32 head, its copy, scaled, log-softmax, probabilities)
    assert terms["rollout"]["decode step"] == max(6 * 10 * (4 + 12), 2 * 20 * (3 * 4 * 6 + 16 * 4))
    train_terms = terms["training"]
    per = memory.layer_activations(cfg, shape) + 8 + 2 * 4 * 2 + 8 * 4  # + ids, cos/sin, norm
    assert train_terms["activations"] == 3 * (20 + 20) * per  # 3 rows, each whole
    # 8 of the 60 scored positions projected at a time (12 bytes a logit), two of the tied head's
    # (10, 4) gradients; or one layer's backward, here the larger
    assert train_terms["backward"] == max(12 * 8 * 10 + 2 * 40 * 4, 3 * 40 * per)
    assert train_terms["gradients"] == 176 * 4  # 6 rows a step, 3 a micro-batch: one came first
    assert terms["optimizer step"]["AdamW's temporary"] == 176 * 4  # foreach, on CUDA
    # held-out: as many rows as the pool's 320 tokens hold at 40 a row; their prefill is larger
    assert terms["held-out"]["decode step"] == max(8 * 10 * (4 + 8), 8 * 20 * (3 * 4 * 6 + 16 * 4))
    amp_terms = {p: {t.name: t.bytes for t in ts}
                 for p, ts in memory.phase_terms(amp, shape, n, 20, "cuda").items()}
    # autocast caches the bf16 casts of the Linear weights that train (the tied head's too);
    # a training forward keeps every Linear's but the head's, which its chunks cast anew
    assert amp_terms["rollout"]["autocast copies"] == 2 * (120 + 40)
    assert amp_terms["training"]["autocast copies"] == 2 * 120
    kl = {t.name: t.bytes for t in memory.held_terms(dataclasses.replace(cfg, kl_coef=0.1), shape,
                                                      n, "cuda", prompt=20)}
    assert kl["reference"] == 176 * 4


def _qwen_folder(tmp_path):
    """A local folder with Qwen3-0.6B's config.json, no weights: the shapes are all it reads."""
    d = tmp_path / "qwen3-0.6b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(memory.KNOWN["Qwen/Qwen3-0.6B"]))
    return str(d)


class _Props:
    name, total_memory = "a 16 GiB GPU", 16 * 2 ** 30


def test_refused_before_the_weights_load_with_the_figure_and_the_keys(tmp_path, monkeypatch):
    """A config that will not fit stops in build, before build_policy, in one line that names the
    predicted peak, the device's memory and the keys that lower it."""
    cfg = Config(model=_qwen_folder(tmp_path), max_new_tokens=1024, autocast="bfloat16")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: _Props())

    def loads(*a, **k):
        raise AssertionError("the weights started to load")
    monkeypatch.setattr(train, "build_policy", loads)
    logged = []
    with pytest.raises(ValueError) as e:
        train.build(cfg, 0, 1, torch.device("cuda"), None, logged.append)
    msg = str(e.value)
    pred = memory.predict(cfg, memory.model_shape(cfg)[0])
    assert "\n" not in msg and f"{pred.peak / 2 ** 30:.2f} GiB" in msg and "16.00 GiB" in msg
    for key in ("micro_batch", "kv_pool_tokens", "logp_chunk", "lora_r"):
        assert key in msg, key
    assert "peak" in logged[0] and "DOES NOT FIT" in logged[0]  # the breakdown came first
    small = dataclasses.replace(cfg, micro_batch=1, prompts_per_step=2, lora_r=8,
                                max_new_tokens=256)
    assert memory.check_fits(small, torch.device("cuda"), logged.append).peak < 16 * 2 ** 30


def test_offline_the_known_shapes_serve_and_the_cli_prints_the_breakdown(monkeypatch, capsys):
    """No network: a Hub model's config.json is neither reachable nor cached, and the shapes kept
    in memory.py serve, with a note; `python memory.py CONFIG` prints the breakdown."""
    monkeypatch.setattr(warmstart, "hub_state", lambda: "the Hub cannot be reached")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shape, note = memory.model_shape(Config(model="Qwen/Qwen3-0.6B"))
    assert shape.hidden_size == 1024 and "memory.py's copy" in note
    assert memory.model_shape(Config(model="nobody/unknown-model"))[0] is None
    memory.main(["configs/countdown_qwen3.py", "--gpu=H100"])
    out = capsys.readouterr().out
    assert "KV pool" in out and "activations" in out and "H100" in out and "peak" in out
