"""Our model against transformers' implementation, on the same weights, in both directions."""
import pytest
import torch
import torch.nn.functional as F
from transformers import (Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          AutoModelForCausalLM)

from zeros_kernels.cpu_ext import load_cpu_ext
from zeros_kernels.linear_cpu import linear_cpu, linear_cpu_pack
from model import Transformer, ModelConfig

COMMON = dict(vocab_size=61, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256)


def hf_model(kind, tie, **extra):
    torch.manual_seed(0)
    if kind == "dense":
        cfg = Qwen3Config(**COMMON, intermediate_size=96, tie_word_embeddings=tie, rope_theta=1e6,
                          **extra)
        m = Qwen3ForCausalLM(cfg)
    else:
        cfg = Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=24,
                             num_experts=6, num_experts_per_tok=2, tie_word_embeddings=tie, **extra)
        m = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        # the default init leaves norms at exactly 1 and the router at 0: randomise everything
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


CASES = [("dense", True, {}), ("dense", False, {}), ("moe", False, {"norm_topk_prob": True}),
         ("moe", True, {"norm_topk_prob": False}), ("moe", False, {"decoder_sparse_step": 2})]


@pytest.mark.parametrize("kind,tie,extra", CASES)
def test_load_hf_checkpoint_matches_transformers(tmp_path, kind, tie, extra):
    ref = hf_model(kind, tie, **extra)
    ref.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(str(tmp_path)).eval()
    idx = torch.randint(0, COMMON["vocab_size"], (2, 37))
    with torch.no_grad():
        want = ref(idx).logits
        got = ours(idx)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind,tie,extra", CASES[:3])
def test_our_checkpoint_loads_in_transformers(tmp_path, kind, tie, extra):
    ref = hf_model(kind, tie, **extra)
    ref.save_pretrained(tmp_path / "hf")
    ours = Transformer.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():  # change the weights so the round trip is not trivially the input
        for p in ours.parameters():
            p.mul_(1.01)
    ours.save_pretrained(tmp_path / "ours")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    idx = torch.randint(0, COMMON["vocab_size"], (2, 21))
    with torch.no_grad():
        assert (back(idx).logits - ours(idx)).abs().max().item() <= 1e-4


def test_sharded_checkpoint(tmp_path):
    ref = hf_model("dense", False)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = Transformer.from_pretrained(str(tmp_path)).eval()
    idx = torch.randint(0, COMMON["vocab_size"], (1, 9))
    with torch.no_grad():
        assert (ours(idx) - ref(idx).logits).abs().max().item() <= 1e-4


def test_packed_equals_padded():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                intermediate_size=64)).eval()
    lens = [5, 9, 3]
    seqs = [torch.randint(0, 40, (n,)) for n in lens]
    packed = torch.cat(seqs)[None]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        out = m(packed, pos=pos, cu_seqlens=cu, max_seqlen=9)[0]
        for s, a in zip(seqs, cu[:-1].tolist()):
            alone = m(s[None])[0]
            assert (out[a:a + len(s)] - alone).abs().max().item() <= 1e-5


def test_unsupported_model_type_is_named():
    with pytest.raises(ValueError, match="llama"):
        ModelConfig.from_hf({"model_type": "llama"})


@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("kind,shape", [("dense", (3, 11)), ("moe", (3, 11)), ("dense", (8, 1)),
                                        ("moe", (3, 2))])
def test_packed_weights_match_the_modules(kind, shape, avx512, monkeypatch):
    """Inside Transformer.packed() (the engine's CPU path: q|k|v and gate|up as one matmul each, on
    oneDNN, or zeros_kernels/linear_cpu at 8 rows or fewer) the forward equals the plain one; the copies
    go on exit, and a weight changed between two calls is read fresh. Groups with a LoRA layer keep
    the modules' forwards, the rest is packed. The kernel runs only on an AVX-512 CPU (on AVX2 it
    spills): `avx512` poses as one (the kernel is correct anywhere, only slow without it)."""
    import model as model_module
    from model import add_lora
    from zeros_kernels import linear_cpu as lc
    monkeypatch.setattr(lc, "linear_cpu_available",
                        lambda: avx512 and load_cpu_ext("linear_cpu") is not None)
    monkeypatch.setattr(Transformer, "PACK_MIN_HIDDEN", 0)  # this model is narrow
    small = []  # the rows of each call that took the C++ kernel
    monkeypatch.setattr(model_module, "linear_cpu", lambda x, w, n: small.append(x.shape[:-1])
                        or linear_cpu(x, w, n))
    ref = hf_model(kind, tie=False)
    ours = Transformer(ModelConfig.from_hf(ref.config.to_dict())).eval()
    ours.load_state_dict(ref.state_dict(), strict=False)
    idx = torch.randint(0, COMMON["vocab_size"], shape)
    with torch.no_grad():
        want = ours(idx)
        with ours.packed():
            assert set(ours.model.layers[0].self_attn.packs) == {"qkv", "o"}
            assert (ours(idx) - want).abs().max().item() <= 1e-5
        assert not ours.model.layers[0].self_attn.packs and not ours.packs
        ours.model.layers[0].self_attn.v_proj.weight.mul_(1.5)  # between two calls
        with ours.packed():
            got = ours(idx)
        assert (got - ours(idx)).abs().max().item() <= 1e-5 and (got - want).abs().max() > 1e-3
        add_lora(ours, r=2, alpha=4, targets=["q_proj", "up_proj"])
        for _, m in ours.named_modules():
            if hasattr(m, "lora_B"):
                m.lora_B.weight.normal_()  # a live adapter
        want = ours(idx)
        with ours.packed():
            attn = ours.model.layers[0].self_attn
            assert set(attn.packs) == {"o"}  # q_proj is adapted: q|k|v runs module by module
            assert (ours(idx) - want).abs().max().item() <= 1e-5
    # the small path ran only on batches of at most 8 rows (an MoE expert's few tokens too), and
    # ran wherever the kernel is and the batch is small
    assert all(s.numel() <= 8 for s in small)
    assert bool(small) == (avx512 and load_cpu_ext("linear_cpu") is not None
                           and (idx.numel() <= 8 or kind == "moe"))


def test_the_small_linear_kernel_is_used_only_with_avx512(monkeypatch):
    """On AVX2 its accumulators spill (9x slower than oneDNN on an EPYC): no packed copy there, so
    the model takes oneDNN's path."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert linear_cpu_pack(torch.randn(64, 32)) is None


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_linear_cpu_equals_f_linear(rows):
    """zeros_kernels/linear_cpu (a small decode batch's matmuls) equals F.linear: N not a multiple of its
    32-column blocks (zero padding cut off), K odd, x a strided view, leading dims kept."""
    if load_cpu_ext("linear_cpu") is None:
        pytest.skip("no C++ kernel here")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(100, 37, generator=gen)
    x = torch.randn(rows, 1, 2 * 37, generator=gen)[..., ::2]  # (rows, 1, 37), stride 2
    got = linear_cpu(x, load_cpu_ext("linear_cpu").pack(w), 100)  # any CPU: pack() directly
    assert got.shape == (rows, 1, 100)
    assert (got - F.linear(x, w)).abs().max().item() <= 1e-5
