"""A LoRA checkpoint: ckpt/ is the merged model, which transformers loads as one model (with PEFT
installed too), ckpt/adapter/ the adapter on its named base, and resume reads the adapter back."""
import copy
import json
import os
import shutil

import torch
from transformers import AutoModelForCausalLM

import config
from checkpoint import load_checkpoint, save_checkpoint
from model import LoRALinear, ModelConfig, Transformer, add_lora, lora_state_dict
from tasks import build_char_tokenizer


class Sampler:
    # the one thing save_checkpoint and load_checkpoint ask of the prompt sampler
    def __init__(self, pos=0):
        self.pos = pos

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, d):
        self.pos = d["pos"]


def tiny(vocab):
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                intermediate_size=64, tie_word_embeddings=True))
    with torch.no_grad():
        # norms at exactly 1 and tiny weights would hide mistakes: randomise everything
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


def test_lora_checkpoint_is_one_model_and_resumes(tmp_path):
    import peft
    tok = build_char_tokenizer(str(tmp_path / "tokenizer"))
    cfg = config.Config(lora_r=4, lora_alpha=8.0, out_dir=str(tmp_path / "out"))
    base = tiny(len(tok))
    base.save_pretrained(os.path.join(cfg.out_dir, "warmstart"))  # where the run's base lives
    ours = add_lora(copy.deepcopy(base), 4, 8.0)
    with torch.no_grad():  # lora_B starts at zero: every comparison would pass trivially
        for m in ours.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    save_checkpoint(cfg, ours, tok, opt, Sampler(7), 3, [{"step": 2}], {})
    ckpt = tmp_path / "out" / "ckpt"
    idx = torch.randint(2, len(tok), (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, plain = ours(idx), base(idx)
        assert (want - plain).abs().max().item() > 1e-2  # the adapter does something
        # transformers (PEFT installed) loads the merged weights and nothing on top of them
        hf = AutoModelForCausalLM.from_pretrained(ckpt).eval()
        assert (hf(idx).logits - want).abs().max().item() <= 1e-4
        # the adapter folder names its base, and on it means the same model
        with open(ckpt / "adapter" / "adapter_config.json") as f:
            assert json.load(f)["base_model_name_or_path"] == os.path.abspath(
                os.path.join(cfg.out_dir, "warmstart"))
        on_base = peft.AutoPeftModelForCausalLM.from_pretrained(ckpt / "adapter").eval()
        assert (on_base(idx).logits - want).abs().max().item() <= 1e-4

    def resume():
        # as train.py builds it: the base weights with a fresh adapter, then the checkpoint
        model = add_lora(copy.deepcopy(base), 4, 8.0)
        sampler = Sampler()
        step, history = load_checkpoint(cfg, model, torch.optim.AdamW(model.parameters()),
                                        sampler, torch.device("cpu"), {})
        assert (step, history, sampler.pos) == (3, [{"step": 2}], 7)
        assert all(torch.equal(v, lora_state_dict(model)[k])
                   for k, v in lora_state_dict(ours).items())
        with torch.no_grad():
            assert (model(idx) - want).abs().max().item() <= 1e-6

    resume()
    # a checkpoint written before ckpt/adapter/ existed kept the adapter in ckpt/: still resumes
    for fn in os.listdir(ckpt / "adapter"):
        shutil.move(ckpt / "adapter" / fn, ckpt / fn)
    os.rmdir(ckpt / "adapter")
    resume()
