"""bench rollout's rows against vLLM, with vllm replaced by a recording fake that serves the saved
folder through transformers: the arguments the bench builds (the engine's HF folder, no
tokenizer, the same prompt ids, greedy, EOS ignored, the same lengths, compiled and eager on the
CPU), the row-by-row agreement it reports, and the "not installed" row without vllm."""
import importlib.machinery
import json
import os
import sys
import types

import pytest
import torch

import bench.rollout as br
from model import ModelConfig, Transformer

SIZES = [(6, 2), (5, 3)]


def fake_vllm(calls):
    """vllm's LLM, SamplingParams and inputs.TokensPrompt, as the bench uses them; LLM.generate is
    transformers' greedy generate on the folder it was given."""
    from transformers import AutoModelForCausalLM
    mod, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    mod.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    mod.__version__, mod.inputs = "0.0-fake", inputs
    inputs.TokensPrompt = dict  # a TypedDict in vllm

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)
            calls.append(("params", kw))

    class LLM:
        def __init__(self, **kw):
            calls.append(("llm", kw))
            with open(os.path.join(kw["model"], "config.json")) as f:
                assert json.load(f)["architectures"] == ["Qwen3ForCausalLM"]
            self.hf = AutoModelForCausalLM.from_pretrained(kw["model"], dtype=torch.float32)

        @torch.no_grad()
        def generate(self, prompts, params, use_tqdm=True):
            calls.append(("generate", [p["prompt_token_ids"] for p in prompts], params))
            ids = torch.tensor([p["prompt_token_ids"] for p in prompts])
            out = self.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   max_new_tokens=params.max_tokens, do_sample=False,
                                   min_new_tokens=params.max_tokens, eos_token_id=None,
                                   pad_token_id=0)[:, ids.shape[1]:]
            done = types.SimpleNamespace
            return [done(outputs=[done(token_ids=tuple(r.tolist()))]) for r in out]

    mod.LLM, mod.SamplingParams = LLM, SamplingParams
    return mod, inputs


def tiny_model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64)).eval()


def test_without_vllm_the_row_says_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    rows = br.rollout_vs_vllm(tiny_model(), SIZES, prompt_len=4, hw="cpu", cmd="c")
    assert len(rows) == 1 and "not installed" in rows[0] and rows[0].count("|") == 8


def test_vllm_gets_the_engines_folder_prompts_and_lengths_and_rows_compare(monkeypatch):
    calls = []
    mod, inputs = fake_vllm(calls)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    model = tiny_model()
    rows = br.rollout_vs_vllm(model, SIZES, prompt_len=4, hw="cpu", cmd="c")
    llms = [c[1] for c in calls if c[0] == "llm"]
    assert [kw["enforce_eager"] for kw in llms] == [False, True]  # compiled, then eager
    for kw in llms:
        assert kw["skip_tokenizer_init"] and kw["dtype"] == "float32"
        assert kw["max_model_len"] == 4 + 6 and kw["max_num_seqs"] == 3
    timed = [c for c in calls if c[0] == "generate" and c[2].max_tokens != 8]  # not the warm-up
    assert {(len(c[1]), c[2].max_tokens) for c in timed} == {(2, 6), (3, 5)}
    for _, prompts, p in timed:  # the prompt ids (a) gives our engine; greedy, EOS ignored
        assert prompts == br.prompt_ids(model, len(prompts), 4).tolist()
        assert p.temperature == 0.0 and p.ignore_eos and p.min_tokens == p.max_tokens
    assert len(rows) == 4 and all("identical greedy tokens in all" in r for r in rows)
    assert [r.split("vs vLLM 0.0-fake ")[1].split(",")[0] for r in rows] == ["compiled"] * 2 + [
        "eager"] * 2
    assert all(">= 1.2x" in r for r in rows[:2])
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in this process
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(
        map(str, sorted(os.sched_getaffinity(0))[:torch.get_num_threads()]))


def test_rows_are_compared_one_by_one():
    a = torch.arange(12).view(3, 4)
    assert br.same_rows(a, a.clone()) == "identical greedy tokens in all 3 rows"
    b = a.clone()
    b[1, 2] = -1
    assert br.same_rows(a, b) == "identical greedy tokens in 2 of 3 rows; row 1 parts at token 2"


def test_a_mode_that_does_not_start_is_a_row_not_a_crash(monkeypatch):
    calls = []
    mod, inputs = fake_vllm(calls)

    def refuse(**kw):
        raise RuntimeError("no CPU backend for this build\nmore")
    mod.LLM = refuse
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    rows = br.rollout_vs_vllm(tiny_model(), SIZES, prompt_len=4, hw="cpu", cmd="c")
    assert len(rows) == 2 and all("did not start (RuntimeError: no CPU backend for this build)" in r
                                  for r in rows)
