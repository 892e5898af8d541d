"""Device discipline in the rollout engine, checked without a GPU: every tensor the engine makes
names its device (the model's, or the host on purpose). With torch's default device set to `meta`
after the model is built, a factory call left to the default makes a meta tensor, which fails as
soon as it meets real data; so generate must run to the end on the CPU, dense, sparse and
speculative, and give the tokens it gives without the trap."""
from types import SimpleNamespace

import pytest
import torch

import heldout
from kvcache import KVPool
from rollout import Engine
from sparsity import dense_alpha, dense_logprobs, fixed_budget, fraction_budget
from test_gpu_engine import heldout_run
from test_rollout import RAGGED, CharTok, tiny_model

CASES = {
    "dense": dict(),
    "dense, free list": dict(num_pages=400),
    "sparse": dict(sparse=fraction_budget(0.5)),
    "sparse quest, rescored": dict(sparse=fixed_budget(3), scorer="quest", rescore_every=2),
    "sparse oracle, recorded": dict(sparse=fraction_budget(0.5), scorer="oracle",
                                    record_pages=True, topk_logprobs=4),
    "speculative": dict(sparse=fraction_budget(0.5), speculative=3, record_pages=True,
                        topk_logprobs=4),
    "speculative, free list": dict(sparse=fraction_budget(0.5), speculative=2, num_pages=400),
    "bf16 pool, split calls": dict(sparse=fraction_budget(0.5), kv_dtype="bfloat16",
                                   pool_tokens=120),
}


@pytest.fixture
def meta_default():
    """torch's default device set to meta for the test's body, restored however it ends."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        # None, not cpu: a default device is a torch-function mode that would stay on and
        # re-enter every torch function in the tests after this one
        torch.set_default_device(None)


def generate(engine, force=None):
    return engine.generate(RAGGED + [[7] * 13], 2, seed=3, force=force)


@pytest.mark.parametrize("case", list(CASES))
def test_generate_names_every_device(case, meta_default):
    torch.set_default_device("cpu")  # the model and the reference, before the trap
    m, tok = tiny_model(seed=1), CharTok()
    kw = dict(max_new_tokens=10, temperature=1.0, page_size=4, dense_layers=1, **CASES[case])
    want = generate(Engine(m, tok, **kw))
    torch.set_default_device("meta")
    assert torch.empty(1).is_meta  # the trap is set
    got = generate(Engine(m, tok, **kw))
    assert not got.tokens.is_meta and torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.logp, want.logp) and got.finish == want.finish
    for f in ("topk_logp", "read_pages"):
        assert (getattr(got, f) is None) == (getattr(want, f) is None)
        assert getattr(got, f) is None or torch.equal(getattr(got, f), getattr(want, f))
    if not kw.get("speculative"):  # teacher-forced decoding, as the dense comparison runs it
        force = [r[k].tolist() for r, k in zip(want.tokens, want.mask)]
        assert torch.equal(generate(Engine(m, tok, **kw), force).logp, want.logp)


def test_moe_generate_names_every_device(meta_default):
    torch.set_default_device("cpu")
    m, tok = tiny_model(moe=True), CharTok()
    kw = dict(max_new_tokens=8, temperature=1.0, page_size=4)
    want = generate(Engine(m, tok, **kw))
    torch.set_default_device("meta")
    got = generate(Engine(m, tok, **kw))
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.experts.completion, want.experts.completion)


def test_heldout_names_every_device(meta_default):
    torch.set_default_device("cpu")
    m, tok = tiny_model(), CharTok()
    cfg = SimpleNamespace(temperature=1.0, max_new_tokens=6, kv_dtype="auto", eval_k_per_bin=0)
    kw = dict(max_new_tokens=6, temperature=0.0, page_size=4, pool_tokens=160)
    want = heldout.evaluate(cfg, heldout_run(Engine(m, tok, **kw), KVPool(160)), k=4)
    torch.set_default_device("meta")
    run = heldout_run(Engine(m, tok, **kw), KVPool(160))
    assert heldout.evaluate(cfg, run, k=4) == want
    assert heldout.evaluate(cfg, run, texts=range(5))[2]  # greedy, with shown completions


def test_the_mismatch_statistic_names_every_device(meta_default):
    """What the loop computes on a sparse rollout beside the engine: alpha against a dense forward
    (sparsity.dense_alpha) and the dense log-probs (sparsity.dense_logprobs)."""
    torch.set_default_device("cpu")
    m, tok = tiny_model(), CharTok()
    ro = generate(Engine(m, tok, max_new_tokens=8, page_size=4, dense_layers=1,
                         sparse=fraction_budget(0.5), topk_logprobs=m.config.vocab_size))
    prompts = RAGGED + [[7] * 13]
    want = dense_alpha(m, prompts, ro, micro_batch=3), dense_logprobs(m, prompts, ro)
    torch.set_default_device("meta")
    got = dense_alpha(m, prompts, ro, micro_batch=3), dense_logprobs(m, prompts, ro)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
