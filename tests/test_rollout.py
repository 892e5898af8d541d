"""The engine against the naive full-recompute loop, and its sampling and stopping rules."""
import pytest
import torch

from model import ModelConfig, Transformer
from rollout import Engine, generate_naive, sample


class CharTok:  # the smallest tokenizer the engine needs: ids 0 pad, 1 eos, then characters
    pad_token_id, eos_token_id = 0, 1
    chars = "abcdefghij =#>?+,\n0123456789"

    def encode(self, s):
        return [self.chars.index(c) + 2 for c in s]

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(self.chars[t - 2] for t in r if t >= 2) for r in rows]


def tiny_model(seed=0, moe=False):
    torch.manual_seed(seed)
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) if moe else {}
    return Transformer(ModelConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, intermediate_size=64, **extra)).eval()


PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.mark.parametrize("moe", [False, True])
def test_greedy_matches_naive_loop(moe):
    m, tok = tiny_model(moe=moe), CharTok()
    eng = Engine(m, tok, max_new_tokens=12, temperature=0.0)
    ro = eng.generate(PROMPTS, group_size=2)
    ref_tok, ref_lp = generate_naive(m, tok, PROMPTS, group_size=2, max_new_tokens=12, temperature=0.0)
    for i in range(len(ro)):
        n = int(ro.mask[i].sum())
        assert ro.tokens[i, :n].tolist() == ref_tok[i]
        assert torch.allclose(ro.logp[i, :n], torch.tensor(ref_lp[i]), atol=1e-5, rtol=0)


def test_sampling_matches_naive_and_is_seeded():
    m, tok = tiny_model(), CharTok()
    eng = Engine(m, tok, max_new_tokens=10, temperature=1.0)
    a, b, c = eng.generate(PROMPTS, 3, seed=5), eng.generate(PROMPTS, 3, seed=5), eng.generate(PROMPTS, 3, seed=6)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logp, b.logp)
    assert not torch.equal(a.tokens, c.tokens)
    ref_tok, ref_lp = generate_naive(m, tok, PROMPTS, 3, seed=5, max_new_tokens=10, temperature=1.0)
    for i in range(len(a)):
        n = int(a.mask[i].sum())
        assert a.tokens[i, :n].tolist() == ref_tok[i]
        assert torch.allclose(a.logp[i, :n], torch.tensor(ref_lp[i]), atol=1e-5, rtol=0)


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits, 1.0, 0.7, gen)[0].item() for _ in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.7: tokens 2 and 3 are never drawn


def test_eos_stop_and_length():
    m, tok = tiny_model(), CharTok()
    # make EOS the favourite after token 5, so row 0 (ending in 7) and others behave differently
    eng = Engine(m, tok, max_new_tokens=6, temperature=0.0)
    ro = eng.generate(PROMPTS, 1)
    for i in range(len(ro)):
        n = int(ro.mask[i].sum())
        assert (ro.finish[i] == "eos") == (ro.tokens[i, n - 1].item() == 1)
        assert ro.finish[i] != "length" or n == 6
        assert not ro.mask[i, n:].any()
    first = ro.texts[0][:2]
    ro2 = Engine(m, tok, max_new_tokens=6, temperature=0.0, stop=[first]).generate(PROMPTS[:1], 1)
    if len(first) == 2:
        assert ro2.finish[0] == "stop" and ro2.texts[0] == first


def test_prompt_too_long_is_named():
    m, tok = tiny_model(), CharTok()
    eng = Engine(m, tok, max_new_tokens=m.config.max_position_embeddings)
    with pytest.raises(ValueError, match="prompt 0 has 5 tokens"):
        eng.generate(PROMPTS)
