"""The GPU path of the training forwards, checked on the CPU: under autocast every attention call
gets q, k and v in one dtype (the autocast dtype; the flash-attn branch through a stand-in for its
kernel), a masked call repeats the KV heads (SDPA's GQA is the math kernel's alone with a mask),
packed rows build their mask once per forward, the replay of DistillSparse keeps no dense mask per
layer and runs under the run's autocast, the log-prob pass projects onto the vocabulary in chunks,
and autocast never trains or evaluates on stale weights (its cast cache lives until its outermost
context exits)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import config
import model as model_module
import train
import update
from distill import DistillSparse, ReplayCache, replay_logprobs
from model import ModelConfig, Transformer
from tests.test_train import TINY_RUN
from tests.test_update import grouped_batch

V = 101  # a vocabulary no other dimension equals: the tensors of its width are the projection's


def tiny(seed=0, vocab=V, **kw):
    torch.manual_seed(seed)
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, intermediate_size=64)
    return Transformer(ModelConfig(vocab_size=vocab, **{**shape, **kw}))


def bf16():
    return torch.autocast("cpu", torch.bfloat16)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every F.scaled_dot_product_attention call, as (q, k, v dtypes, heads of q and k, mask given,
    enable_gqa)."""
    calls, real = [], F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, **kw):
        calls.append(((q.dtype, k.dtype, v.dtype), (q.shape[1], k.shape[1]), attn_mask is not None,
                      kw.get("enable_gqa", False)))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    return calls


def test_every_attention_call_gets_one_dtype_under_autocast(sdpa_calls):
    """Plain, shared-prompt, packed, MoE and DistillSparse's replay: q, k and v reach attention in
    bf16 under bf16 autocast (flash-attn's varlen takes no fp32 and no mix); a masked call has as
    many KV heads as query heads and no enable_gqa."""
    ids, tmask, _ = grouped_batch()
    m, moe = tiny(vocab=20), tiny(vocab=20, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16)
    read = torch.rand(12, 18, 1, 2, 5, generator=torch.Generator().manual_seed(0)) < 0.5
    plen = (tmask.int().argmax(1) + 1).tolist()
    with bf16():
        for kw in ({}, {"share_prompt": True}, {"packed": True}):
            update.token_logprobs(m, ids, tmask, **kw)[tmask].sum().backward()
        update.token_logprobs(moe, ids, tmask)
        replay_logprobs(m, ids, tmask, read, plen, page_size=4, dense_layers=1)
    assert sdpa_calls and all(d == (torch.bfloat16,) * 3 for d, *_ in sdpa_calls), {
        d for d, *_ in sdpa_calls}
    masked = [(h, gqa) for _, h, has_mask, gqa in sdpa_calls if has_mask]
    assert len(masked) == 2 + 2 + 1  # PromptOnce's rows, packed, the replay's sparse layer
    assert all(hq == hk and not gqa for (hq, hk), gqa in masked)


def test_flash_attn_varlen_gets_one_half_dtype_under_autocast(monkeypatch):
    """The flash-attn branch, taken on the CPU by a stand-in for flash_attn_varlen_func (causal
    attention per packed sequence, as the real one): it gets q, k and v in bf16 under autocast,
    and packed training through it gives the padded forward's log-probs."""
    got = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):  # (total, H, D), as flash-attn's
        got.append((q.dtype, k.dtype, v.dtype))
        assert causal and torch.equal(cu_q, cu_k) and max_q == max_k
        out = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                              v[a:b].transpose(0, 1), is_causal=True,
                                              enable_gqa=True).transpose(0, 1)
               for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
        return torch.cat(out)

    monkeypatch.setattr(model_module, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(model_module, "flash_runs", lambda device, dtype: dtype == torch.bfloat16)
    ids, tmask, _ = grouped_batch()
    m = tiny(vocab=20)
    with bf16():
        packed = update.token_logprobs(m, ids, tmask, packed=True)
        padded = update.token_logprobs(m, ids, tmask)
    assert got and all(d == (torch.bfloat16,) * 3 for d in got), set(got)
    assert (packed - padded).abs().max() < 0.1  # bf16: the same log-probs, to its rounding


def test_distill_sparse_trains_under_the_runs_autocast(sdpa_calls):
    """DistillSparse enters the run's autocast around its replay forwards itself (train.py holds
    no context around the update)."""
    ids, tmask, _ = grouped_batch()
    cfg = config.Config(autocast="bfloat16", distill_r=4, page_size=4, dense_layers=1)
    m = tiny(vocab=20, num_hidden_layers=3)
    ds = DistillSparse.for_run(cfg, m, budget=True, world=1)
    with torch.no_grad():
        dense = update.token_logprobs(m, ids, tmask, full=True)[1]
    read = torch.rand(12, 18, 2, 2, 5, generator=torch.Generator().manual_seed(0)) < 0.5
    sdpa_calls.clear()
    ds.update(ids, tmask, read, torch.tensor((tmask.int().argmax(1) + 1).tolist()), dense)
    assert sdpa_calls and all(d == (torch.bfloat16,) * 3 for d, *_ in sdpa_calls)
    assert not torch.is_autocast_enabled("cpu")  # and leaves it


def test_packed_rows_build_their_mask_once_per_forward(monkeypatch):
    made, real = [], model_module.packed_causal_mask
    monkeypatch.setattr(model_module, "packed_causal_mask", lambda *a: made.append(1) or real(*a))
    ids, tmask, _ = grouped_batch()
    lp = update.token_logprobs(tiny(vocab=20), ids, tmask, packed=True)
    assert len(made) == 1  # not once per layer
    assert (lp - update.token_logprobs(tiny(vocab=20), ids, tmask)).abs().max() < 1e-5


def test_the_replay_keeps_no_dense_mask_per_layer():
    ids, tmask, _ = grouped_batch()
    read = torch.rand(12, 18, 3, 2, 5, generator=torch.Generator().manual_seed(0)) < 0.5
    cache = ReplayCache(read, (tmask.int().argmax(1) + 1).tolist(), 4, dense_layers=1)
    tiny(vocab=20, num_hidden_layers=4)(ids, cache=cache)
    held = [t for t in vars(cache).values() if torch.is_tensor(t)]
    held += [t for d in vars(cache).values() if isinstance(d, dict) for t in d.values()]
    assert sum(t.numel() for t in held) <= read.numel() + 12  # the record and the prompt lengths


def projection_footprint(n_rows, chunk):
    """token_logprobs with gradients over n_rows rows of 40 scored tokens: the most rows one lm_head
    call projects (forward and backward), and the elements of vocabulary-wide tensors (last dim V)
    kept for the backward."""
    m = tiny()
    ids = torch.randint(1, V, (n_rows, 48), generator=torch.Generator().manual_seed(0))
    tmask = torch.zeros(n_rows, 48, dtype=torch.bool)
    tmask[:, 7:47] = True
    widest, kept = [0], [0]
    m.lm_head.register_forward_hook(lambda mod, a, out: widest.append(out.shape[0]))

    def pack(t):
        kept[0] += t.numel() if t.shape[-1:] == (V,) else 0
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = update.token_logprobs(m, ids, tmask, chunk=chunk)
    lp.sum().backward()
    return max(widest), kept[0], lp, [p.grad.clone() for p in m.parameters()]


def test_the_logprob_pass_projects_in_chunks_and_keeps_no_logits_for_the_backward():
    """Past the chunk, neither the largest logits tensor nor what the backward keeps grows with the
    number of scored positions; the log-probs and gradients are those of one projection."""
    widest, kept, lp, grads = projection_footprint(4, chunk=64)  # 160 scored positions
    assert widest <= 64 and kept == 0
    widest, kept, _, _ = projection_footprint(16, chunk=64)  # 640
    assert widest <= 64 and kept == 0
    _, _, lp_one, grads_one = projection_footprint(4, chunk=10**6)  # one projection
    assert (lp - lp_one).abs().max() <= 1e-5
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, grads_one))
    assert config.Config().logp_chunk == 1024


@pytest.fixture
def fresh_forwards(monkeypatch):
    """For each training forward (gradients on) of update.token_logprobs: whether its log-probs
    equal those of a fresh copy of the model's weights at that moment, in the same autocast state
    (the copy's weights are new tensors: autocast has no cached bf16 copy of them)."""
    fresh, real = [], update.token_logprobs

    def check(model, *a, **k):
        lp = real(model, *a, **k)
        if torch.is_grad_enabled():
            with torch.no_grad():
                fresh.append(torch.equal(lp, real(copy.deepcopy(model), *a, **k)))
        return lp

    monkeypatch.setattr(update, "token_logprobs", check)
    return fresh


def test_each_training_forward_sees_the_step_before_it_under_autocast(monkeypatch, fresh_forwards):
    """train_on enters the autocast context around each forward only: with passes=2 the second
    pass runs on the first one's step (its ratio moves), not on autocast's cached bf16 copies of
    the Linear weights from before it."""
    gaps, real = [], update.pg_loss

    def record(logp, old, *a, **k):
        gaps.append((logp - old).abs().max().item())
        return real(logp, old, *a, **k)

    monkeypatch.setattr(update, "pg_loss", record)
    ids, tmask, adv = grouped_batch()
    m = tiny(vocab=20)
    cfg = config.Config(micro_batch=12, passes=2, group_size=4, autocast="bfloat16")
    out = update.train_on(cfg, m, torch.optim.AdamW(m.parameters(), lr=3e-2), ids, tmask, adv,
                          world=1, amp=bf16())
    assert fresh_forwards == [True, True]
    assert len(gaps) == 2 and gaps[0] == 0.0  # the first pass: ratio 1 exactly
    assert gaps[1] > 1e-2 and out["stats"][2] > 0  # the second: moved, and clipped somewhere


def test_the_loop_trains_and_evaluates_on_fresh_weights_under_autocast(tmp_path, monkeypatch,
                                                                       fresh_forwards):
    """train.py under --autocast=bfloat16: every training forward of a batch (passes=2,
    minibatches=2) runs on the weights of the optimizer step before it, and the held-out
    evaluation after a step on the updated weights."""
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)
    evals, real_eval = [], train.during_rl

    def probe(cfg, run, history, rec, last):
        ids = torch.tensor([run.eval_ids[0]])
        with torch.no_grad():
            evals.append(torch.equal(run.model(ids), copy.deepcopy(run.model)(ids)))
        return real_eval(cfg, run, history, rec, last)

    monkeypatch.setattr(train, "during_rl", probe)
    train.main(TINY_RUN + ["--steps=2", "--eval_every=1", "--autocast=bfloat16",
                           f"--out_dir={tmp_path}"])
    assert len(fresh_forwards) >= 8 and all(fresh_forwards)  # 4 optimizer steps a batch
    assert evals == [True, True]
