"""The one-call paths of a CPU decode step (lanes.py) against their references: the lanes read
from the pool's offsets (sparse_decode_cpu.attend_lanes_cpu) against the views' path, and the new
tokens' K and V written in one call (write_tokens_cpu) against index_copy_; and the engine's
greedy decode with both against the views' path."""

import pytest
import torch

import kvcache
from bench.common import _Ids
from bench.sparsepath import model
from rollout import Engine
from zeros_kernels import sparse_decode_cpu as cpu_path


@pytest.fixture
def kernel():
    if cpu_path.cpu_kernel() is None:
        pytest.skip("no C++ kernel here")


@pytest.mark.parametrize("G,D,T", [(1, 32, 40), (2, 32, 600), (4, 64, 37), (2, 128, 9)])
def test_attend_lanes_equals_the_reference(kernel, G, D, T):
    """Rows of lanes of `size` slots from `first` in layer 1 of a 3-layer pool, ragged lengths
    (one row with no key), short lanes (one pass) and long ones (blocks): within 1e-5 of
    attend_runs_ref over the same lanes cut out as views; a row with no key gives zeros."""
    gen = torch.Generator().manual_seed(G * D + T)
    L, H, B, size, first = 3, 2, 4, T + 7, 11
    N = first + B * size + 5
    kp, vp = (torch.randn(L, H, N, D, generator=gen) for _ in "kv")
    q = torch.randn(B, H * G, 1, D, generator=gen)
    lens = torch.tensor([T, T - 3, 0, 1])
    out = cpu_path.attend_lanes_cpu(q, kp, vp, 1, first, size, T, lens)
    run = lambda p: p[1, :, first:first + B * size].view(H, B, size, D)[:, :, :T].transpose(0, 1)
    want, _ = cpu_path.attend_runs_ref(q.view(B, H, G, D), run(kp), run(vp), lens)
    assert out.shape == q.shape
    assert (out.view(B, H, G, D) - want).abs().max() <= 1e-5
    assert (out[2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
def test_write_tokens_equals_index_copy(kernel, dtype, T):
    """Token t of row b into slot dst[b * T + t] of every head of one layer, from k and v with
    the strides the model gives them (a transposed view), in the pool's dtype: the same pools
    as kvcache's index_copy_ of the (H, B * T, D) tokens; other layers untouched."""
    gen = torch.Generator().manual_seed(T)
    L, H, N, D, B = 2, 2, 64, 32, 3
    pools = [torch.randn(L, H, N, D, generator=gen).to(dtype) for _ in "kv"]
    ref = [p.clone() for p in pools]
    k, v = (torch.randn(B, T, H, D, generator=gen).transpose(1, 2) for _ in "kv")
    dst = torch.randperm(N, generator=gen)[:B * T]
    assert cpu_path.write_tokens_cpu(*pools, 1, k, v, dst)
    for p, x in zip(ref, (k, v)):
        p[1].index_copy_(1, dst, x.transpose(0, 1).reshape(H, B * T, D).to(dtype))
    assert all(torch.equal(a, b) for a, b in zip(pools, ref))
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_path.write_tokens_cpu(*pools, 1, k, v, torch.full((B * T,), N))


@pytest.mark.parametrize("step", ["fused", "eager"])
def test_decode_on_the_lanes_equals_the_views(kernel, monkeypatch, step):
    """The engine's greedy decode, rows with their own prompts of ragged lengths (lanes read in
    one pass and in blocks) and a group of 2 (its shared prompt: the views' path): the same
    tokens and log-probs within 1e-5 as with every step on the views (lanes_fast off) and
    index_copy_; and the one-call path was taken."""
    m = model()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (600, 70, 30, 530)]
    calls = []
    spy = lambda *a: calls.append(1) or cpu_path.attend_lanes_cpu(*a)
    monkeypatch.setattr("lanes.attend_lanes_cpu", spy)
    runs = []
    for fast, G in ((True, 1), (False, 1), (True, 2), (False, 2)):
        init = kvcache.PagedKVCache.__init__
        monkeypatch.setattr(kvcache.PagedKVCache, "__init__", lambda self, *a, **kw: (
            init(self, *a, **kw), setattr(self, "lanes_fast", fast))[0])
        if not fast:  # and the K/V write through index_copy_
            monkeypatch.setattr(kvcache, "write_tokens_cpu", lambda *a: False)
        eng = Engine(m, _Ids(), max_new_tokens=24, temperature=0.0, page_size=16, eos_ids=[-1],
                     dense_layers=0, step=step)
        with torch.no_grad():
            runs.append(eng.generate(prompts, G, seed=0))
        monkeypatch.undo()
        monkeypatch.setattr("lanes.attend_lanes_cpu", spy)
    assert calls
    for a, b in (runs[:2], runs[2:]):
        assert torch.equal(a.tokens, b.tokens)
        assert (a.logp - b.logp).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,D", [(1, 32), (2, 32), (3, 64), (4, 128), (2, 128)])
def test_the_few_path_equals_the_reference(kernel, M, D, dtype):
    """The kernel's keys-across-the-lanes path (Few), called directly whatever run_path picks on
    this CPU: within 1e-5 of attend_runs_ref (out and log-sum-exp) over rows whose lengths end
    anywhere in a block of 16 keys, one row of a single key and one with none (zeros, -inf)."""
    gen = torch.Generator().manual_seed(M * D)
    B, H, T = 5, 2, 83
    k, v = (torch.randn(H, B, T + 4, D, generator=gen).to(dtype)[:, :, :T].transpose(0, 1)
            for _ in "kv")
    q = torch.randn(B, H, M, D, generator=gen)
    lens = torch.tensor([83, 50, 17, 1, 0], dtype=torch.int32)
    out, lse = cpu_path.cpu_kernel().attend_runs(q, k, v, lens, D ** -0.5, 1, cpu_path.FEW_PATH)
    want, want_lse = cpu_path.attend_runs_ref(q, k, v, lens)
    assert (out - want).abs().max() <= 1e-5
    assert (lse[:4] - want_lse[:4]).abs().max() <= 1e-5
    assert (out[4] == 0).all() and torch.isinf(lse[4]).all() and (lse[4] < 0).all()
