"""A speculative verify's attention read in blocks of keys, once for all its queries
(zeros_kernels/sparse_decode_cpu.cpp's attend_block, through attend_runs_cpu with tail = T, and
kvcache's lanes) equals plain PyTorch: the kernel against attend_runs_ref, and the cache's verify
on the lanes against its gather reference (verify_ref: each row's cache gathered, SDPA with the
causal verify mask)."""

from types import SimpleNamespace

import pytest
import torch

import lanes as lane_attention
from kvcache import PagedKVCache
from rollout import lane_pages
from zeros_kernels import sparse_decode_cpu as cpu_path


@pytest.fixture
def kernel():
    if cpu_path.cpu_kernel() is None:
        pytest.skip("no C++ kernel here")


def lane_views(B, H, N, D, dtype, gen):
    """K, V (B, H, N, D) strided like the engine's lanes: tokens contiguous, rows and heads not."""
    return [torch.randn(H, B, N + 5, D, generator=gen)[:, :, :N].transpose(0, 1).to(dtype)
            for _ in "kv"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,D", [(1, 32), (2, 32), (4, 32), (2, 128), (4, 64)])
def test_verify_kernel_equals_the_reference(kernel, G, D, dtype):
    """For T = 1 .. 9 new tokens: out and lse within 1e-5 of attend_runs_ref over the same cache
    values (fp32, or bf16 read as fp32), rows of ragged lengths that end anywhere in a block of
    32 keys (the new tokens straddle two blocks in some), and a bf16 cache within bf16's
    tolerance of the fp32 one it was rounded from."""
    gen = torch.Generator().manual_seed(G * D)
    B, H, N = 5, 2, 150
    k32, v32 = lane_views(B, H, N, D, torch.float32, gen)
    k, v = k32.to(dtype), v32.to(dtype)
    lens = torch.tensor([150, 97, 36, 10, 9])  # the last T keys of each row: its new tokens
    for T in range(1, 10):
        q = torch.randn(B, H, G * T, D, generator=gen)
        out, lse = cpu_path.attend_runs_cpu(q, k, v, lens, tail=T)
        want, want_lse = cpu_path.attend_runs_ref(q, k, v, lens, tail=T)
        assert (out - want).abs().max() <= 1e-5, (T, (out - want).abs().max())
        assert (lse - want_lse).abs().max() <= 1e-5, T
        if dtype == torch.bfloat16:
            exact, _ = cpu_path.attend_runs_ref(q, k32, v32, lens, tail=T)
            assert (out - exact).abs().max() <= 3e-2, T


def test_many_queries_go_in_passes(kernel):
    """More queries than a pass holds (a shared prompt's rows side by side: 8 rows x 2 heads x
    9 tokens = 144), tail 1: every query sees every key; a row with no key gives zeros and lse
    -inf. And with BLOCKS off a verify is refused (None: the caller's two-part path)."""
    gen = torch.Generator().manual_seed(1)
    k, v = lane_views(3, 2, 70, 32, torch.float32, gen)
    q, lens = torch.randn(3, 2, 144, 32, generator=gen), torch.tensor([70, 41, 0])
    out, lse = cpu_path.attend_runs_cpu(q, k, v, lens)
    want, want_lse = cpu_path.attend_runs_ref(q, k, v, lens)
    assert (out - want).abs().max() <= 1e-5 and (lse[:2] - want_lse[:2]).abs().max() <= 1e-5
    assert (out[2] == 0).all() and torch.isinf(lse[2]).all() and (lse[2] < 0).all()
    cpu_path.BLOCKS = False
    try:
        assert cpu_path.attend_runs_cpu(q[:, :, :18], k, v, lens + 9, tail=9) is None
    finally:
        cpu_path.BLOCKS = True


def lanes_cache(groups, G, D, dtype, ref, page_size=4):
    """A one-layer lanes cache of the prompt groups [(length, rows)] with 2 KV heads, prefilled
    with random K and V (the same for every call), then 3 decode steps, row 1 released after the
    first (the last row moves into its lane). ref: the verify through the gather reference."""
    N = sum(len(rows) for _, rows in groups)
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=2, head_dim=D,
                          num_attention_heads=2 * G)
    lanes = lane_pages([(n, len(rows)) for n, rows in groups], page_size, 16)
    cache = PagedKVCache(cfg, N, -(-(max(n for n, _ in groups) + 16) // page_size),
                         lanes[0] * lanes[1] + N * lanes[2], page_size, dtype, "cpu", lanes=lanes)
    cache.verify_ref = ref
    gen = torch.Generator().manual_seed(0)
    L = max(n for n, _ in groups)
    cache.begin_prefill(groups)
    q, k, v = (torch.randn(len(groups), h, L, D, generator=gen) for h in (2 * G, 2, 2))
    cache.attend(0, q, k, v)
    live = list(range(N))
    for step in range(3):
        if step == 1:
            cache.release(1)
            live.remove(1)
        cache.begin_decode(live)
        q, k, v = (torch.randn(len(live), h, 1, D, generator=gen) for h in (2 * G, 2, 2))
        cache.attend(0, q, k, v)
        cache.advance(1)
    return cache, live


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_verify_on_the_lanes_equals_the_gather_reference(kernel, monkeypatch, G, dtype, tol):
    """The cache's verify, T = 1 .. 9 new tokens a row, through the kernel's blocks (the row's
    lane read once, its new tokens causal), equals the gather reference: rows with a shared
    prompt (5 full pages, 2, none) and without, partial last pages, ragged lengths, a row moved
    between lanes; within 1e-5 in fp32 and bf16's tolerance in a bf16 pool (the fast path rounds
    the queries to the pool's dtype, the reference does not). The pools stay equal; and the
    two-part path the blocks replaced (BLOCKS off) still agrees."""
    calls = []  # (tail, whether the kernel answered) of each call from the cache

    def spy(*a, **kw):
        out = cpu_path.attend_runs_cpu(*a, **kw)
        calls.append((kw.get("tail", 1), out is not None))
        return out
    monkeypatch.setattr(lane_attention, "attend_runs_cpu", spy)
    groups = [(22, [0, 1, 2]), (9, [3, 4]), (7, [5]), (3, [6, 7])]
    (fast, live), (ref, _) = (lanes_cache(groups, G, 32, dtype, r) for r in (False, True))
    gen = torch.Generator().manual_seed(G)
    for blocks in (True, False):
        monkeypatch.setattr(cpu_path, "BLOCKS", blocks)
        for T in range(1, 10):
            q, k, v = (torch.randn(len(live), h, T, 32, generator=gen) for h in (2 * G, 2, 2))
            fast.begin_verify(live, T), ref.begin_verify(live, T)
            calls.clear()
            y, y_ref = (c.attend(0, q, k, v) for c in (fast, ref))
            assert fast._slots is None and ref._slots is not None  # the two paths ran
            assert calls == [(T, blocks or T == 1)]  # the blocks, or (refused) the two parts
            assert (y - y_ref).abs().max() <= tol, (blocks, T, (y - y_ref).abs().max())
            assert torch.equal(fast.k, ref.k) and torch.equal(fast.v, ref.v)


def test_a_build_of_another_version_is_refused(monkeypatch):
    """torch's build cache is named by the kernel, so a checkout with an older sparse_decode_cpu.cpp
    can leave its build for this one to load: cpu_kernel refuses it (the PyTorch paths run)
    rather than call an interface it does not have."""
    old = SimpleNamespace(__file__="old.so")  # before `version`: version 1
    monkeypatch.setattr(cpu_path, "load_cpu_ext", lambda name: old)
    with pytest.warns(UserWarning, match="another version"):
        assert cpu_path.cpu_kernel() is None
    old.version = cpu_path.KERNEL_VERSION
    assert cpu_path.cpu_kernel() is old


@pytest.mark.parametrize("D", [32, 64, 128])
def test_a_decode_lane_takes_its_path_and_equals_the_reference(kernel, D, monkeypatch):
    """A decode step (tail 1, G queries) takes run_path's choice at any length: attend_few (the
    keys across the lanes) at head dim 32 (any, where a vector holds 8 floats), else the one-pass
    kernel; with FEW off, a lane of DECODE_BLOCKS_FROM keys or more takes the block kernel and a
    shorter one the one-pass kernel (the rule before). Each within 1e-5 of attend_runs_ref, rows
    of ragged lengths (partial blocks of keys, a row of 7)."""
    ext, seen = cpu_path.cpu_kernel(), []
    spy = SimpleNamespace(version=ext.version, lanes=ext.lanes,
                          attend_runs=lambda *a: seen.append(a[-1])
                          or ext.attend_runs(*a))
    monkeypatch.setattr(cpu_path, "cpu_kernel", lambda: spy)
    gen = torch.Generator().manual_seed(D)
    B, H, G = 3, 2, 2
    for few in (True, False):
        monkeypatch.setattr(cpu_path, "FEW", few)
        for N in (cpu_path.DECODE_BLOCKS_FROM - 40, cpu_path.DECODE_BLOCKS_FROM + 40):
            k, v = lane_views(B, H, N, D, torch.float32, gen)
            q = torch.randn(B, H, G, D, generator=gen)
            lens = torch.tensor([N, N - 33, 7])
            out, lse = cpu_path.attend_runs_cpu(q, k, v, lens)
            ref_out, ref_lse = cpu_path.attend_runs_ref(q, k, v, lens)
            assert (out - ref_out).abs().max() <= 1e-5 and (lse - ref_lse).abs().max() <= 1e-5
    few = cpu_path.FEW_PATH if D == 32 or ext.lanes < 16 else cpu_path.ONLINE  # AVX-512: Online
    blocks, online = cpu_path.BLOCK_PATH, cpu_path.ONLINE
    assert seen == [few, few, online, blocks]
