"""Stage 4 LoRA: our adapter files load in PEFT (and PEFT's in ours) with the same logits, on a MoE
with dense layers too (and what PEFT cannot express is refused), merging and disabling are exact,
only the adapter trains, the KV-cache engine still matches the naive loop, and a LoRA checkpoint is
a plain one."""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import sync
from model import (LoRALinear, ModelConfig, Transformer, add_lora, load_adapter, lora_state_dict,
                   merge_lora, merged_state_dict, save_adapter, set_lora_enabled)
from rollout import Engine, generate_naive

class CharTok:
    # the smallest tokenizer the engine needs (as in test_rollout.py): 0 pad, 1 eos, then characters
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(97 + t % 26) for t in r if t >= 2) for r in rows]


def tiny(moe=False, tie=False, seed=0, **layers):
    torch.manual_seed(seed)
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                 **layers) if moe else {}
    m = Transformer(ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                intermediate_size=64, tie_word_embeddings=tie, **extra))
    with torch.no_grad():
        # norms at exactly 1 and tiny weights would hide mistakes: randomise everything
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


def randomise_lora(model, scale=0.2):
    """lora_B starts at zero, which would make every comparison below trivially pass."""
    with torch.no_grad():
        for _, m in model.named_modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, scale)
    return model


def lora_model(moe=False, tie=False, **kw):
    base = tiny(moe, tie)
    return base, randomise_lora(add_lora(copy.deepcopy(base), **kw))


IDX = torch.randint(2, 40, (2, 13), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("moe", [False, True])
def test_peft_loads_our_adapter(tmp_path, moe):
    import peft
    # MoE: our per-expert adapters must land on transformers'
    # fused (E, out, in) expert tensors, which PEFT does on load
    base, ours = lora_model(moe, r=4, alpha=8)
    base.save_pretrained(tmp_path / "base")
    save_adapter(ours, tmp_path / "adapter", str(tmp_path / "base"))
    hf = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                        tmp_path / "adapter")
    with torch.no_grad():
        want, got, plain = hf.eval()(IDX).logits, ours(IDX), base(IDX)
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - plain).abs().max().item() > 1e-2  # the adapter does something


def test_we_load_a_peft_adapter(tmp_path):
    import peft
    base = tiny()
    base.save_pretrained(tmp_path / "base")
    cfg = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"],
                          task_type="CAUSAL_LM")
    hf = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), cfg)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path / "adapter")
    ours = load_adapter(copy.deepcopy(base), tmp_path / "adapter")
    with torch.no_grad():
        assert (ours(IDX) - hf.eval()(IDX).logits).abs().max().item() <= 1e-4
    save_adapter(ours, tmp_path / "ours", "base")  # and our own files round-trip
    again = load_adapter(copy.deepcopy(base), tmp_path / "ours")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())


@pytest.mark.parametrize("layers", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[1])],
                         ids=["sparse_step", "mlp_only_layers"])
def test_peft_loads_our_adapter_on_mixed_dense_and_moe_layers(tmp_path, layers):
    import peft
    # PEFT reads gate/up/down_proj targets as the fused experts: the dense layers' MLP adapters
    # must reach it another way. Input dropout, which PEFT refuses on the experts, is written as 0
    base = tiny(True, **layers)
    assert sorted(type(b.mlp).__name__ for b in base.model.layers) == ["MLP", "MoE"]
    ours = randomise_lora(add_lora(copy.deepcopy(base), r=4, alpha=8, dropout=0.1))
    base.save_pretrained(tmp_path / "base")
    save_adapter(ours, tmp_path / "adapter", str(tmp_path / "base"))
    hf = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                        tmp_path / "adapter")
    with torch.no_grad():
        want, got = hf.eval()(IDX).logits, ours(IDX)
        assert (got - want).abs().max().item() <= 1e-4
        dense = [m for n, m in ours.named_modules()
                 if isinstance(m, LoRALinear) and ".mlp." in n and ".experts." not in n]
        assert len(dense) == 3
        for m in dense:
            m.enabled = False
        # without the dense MLPs' adapters the logits move: the comparison above sees them
        assert (ours(IDX) - want).abs().max().item() > 1e-2
    # and our own loader reads the same files back onto the same modules, fresh or (resume) onto
    # a model that has its adapters already
    for model in (copy.deepcopy(base), add_lora(copy.deepcopy(base), r=4, alpha=8)):
        again = lora_state_dict(load_adapter(model, tmp_path / "adapter"))
        assert again.keys() == lora_state_dict(ours).keys()
        assert all(torch.equal(v, again[k]) for k, v in lora_state_dict(ours).items())


def test_moe_adapters_that_peft_cannot_express_are_refused(tmp_path):
    import peft
    m = add_lora(tiny(True, decoder_sparse_step=2), targets=("q_proj", "experts.0.down_proj"))
    with pytest.raises(ValueError, match="every expert of every MoE layer"):
        save_adapter(m, tmp_path / "some", "base")
    m = add_lora(tiny(True), targets=("gate_proj", "down_proj"))
    with pytest.raises(ValueError, match="up_proj"):
        save_adapter(m, tmp_path / "gate", "base")
    # PEFT's own adapter on transformers' fused experts: one rank over gate and up together
    base = tiny(True)
    base.save_pretrained(tmp_path / "base")
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj", "up_proj"],
                          task_type="CAUSAL_LM")
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                        cfg).save_pretrained(tmp_path / "fused")
    with pytest.raises(ValueError, match="fused MoE experts do not load"):
        load_adapter(copy.deepcopy(base), tmp_path / "fused")


@pytest.mark.parametrize("moe", [False, True])
def test_merge_and_disable(moe):
    base, ours = lora_model(moe, tie=True, r=4, alpha=8)
    n_experts = sum(".experts." in n for n, _ in ours.named_modules() if n.endswith("lora_A"))
    assert n_experts == (2 * 4 * 3 if moe else 0)  # every expert's gate/up/down, not the router
    assert (type(ours.lm_head) is torch.nn.Linear
            and ours.lm_head.weight is ours.model.embed_tokens.weight)
    with torch.no_grad():
        unmerged, plain = ours(IDX), base(IDX)
        set_lora_enabled(ours, False)
        assert torch.equal(ours(IDX), plain)  # disabled is exactly the base, not approximately
        set_lora_enabled(ours, True)
        adapter = lora_state_dict(ours)
        merged = merge_lora(ours)
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        assert merged.state_dict().keys() == base.state_dict().keys()
        assert (merged(IDX) - unmerged).abs().max().item() <= 1e-5
    # the same bits as the rollout side's merge in sync.py,
    # so a merged model and an adapter sync agree exactly
    want = sync.merge_lora(base.state_dict(), adapter, 8 / 4)
    assert all(torch.equal(v, want[k]) for k, v in merged.state_dict().items())


def test_only_lora_trains():
    base, ours = lora_model(r=2, alpha=32)
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    # all parameters, as train.py passes them
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    ours.train()
    h = ours(IDX[:, :-1], hidden=True)  # train.py's path: hidden states, then lm_head in chunks
    F.cross_entropy(ours.lm_head(h).flatten(0, 1).float(), IDX[:, 1:].flatten()).backward()
    opt.step()
    after = ours.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all(".lora_" in k for k in changed)  # base weights bit-identical
    assert any(".lora_B." in k for k in changed)


@pytest.mark.parametrize("moe", [False, True])
def test_kv_cache_engine_matches_naive_loop(moe):
    _, ours = lora_model(moe, r=4, alpha=8)
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
    ro = Engine(ours, CharTok(), max_new_tokens=8, temperature=0.0).generate(prompts, group_size=2)
    ref_tok, ref_lp = generate_naive(ours, CharTok(), prompts, group_size=2, max_new_tokens=8,
                                     temperature=0.0)
    for i in range(len(ro)):
        n = int(ro.mask[i].sum())
        assert ro.tokens[i, :n].tolist() == ref_tok[i]
        assert torch.allclose(ro.logp[i, :n], torch.tensor(ref_lp[i]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("moe,tie", [(False, True), (True, False)])
def test_save_pretrained_writes_merged_weights(tmp_path, moe, tie):
    from safetensors.torch import load_file
    base, ours = lora_model(moe, tie, r=4, alpha=8)
    ours.save_pretrained(tmp_path)
    keys = load_file(tmp_path / "model.safetensors").keys()
    # plain names only
    assert keys == {k for k in base.state_dict() if not (tie and k == "lm_head.weight")}
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        want = ours(IDX)
        assert (back(IDX).logits - want).abs().max().item() <= 1e-4
        assert (Transformer.from_pretrained(str(tmp_path))(IDX) - want).abs().max().item() <= 1e-5
        set_lora_enabled(ours, False)  # a disabled adapter is left out of the checkpoint
        assert torch.equal(merged_state_dict(ours)["model.layers.0.self_attn.q_proj.weight"],
                           base.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    # the live model keeps its adapter (sync.py ships it)
    assert any(".lora_" in k for k in ours.state_dict())


def test_errors_name_the_problem():
    m = tiny()
    with pytest.raises(ValueError, match="lm_head"):
        add_lora(copy.deepcopy(m), targets=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match=r"\['w_proj'\]"):
        add_lora(copy.deepcopy(m), targets=("q_proj", "w_proj"))
    with pytest.raises(TypeError, match="q_norm"):
        add_lora(copy.deepcopy(m), targets=("q_norm",))
    with pytest.raises(ValueError, match="r must be"):
        add_lora(copy.deepcopy(m), r=0)
    add_lora(m)
    with pytest.raises(ValueError, match="already has LoRA"):
        add_lora(m)
    m.model.layers[1].mlp.up_proj.enabled = False
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj"):
        merge_lora(m)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_adapter(tiny(), "unused", "base")


def test_bf16_merge_rounds_once_like_sync():
    base, ours = lora_model(r=4, alpha=8)
    base, ours = base.to(torch.bfloat16), ours.to(torch.bfloat16)
    # fp32 math, one rounding to bf16
    want = sync.merge_lora(base.state_dict(), lora_state_dict(ours), 8 / 4)
    got = merge_lora(ours).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in got.items())
