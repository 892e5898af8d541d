"""The one-GPU recipe's two traps, offline: Qwen3's chat template leaves thinking on unless the
prompt is rendered with enable_thinking=False (config key chat_thinking), and Qwen3 ends a turn
with either of two tokens, the tokenizer's EOS (<|im_end|>) and the one its
generation_config.json adds (<|endoftext|>): each must end a row. A character tokenizer and a tiny
random model stand in."""
import json

import torch

from config import Config, parse_config
from model import ModelConfig, Transformer
from rollout import Engine
from tasks import Problem, build_char_tokenizer, encode_pool, end_ids, format_prompt
from warmstart import build_policy

# the end of Qwen3's template, as it renders a user turn and the assistant's start
QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}"
              "<think>\n\n</think>\n\n{% endif %}{% endif %}")
EMPTY_THINK = "<think>\n\n</think>\n\n"


def test_chat_thinking_off_reaches_the_template(tmp_path):
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    tok.chat_template = QWEN3_LIKE
    p = Problem("2+3?", "5", "synthetic")
    on, off = format_prompt(tok, p, True), format_prompt(tok, p, True, thinking=False)
    assert on.endswith("<|im_start|>assistant\n") and off == on + EMPTY_THINK
    assert format_prompt(tok, p, False, thinking=False) == p.prompt  # no template: the raw prompt
    _, ids = encode_pool(tok, [p], Config(chat_thinking=False, max_new_tokens=8), 512, log=None)
    assert tok.decode(ids[0]).endswith(EMPTY_THINK)  # what the run encodes


def test_the_countdown_recipe_turns_thinking_off():
    cfg = parse_config(["configs/countdown_qwen3.py"])
    assert cfg.chat_thinking is False and cfg.chat_template is True
    assert parse_config(["configs/gsm8k_qwen3.py"]).chat_thinking is True  # its 768 tokens think


class _Tok:
    eos_token_id, pad_token_id = 7, 0


def test_end_ids_read_the_generation_config(tmp_path):
    assert end_ids(_Tok(), str(tmp_path), 7) == [7]  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert end_ids(_Tok(), str(tmp_path), 7) == [7, 9]
    assert end_ids(_Tok(), str(tmp_path), [11, 7]) == [7, 11, 9]  # each once, the tokenizer's first


def test_every_end_id_ends_a_row_as_the_run_builds_the_engine(tmp_path):
    """build_policy reads the model folder's generation_config.json into model.config, and an
    Engine built without eos_ids (as train.py and sparse_rollout.py build theirs) ends a row at the
    tokenizer's EOS and at the generation config's other end id alike."""
    folder = tmp_path / "model"
    tok = build_char_tokenizer(str(folder))  # EOS is id 1
    torch.manual_seed(0)
    Transformer(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, eos_token_id=1)).save_pretrained(str(folder))
    other = tok.convert_tokens_to_ids("~")  # stands in for <|endoftext|>
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, other]}))
    cfg = Config(model=str(folder), task="synthetic", out_dir=str(tmp_path / "run"))
    model, tok = build_policy(cfg, torch.device("cpu"), lambda s: None)
    assert model.config.eos_token_id == [1, other]
    eng = Engine(model, tok, max_new_tokens=4, temperature=1.0)
    force = [[10, 11, other, 12], [10, 1, 12, 13], [10, 11, 12, 13]]
    ro = eng.generate([[5, 6, 7]], 3, seed=0, force=force)
    assert ro.finish == ["eos", "eos", "length"]
    assert ro.mask.sum(1).tolist() == [3, 2, 4]  # the end token is the row's last (trained on)
