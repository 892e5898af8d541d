"""The block-sparse decode kernel against its PyTorch reference, and the reference against SDPA.

Without a GPU the kernel runs through Triton's interpreter, which must be switched on before the
kernel module is imported (Triton reads the flag when it decorates a kernel). Shapes stay tiny: the
interpreter runs every program in numpy.
"""
import os

# before the kernel module is imported; a caller may set it to 0 to compile for a real GPU
os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F

import zeros_kernels.block_sparse_decode as bsd
import zeros_kernels.sparse_decode_cpu as cpu_path

if bsd._INTERPRET != (os.environ["TRITON_INTERPRET"] == "1"):
    # imported earlier under the other mode
    bsd = importlib.reload(bsd)

from zeros_kernels.block_sparse_decode import (block_sparse_decode, block_sparse_decode_ref,
                                         decode_attention, dense_selection, default_num_splits)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_case(seq_lens, H_kv=2, G=2, D=64, page_size=16, dtype=torch.float32, sparse=False,
              past_end=False, seed=0):
    """A paged cache for sequences of the given lengths, with shuffled physical pages, a selection
    per (sequence, KV head) in random order, and traps: NaN in every slot that must not be read
    (spare pages, the tail of partial pages), -1 in unused page-table entries, junk in the padding
    of sel."""
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    n_pages = [-(-n // page_size) for n in seq_lens]  # pages each sequence uses
    max_pages = max(n_pages) + 1  # one more column than needed: entries that must not be read
    num_pages = sum(n_pages) + 3  # spare physical pages, never referenced
    perm = torch.randperm(num_pages, generator=gen)
    page_table = torch.full((B, max_pages), -1, dtype=torch.int32)
    k_cache = torch.full((num_pages, page_size, H_kv, D), float("nan"))
    v_cache = torch.full((num_pages, page_size, H_kv, D), float("nan"))
    k_dense = torch.randn(B, H_kv, max(seq_lens + [1]), D, generator=gen)  # (B, H_kv, T, D) unpaged
    v_dense = torch.randn(B, H_kv, max(seq_lens + [1]), D, generator=gen)
    used = 0
    for b, n in enumerate(seq_lens):
        for j in range(n_pages[b]):
            phys = int(perm[used]); used += 1
            page_table[b, j] = phys
            t0, t1 = j * page_size, min((j + 1) * page_size, n)
            k_cache[phys, :t1 - t0] = k_dense[b, :, t0:t1].transpose(0, 1)
            v_cache[phys, :t1 - t0] = v_dense[b, :, t0:t1].transpose(0, 1)

    max_sel = max_pages + 2
    # junk padding
    sel = torch.randint(-7, 1000, (B, H_kv, max_sel), generator=gen, dtype=torch.int32)
    n_sel = torch.zeros(B, H_kv, dtype=torch.int32)
    for b in range(B):
        for h in range(H_kv):
            pages = torch.randperm(n_pages[b], generator=gen)
            if sparse and n_pages[b] > 1:
                pages = pages[:int(torch.randint(1, n_pages[b], (1,), generator=gen))]
            if past_end:  # a page at the end of the table: no tokens, table entry -1
                pages = torch.cat([pages, torch.tensor([max_pages - 1])])[
                    torch.randperm(len(pages) + 1, generator=gen)]
            sel[b, h, :len(pages)] = pages
            n_sel[b, h] = len(pages)

    q = torch.randn(B, G * H_kv, D, generator=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, seq_lens=seq_lens,
                sel=sel, n_sel=n_sel)
    case = {k: v.to(dtype) if v.is_floating_point() else v for k, v in case.items()}
    return case, k_dense, v_dense


def assert_close(out, ref, dtype):
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == ref.dtype
    assert not out.isnan().any(), "NaN in the output: a masked slot was read"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= atol, f"max abs error {err} > {atol}"


# -----------------------------------------------------------------------------
# the reference proves itself against dense attention


@pytest.mark.parametrize("G,D", [(1, 64), (2, 128), (4, 64), (8, 128)])
def test_reference_full_selection_equals_sdpa(G, D):
    seq_lens = [37, 16, 1, 50]  # ragged, a full page, one token, partial pages
    case, k_dense, v_dense = make_case(seq_lens, H_kv=2, G=G, D=D, seed=G)
    sel, n_sel = dense_selection(case["page_table"], case["seq_lens"], 2, 16)
    out = block_sparse_decode_ref(**{**case, "sel": sel, "n_sel": n_sel})
    T = k_dense.shape[2]
    mask = (torch.arange(T) < case["seq_lens"][:, None])[:, None, None, :]  # (B, 1, 1, T)
    k = k_dense.repeat_interleave(G, 1)  # (B, H_q, T, D)
    v = v_dense.repeat_interleave(G, 1)
    want = F.scaled_dot_product_attention(case["q"][:, :, None], k, v, attn_mask=mask)[:, :, 0]
    assert_close(out, want, torch.float32)


def test_reference_sparse_equals_sdpa_on_selected_tokens():
    """With a sparse selection the reference is dense attention restricted to the selected pages."""
    case, k_dense, v_dense = make_case([45, 29], H_kv=2, G=2, D=64, sparse=True, past_end=True,
                                       seed=3)
    out = block_sparse_decode_ref(**case)
    T = k_dense.shape[2]
    page_of = torch.arange(T) // 16
    for b in range(2):
        for h in range(2):
            chosen = case["sel"][b, h, :case["n_sel"][b, h]].long()
            keep = torch.isin(page_of, chosen) & (torch.arange(T) < case["seq_lens"][b])
            q = case["q"][b, 2 * h:2 * h + 2, None]  # (G, 1, D)
            k, v = k_dense[b, h, keep][None], v_dense[b, h, keep][None]
            want = F.scaled_dot_product_attention(q, k.expand(2, -1, -1), v.expand(2, -1, -1))[:, 0]
            assert_close(out[b, 2 * h:2 * h + 2], want, torch.float32)


# -----------------------------------------------------------------------------
# the kernel equals the reference


@pytest.mark.parametrize("G", [1, 2, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
def test_kernel_gqa_and_head_dim(G, D):
    case, _, _ = make_case([40, 7, 23], H_kv=2, G=G, D=D, sparse=True, seed=10 * G + D)
    assert_close(block_sparse_decode(**case), block_sparse_decode_ref(**case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True])
def test_kernel_full_and_sparse_selection(dtype, sparse):
    case, _, _ = make_case([57, 33, 16], H_kv=2, G=4, D=128, dtype=dtype, sparse=sparse, seed=5)
    assert_close(block_sparse_decode(**case), block_sparse_decode_ref(**case), dtype)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_split_path(num_splits, dtype):
    # 7 and 5 pages do not divide by 2 or 3; the 1-page sequence leaves some splits empty
    case, _, _ = make_case([110, 70, 9], H_kv=2, G=2, D=64, dtype=dtype, seed=num_splits)
    want = block_sparse_decode_ref(**case)
    assert_close(block_sparse_decode(**case, num_splits=num_splits), want, dtype)


def test_kernel_more_splits_than_pages():
    case, _, _ = make_case([20, 3], H_kv=1, G=4, D=64, sparse=True, seed=1)
    assert_close(block_sparse_decode(**case, num_splits=5), block_sparse_decode_ref(**case),
                 torch.float32)


@pytest.mark.parametrize("page_size,tile", [(8, 32), (16, 16), (16, 64), (64, 32)])
def test_kernel_page_and_tile_sizes(page_size, tile, monkeypatch):
    """Several pages per tile, exactly one, and a page split over two tiles."""
    monkeypatch.setitem(bsd.FP32_CONFIG, "tile_tokens", tile)
    case, _, _ = make_case([100, 61], H_kv=2, G=2, D=64, page_size=page_size, sparse=True,
                           seed=page_size)
    assert_close(block_sparse_decode(**case), block_sparse_decode_ref(**case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_one_page_only(dtype):
    case, _, _ = make_case([5, 16, 1], H_kv=2, G=8, D=128, dtype=dtype, seed=2)
    assert_close(block_sparse_decode(**case), block_sparse_decode_ref(**case), dtype)


def test_kernel_strided_inputs():
    """K and V as views into one fused cache, q a slice of a wider tensor."""
    case, _, _ = make_case([50, 19], H_kv=2, G=4, D=64, seed=4)
    kv = torch.stack([case["k_cache"], case["v_cache"]], 2)  # (num_pages, page_size, 2, H_kv, D)
    q_wide = torch.cat([case["q"], torch.randn_like(case["q"])], -1)  # (B, H_q, 2 * D)
    strided = {**case, "k_cache": kv[:, :, 0], "v_cache": kv[:, :, 1], "q": q_wide[..., :64]}
    assert not strided["k_cache"].is_contiguous() and not strided["q"].is_contiguous()
    assert_close(block_sparse_decode(**strided), block_sparse_decode_ref(**case), torch.float32)


# -----------------------------------------------------------------------------
# edge cases of the contract


def test_pages_past_the_end_contribute_nothing():
    case, _, _ = make_case([45, 29], H_kv=2, G=2, D=64, sparse=True, past_end=True, seed=6)
    without = {**case, "sel": case["sel"].clone(), "n_sel": case["n_sel"].clone()}
    for b in range(2):
        for h in range(2):
            chosen = [p for p in case["sel"][b, h, :case["n_sel"][b, h]].tolist()
                      if p * 16 < case["seq_lens"][b]]
            without["sel"][b, h, :len(chosen)] = torch.tensor(chosen)
            without["n_sel"][b, h] = len(chosen)
    assert (without["n_sel"] < case["n_sel"]).all()
    want = block_sparse_decode_ref(**without)
    assert_close(block_sparse_decode_ref(**case), want, torch.float32)
    assert_close(block_sparse_decode(**case), want, torch.float32)


def test_selection_order_does_not_matter():
    case, _, _ = make_case([80, 41], H_kv=2, G=2, D=64, sparse=True, seed=7)
    flipped = {**case, "sel": case["sel"].clone()}
    for b in range(2):
        for h in range(2):
            n = int(case["n_sel"][b, h])
            flipped["sel"][b, h, :n] = case["sel"][b, h, :n].flip(0)
    want = block_sparse_decode_ref(**case)
    assert_close(block_sparse_decode_ref(**flipped), want, torch.float32)
    assert_close(block_sparse_decode(**flipped, num_splits=2), want, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_empty_sequence_and_empty_selection_give_zeros(num_splits):
    case, _, _ = make_case([0, 30, 30], H_kv=2, G=2, D=64, seed=8)
    case["n_sel"][2, 1] = 0  # one head of one sequence reads nothing
    for fn in (block_sparse_decode_ref,
               lambda **c: block_sparse_decode(**c, num_splits=num_splits)):
        out = fn(**case)
        assert (out[0] == 0).all() and (out[2, 2:4] == 0).all()
        assert (out[1] != 0).any() and (out[2, 0:2] != 0).any()
    assert_close(block_sparse_decode(**case, num_splits=num_splits),
                 block_sparse_decode_ref(**case), torch.float32)


def test_decode_attention_dispatch_and_dense_default():
    case, k_dense, v_dense = make_case([33, 12], H_kv=1, G=4, D=64, seed=9)
    dense = {k: v for k, v in case.items() if k not in ("sel", "n_sel")}
    via_ref = decode_attention(**dense)  # CPU tensors: the reference, every page
    via_kernel = decode_attention(**dense, use_triton=True)
    assert_close(via_kernel, via_ref, torch.float32)
    sel, n_sel = dense_selection(case["page_table"], case["seq_lens"], 1, 16)
    assert_close(via_ref, block_sparse_decode_ref(**dense, sel=sel, n_sel=n_sel), torch.float32)
    assert default_num_splits(2, 1, 8, "cpu") == 1


def test_custom_scale():
    case, _, _ = make_case([40], H_kv=1, G=2, D=64, sparse=True, seed=11)
    out = block_sparse_decode(**case, scale=0.3)
    assert_close(out, block_sparse_decode_ref(**case, scale=0.3), torch.float32)
    assert (out - block_sparse_decode_ref(**case)).abs().max() > 1e-3


# -----------------------------------------------------------------------------
# the real GPU compiler (the interpreter accepts shapes that it rejects). Every configuration the
# wrapper launches is compiled for sm_80 and sm_90 without a GPU in tests/test_kernel_compile.py


def _run_without_interpreter(script):
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_gpu():
    """The compiled kernel on a real GPU, in a process without the interpreter."""
    _run_without_interpreter("""
        import torch
        import tests.test_kernel as t
        from zeros_kernels.block_sparse_decode import block_sparse_decode, block_sparse_decode_ref
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for G, D, page, splits in [(1, 64, 16, None), (2, 128, 16, 1), (4, 128, 64, 3),
                                       (8, 64, 16, 2)]:
                case, _, _ = t.make_case([300, 17, 129, 64], H_kv=2, G=G, D=D, page_size=page,
                                         dtype=dtype, sparse=G % 2 == 0, past_end=True, seed=G)
                case = {k: v.cuda() for k, v in case.items()}
                out = block_sparse_decode(**case, num_splits=splits)
                ref = block_sparse_decode_ref(**case)
                atol = 1e-4 if dtype == torch.float32 else 2e-2  # exp2 is approximate on the GPU
                err = (out.float() - ref.float()).abs().max().item()
                assert err <= atol and not out.isnan().any(), (dtype, G, D, page, splits, err)
    """)


@pytest.mark.parametrize("H_kv,G", [(2, 1), (2, 4), (1, 8)])
def test_cpu_dense_path_equals_the_reference(H_kv, G):
    """decode_attention's CPU dense path (one gather, fused SDPA) against the reference reading
    every page: GQA groups, ragged lengths, a partial last page, an empty sequence, NaN traps in the
    slots it must not read."""
    case, _, _ = make_case([0, 1, 17, 40], H_kv=H_kv, G=G, D=64, seed=13)
    dense = {k: v for k, v in case.items() if k not in ("sel", "n_sel")}
    sel, n_sel = dense_selection(case["page_table"], case["seq_lens"], H_kv, 16)
    want = block_sparse_decode_ref(**dense, sel=sel, n_sel=n_sel)
    got = bsd.dense_decode_ref(case["q"], case["k_cache"], case["v_cache"],
                               *bsd.dense_slots(case["page_table"], case["seq_lens"], 16))
    assert torch.isfinite(got).all() and (got[0] == 0).all()
    assert_close(got, want, torch.float32)


def head_major(cache):
    """The same cache stored head-major, (H_kv, num_pages, page_size, D) in memory, shown in the
    contract's (num_pages, page_size, H_kv, D) shape: the rollout engine's layout."""
    return cache.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


@pytest.mark.parametrize("sparse", [False, True])
def test_head_major_cache_reads_the_same(sparse):
    """Every reader takes any strides: the reference, the CPU dense path and the kernel give on a
    head-major cache what they give on the token-major one."""
    case, _, _ = make_case([0, 5, 33, 48], H_kv=2, G=3, D=64, sparse=sparse, seed=21)
    hm = {**case, "k_cache": head_major(case["k_cache"]), "v_cache": head_major(case["v_cache"])}
    assert not hm["k_cache"].is_contiguous()
    want = block_sparse_decode_ref(**case)
    assert torch.equal(block_sparse_decode_ref(**hm), want)
    assert_close(block_sparse_decode(**hm), want, torch.float32)
    if not sparse:
        slots = bsd.dense_slots(case["page_table"], case["seq_lens"], 16)
        assert_close(bsd.dense_decode_ref(hm["q"], hm["k_cache"], hm["v_cache"], *slots), want,
                     torch.float32)


@pytest.mark.parametrize("path", ["cpp", "sdpa"])
def test_attend_rows_over_views_and_merged_by_lse(path, monkeypatch):
    """attend_rows on strided views with per-row lengths (the C++ kernel, and SDPA with a length
    mask) equals SDPA on the cut copies, and its log-sum-exp is the scores'; attention over two
    disjoint key sets, merged by log-sum-exp, equals attention over both; a side with lse -inf
    merges as if absent."""
    if path == "sdpa":
        monkeypatch.setattr(bsd, "attend_runs_cpu", lambda *a, **kw: None)
    gen = torch.Generator().manual_seed(3)
    B, H, M, D, T = 3, 2, 4, 32, 24
    # head-major rows with spare slots: (B, H, T, D) views, tokens contiguous, rows and heads not
    k, v = (torch.randn(H, B, T + 5, D, generator=gen)[:, :, :T].transpose(0, 1) for _ in "kv")
    q = torch.randn(B, H, M, D, generator=gen)
    lens = torch.tensor([24, 9, 1])
    out, lse = bsd.attend_rows(q, k, v, lens, lse=True)
    for b in range(B):
        n = int(lens[b])
        want = F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        assert (out[b] - want[0]).abs().max() <= 1e-5
        s = (q[b] @ k[b, :, :n].transpose(-1, -2)) * D ** -0.5
        assert (lse[b] - torch.logsumexp(s, -1)).abs().max() <= 1e-5
    assert (bsd.attend_rows(q, k, v, lens) - out).abs().max() <= 1e-6  # without the lse
    # the 24 keys split at 10: the two halves merged = the whole
    a, la = bsd.attend_rows(q, k[:, :, :10], v[:, :, :10], None, lse=True)
    b_, lb = bsd.attend_rows(q, k[:, :, 10:], v[:, :, 10:], None, lse=True)
    full = F.scaled_dot_product_attention(q, k, v)
    assert (bsd.merge_attention(a, la, b_, lb) - full).abs().max() <= 1e-5
    none = torch.full_like(lb, float("-inf"))
    assert (bsd.merge_attention(a, la, b_, none) - a).abs().max() <= 1e-6


def test_shared_prefix_decode_equals_attention_over_prefix_and_own_keys():
    """Rows 0, 1, 3 share prompt slot 0 (6 tokens), row 2 has none, row 4 shares slot 1 (4
    tokens): each slot read once with its rows' queries side by side, merged with the rows' own
    keys, equals attention over prompt + own keys row by row."""
    gen = torch.Generator().manual_seed(5)
    B, H, G, D = 5, 2, 3, 16
    q = torch.randn(B, H, G, D, generator=gen)
    k, v = torch.randn(B, H, 7, D, generator=gen), torch.randn(B, H, 7, D, generator=gen)
    lens = torch.tensor([7, 3, 5, 1, 2])
    kp, vp = torch.randn(2, H, 6, D, generator=gen), torch.randn(2, H, 6, D, generator=gen)
    slot_of = [0, 0, -1, 0, 1]
    pre = bsd.prefix_index(slot_of, [6, 4], "cpu")
    assert pre[0] == 6 and pre[2].numel() == 2 * 3  # two slots of up to three rows
    got = bsd.shared_prefix_decode(q, k, v, lens, kp, vp, pre)
    for b in range(B):
        s, m = slot_of[b], int(lens[b])
        keys = [kp[s, :, :[6, 4][s]]] * (s >= 0) + [k[b, :, :m]]
        vals = [vp[s, :, :[6, 4][s]]] * (s >= 0) + [v[b, :, :m]]
        want = F.scaled_dot_product_attention(q[b], torch.cat(keys, 1), torch.cat(vals, 1))
        assert (got[b] - want).abs().max() <= 1e-5, b
    assert bsd.prefix_index([-1, -1], [6], "cpu") is None


# -----------------------------------------------------------------------------
# the CPU fast path of sparse decode (C++ kernel, or the chunked gather) equals the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H_kv,G,page_size", [(2, 2, 16), (1, 4, 8), (4, 1, 4)])
def test_cpu_sparse_path_equals_the_reference(dtype, H_kv, G, page_size):
    """sparse_decode_cpu on the engine's head-major layout: random-order selections, pages past
    the end, partial last pages, an empty sequence and an empty selection, junk padding in sel.
    The C++ kernel must not read the NaN traps; the gather path reads the tail of a partial page
    (and masks it), so it gets finite junk there instead."""
    case, _, _ = make_case([0, 1, 29, 64, 45], H_kv=H_kv, G=G, D=32, page_size=page_size,
                           sparse=True, past_end=True, dtype=dtype, seed=7)
    case["n_sel"][2, 0] = 0  # a (row, head) that reads nothing
    hm = {**case, "k_cache": head_major(case["k_cache"]), "v_cache": head_major(case["v_cache"])}
    want = block_sparse_decode_ref(**case)
    if cpu_path.cpu_kernel() is not None:
        got = cpu_path.sparse_decode_cpu(**hm)
        assert (got[0] == 0).all() and (got[2, :G] == 0).all()
        assert_close(got, want, dtype)
    finite = {k: v.nan_to_num(3.0) if k.endswith("cache") else v for k, v in hm.items()}
    assert_close(cpu_path.sparse_decode_cpu(**finite, kernel=False), want, dtype)
    assert torch.equal(decode_attention(**finite, finite=True), cpu_path.sparse_decode_cpu(**finite))
    if H_kv > 1:  # a token-major cache has no page rows: decode_attention takes the reference
        assert cpu_path.page_rows(case["k_cache"]) is None
        assert torch.equal(decode_attention(**case, finite=True), want)


@pytest.mark.parametrize("G,D", [(5, 32), (2, 48)])
def test_cpu_sparse_path_without_a_kernel_instance_gathers(G, D):
    """A group size or head dim the C++ kernel has no instance for: the kernel returns None and
    sparse_decode_cpu takes the gather path, which equals the reference."""
    case, _, _ = make_case([0, 29, 64], H_kv=2, G=G, D=D, page_size=8, sparse=True, seed=3)
    hm = {k: head_major(v).nan_to_num(0.5) if k.endswith("cache") else v for k, v in case.items()}
    if cpu_path.cpu_kernel() is not None:
        (kr, ks, kh), (vr, vs, vh) = (cpu_path.page_rows(hm[k]) for k in ("k_cache", "v_cache"))
        q = hm["q"].reshape(3, 2, G, D).contiguous()
        ints = [hm[k].int().contiguous() for k in ("page_table", "seq_lens", "sel", "n_sel")]
        assert cpu_path.cpu_kernel().sparse_decode(q, kr, vr, *ints, 8, ks, kh, vs, vh, 1.0) is None
    assert_close(cpu_path.sparse_decode_cpu(**hm), block_sparse_decode_ref(**case), torch.float32)


def test_cpu_sparse_path_chunks_rows(monkeypatch):
    """The gather path splits the batch into chunks that fit SPARSE_CHUNK_BYTES: one row per chunk
    gives what one chunk for all gives."""
    case, _, _ = make_case([9, 33, 50, 17], H_kv=2, G=2, D=16, page_size=4, sparse=True, seed=5)
    hm = {k: head_major(v).nan_to_num(0.5) if k.endswith("cache") else v for k, v in case.items()}
    whole = cpu_path.sparse_decode_cpu(**hm, kernel=False)
    monkeypatch.setattr(cpu_path, "SPARSE_CHUNK_BYTES", 1)
    assert torch.allclose(cpu_path.sparse_decode_cpu(**hm, kernel=False), whole, atol=1e-6, rtol=0)
    assert_close(whole, block_sparse_decode_ref(**case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,D", [(1, 64), (2, 32), (3, 64), (4, 128), (8, 64), (5, 64), (19, 32),
                                 (3, 48)])
def test_cpu_dense_runs_kernel_equals_sdpa(M, D, dtype):
    """The C++ dense decode over contiguous runs (the engine's lanes, attend_runs_cpu) equals SDPA
    on the cut copies, with its log-sum-exp, over lengths that cross its blocks of 32 keys, a row
    with no key (zeros, lse -inf), and a cache in bf16; any M (a verify's G * T queries: chunks of
    8, 4, 3, 2, 1); a head dim it has no instance for (D = 48) gives None."""
    if cpu_path.cpu_kernel() is None:
        pytest.skip("no C++ kernel here")
    gen = torch.Generator().manual_seed(M * D)
    B, H, T = 4, 2, 70
    k, v = (torch.randn(H, B, T + 3, D, generator=gen).to(dtype)[:, :, :T].transpose(0, 1)
            for _ in "kv")
    q = torch.randn(B, H, M, D, generator=gen)
    lens = torch.tensor([70, 33, 1, 0])
    got = cpu_path.attend_runs_cpu(q, k, v, lens)
    if D == 48:
        assert got is None
        return
    out, lse = got
    for b in range(3):
        n = int(lens[b])
        kb, vb = k[b, :, :n].float(), v[b, :, :n].float()
        want = F.scaled_dot_product_attention(q[b], kb, vb)
        assert (out[b] - want).abs().max() <= 2e-5, b
        s = (q[b] @ kb.transpose(-1, -2)) * D ** -0.5
        assert (lse[b] - torch.logsumexp(s, -1)).abs().max() <= 2e-5, b
    assert (out[3] == 0).all() and torch.isinf(lse[3]).all() and (lse[3] < 0).all()
    whole, _ = cpu_path.attend_runs_cpu(q, k, v)  # lens None: all T keys
    assert (whole - F.scaled_dot_product_attention(q, k.float(), v.float())).abs().max() <= 2e-5


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A build killed part way leaves torch's lock behind; without this every later load hangs."""
    import time
    import warnings
    from zeros_kernels.cpu_ext import clear_stale_lock
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "zeros_test_ext" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    assert not clear_stale_lock("zeros_test_ext") and lock.exists()  # a build may hold it now
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert clear_stale_lock("zeros_test_ext")
    assert not lock.exists() and "stale build lock" in str(w[0].message)
    assert not clear_stale_lock("zeros_test_ext")  # none left: nothing to do


def test_a_prefetched_build_runs_once_and_load_waits_for_it(monkeypatch):
    """prefetch_cpu_ext starts the compile in a thread; a load that comes while it runs waits for
    that build and gets its module, and no second build starts (so a first run compiles while
    the warm start trains, once)."""
    import threading
    from zeros_kernels import cpu_ext
    monkeypatch.setattr(cpu_ext, "_BUILDS", {})
    started, release, calls = threading.Event(), threading.Event(), []

    def slow_compile(name):
        calls.append(name)
        started.set()
        release.wait(10)
        return f"module {name}"
    monkeypatch.setattr(cpu_ext, "_compile", slow_compile)
    cpu_ext.prefetch_cpu_ext("k")  # returns at once, the build under way
    assert started.wait(10) and calls == ["k"]
    got = []
    waiter = threading.Thread(target=lambda: got.append(cpu_ext.load_cpu_ext("k")))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # waiting on the build, not building again
    release.set()
    waiter.join(10)
    assert got == ["module k"] and cpu_ext.load_cpu_ext("k") == "module k" and calls == ["k"]
    cpu_ext.prefetch_cpu_ext("k")  # built: nothing starts
    assert calls == ["k"]


def test_prefetched_builds_run_one_after_another_at_the_lowest_priority(monkeypatch):
    """Two builds at full priority beside the warm start's SFT (two torch threads on two cores)
    slowed it four times: prefetch_cpu_ext builds its kernels in one thread, one at a time, at
    nice 19 (Linux: the thread's own), so SFT keeps its cores."""
    import threading
    from zeros_kernels import cpu_ext
    monkeypatch.setattr(cpu_ext, "_BUILDS", {})
    seen, live = [], []

    def compile_(name):
        live.append(name)
        seen.append((name, threading.get_ident(), os.getpriority(os.PRIO_PROCESS, 0), len(live)))
        time.sleep(0.05)
        live.remove(name)
        return f"module {name}"
    monkeypatch.setattr(cpu_ext, "_compile", compile_)
    cpu_ext.prefetch_cpu_ext("a", "b")
    assert cpu_ext.load_cpu_ext("b") == "module b" and cpu_ext.load_cpu_ext("a") == "module a"
    assert [s[0] for s in seen] == ["a", "b"]  # in order, each built once
    assert len({s[1] for s in seen}) == 1 and threading.get_ident() != seen[0][1]  # one thread
    assert all(s[3] == 1 for s in seen)  # never two at once
    assert all(s[2] == 19 for s in seen) and os.getpriority(os.PRIO_PROCESS, 0) < 19  # only it


def test_a_build_that_raises_reaches_its_waiters(monkeypatch):
    from zeros_kernels import cpu_ext
    monkeypatch.setattr(cpu_ext, "_BUILDS", {})
    monkeypatch.setattr(cpu_ext, "_compile", lambda name: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cpu_ext.load_cpu_ext("k")
    with pytest.raises(ZeroDivisionError):  # the same failure again, not a hang
        cpu_ext.load_cpu_ext("k")


def test_a_load_waits_for_a_held_build_lock_until_it_goes_or_goes_stale(tmp_path, monkeypatch):
    """wait_for_lock: a lock another process holds is waited for (and said), it returns once the
    lock is gone; a lock that turns stale while it waits is removed, so no load waits forever
    (torch's own wait had no end: processes that came while a killed build's lock was young hung)."""
    import threading
    import time
    import warnings
    from zeros_kernels.cpu_ext import wait_for_lock
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "zeros_test_ext" / "lock"
    lock.parent.mkdir()
    wait_for_lock("zeros_test_ext", poll_s=0.01, log=pytest.fail)  # no lock: at once, no word
    lock.write_text("")
    said = []
    threading.Timer(0.2, lock.unlink).start()  # the holder finishes
    t0 = time.time()
    wait_for_lock("zeros_test_ext", poll_s=0.01, log=said.append)
    assert 0.15 < time.time() - t0 < 5 and not lock.exists() and "waiting for the build" in said[0]
    lock.write_text("")

    def age():  # the holder was killed: its lock only ages
        old = time.time() - 3600
        os.utime(lock, (old, old))
    threading.Timer(0.2, age).start()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        wait_for_lock("zeros_test_ext", poll_s=0.01, log=said.append)
    assert not lock.exists() and "stale build lock" in str(w[-1].message)
