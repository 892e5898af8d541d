"""
Block-sparse decode attention over a paged KV cache.

During decoding each sequence adds one query token per step, and attention has to read the whole KV
cache for it: the step is bound by memory bandwidth, so its time is about the bytes of K and V read.
Sparse rollout reads only some pages of the cache. A selector elsewhere (sparsity.py) scores every
page against the query and picks which pages to read, per sequence and per KV head; this file only
reads them. Dense decode is the same kernel with every page selected, so the sparse path and the
dense path share all their code but the selection.

The ideas this kernel builds on (the ideas only; no code is copied):
- Quest (Tang et al., 2024): query-aware selection of KV pages and attention that reads only the
  selected pages of a paged cache.
- FlashAttention (Dao et al., 2022): online softmax, i.e. a running max, a running sum and an fp32
  accumulator, so the scores never go to memory.
- Flash-decoding (Dao, Haziza, Massa, Sizov, 2023): when batch x KV heads is too small to fill the
  GPU, split each sequence's KV across programs and merge the partial outputs by log-sum-exp.
- Grouped-query decoding as in the NSA Triton kernels: one program loads the G query heads that
  share a KV head, so each page is read once per group instead of once per query head.

Layout and contract (what the rollout engine passes, per layer):
    q           (B, H_q, D)                  the decode queries, H_q = G * H_kv
    k_cache     (num_pages, page_size, H_kv, D)  any strides with D contiguous: the engine's pool
    v_cache     (num_pages, page_size, H_kv, D)  is head-major, (H_kv, num_pages, page_size, D)
    page_table  (B, max_pages) int32         logical page j of sequence b -> physical page id
    seq_lens    (B,) int32                   cached tokens of each sequence,
                                             <= max_pages * page_size
    sel         (B, H_kv, max_sel) int32     LOGICAL page indices in [0, max_pages), any order
    n_sel       (B, H_kv) int32              how many entries of sel are valid; the rest is padding
    -> out      (B, H_q, D) in q's dtype

Simplifications and rules:
1. A selected page at or past the sequence's end contributes nothing, and only the tokens at logical
   positions < seq_len of a partial last page count. Table entries of such pages are never read.
2. A sequence with seq_len 0, or a (sequence, head) with n_sel 0, outputs zeros (not NaN).
3. Duplicate pages in a selection are the caller's bug: they are counted twice, and not checked.
4. Softmax statistics and accumulators are fp32. On a GPU with a bf16/fp16 cache, the two products
   run on tensor cores in the cache dtype with fp32 accumulation: q is cast to the cache dtype, and
   the probabilities are rounded to it before P @ V, as in FlashAttention. Other caches (fp32, fp8)
   and the interpreter compute in fp32 throughout, with exact ("ieee") fp32 dots.
5. One page table per sequence, shared by all KV heads; the selection may differ per KV head.
6. Without Triton (CPU tensors, or use_triton=False), dense decode (sel=None) takes a faster PyTorch
   path than the reference: one gather of every cached token per cache, then fused SDPA
   (`dense_decode_ref`). Same contract. Where each row's tokens are one contiguous run (the
   engine's lanes), the CPU reads them in place with no gather (`attend_rows`: the C++ kernel's
   one-pass `attend_runs`, or SDPA), and a prompt that a group of rows shares once for the group
   (`shared_prefix_decode`: the rows' queries side by side, merged with each row's own part by
   log-sum-exp, `merge_attention`).
7. Sparse decode on a CPU (the engine passes finite=True; a head-major cache) takes
   `sparse_decode_cpu` (zeros_kernels/sparse_decode_cpu.py): a C++ kernel (sparse_decode_cpu.cpp, built
   on first use with torch.utils.cpp_extension and cached; ZEROS_CPU_KERNEL=0 skips it) that reads
   the selected pages in place, since PyTorch can only gather them first, and the gather costs
   more than the attention. Its `select_pages_cpu` also does the page selection (centroid or Quest
   scores read through the page tables, then sparsity.select_pages' rule) in one call. Without a
   C++ compiler, a PyTorch path gathers whole pages a chunk of rows at a time and masks them in
   SDPA.

Run the benchmark with `python -m zeros_kernels.block_sparse_bench` (CUDA: kernel vs SDPA vs
FlexAttention; CPU: the PyTorch reference against the CPU fast path). Tests:
`python -m pytest tests/test_kernel.py`, which runs the kernel through Triton's interpreter
(TRITON_INTERPRET=1) when there is no GPU. The interpreter accepts what the GPU compiler rejects, so
`python -m pytest tests/test_kernel_compile.py -s` compiles every variant the wrapper can launch
(`launch_configs`) to sm_80 and sm_90 machine code with no GPU (Triton's own ptxas) and prints the
registers and spills of each.
"""

import functools
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from zeros_kernels.sparse_decode_cpu import attend_runs_cpu, page_rows, sparse_decode_cpu

# The interpreter runs the kernel on the CPU with numpy, and its bf16 arithmetic is not faithful,
# so under it every load is cast to fp32 at once. Triton reads this flag when a kernel is decorated.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# Tokens per inner-loop tile, warps, pipeline stages. A page of 16 tokens is too small a unit of
# work, so a tile holds several pages (or a piece of a larger page). Half-precision tiles feed the
# tensor cores; exact fp32 dots run on the FMA units and need a smaller tile to stay in registers.
# Tiles are powers of two and >= 16 (tl.dot's minimum). No variant spills on sm_80 or sm_90
# (tests/test_kernel_compile.py). Not timed on hardware yet.
HALF_CONFIG = dict(tile_tokens=64, num_warps=4, num_stages=2)
FP32_CONFIG = dict(tile_tokens=32, num_warps=8, num_stages=2)
HALF_DTYPES = (torch.float16, torch.bfloat16)  # caches that go to the tensor cores as they are
# Auto splitting stops once a split would get fewer pages than this: the merge is not free.
MIN_PAGES_PER_SPLIT = 4
# The merge kernel holds every split of a row in registers at once: past 32 splits it spills.
MAX_SPLITS = 32


# -----------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _block_sparse_decode_kernel(
    Q, K, V, PageTable, SeqLens, Sel, NSel, Out, Lse,
    stride_qb, stride_qh, stride_qd,
    stride_kp, stride_kt, stride_kh, stride_kd,
    stride_vp, stride_vt, stride_vh, stride_vd,
    stride_ptb, stride_ptj,
    stride_lb,
    stride_sb, stride_sh, stride_ss,
    stride_nb, stride_nh,
    stride_ob, stride_oh, stride_os, stride_od,
    num_kv_heads, num_splits, qk_scale,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, CHUNKS_PER_PAGE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program = one (sequence, KV head, split). It owns the G query heads of that KV head and a
    contiguous share of the selected pages; it writes the normalised partial output of each query
    head and its log-sum-exp (base 2), which the merge kernel combines when num_splits > 1.
    The loop walks chunks of CHUNK token slots: a page (padded to a power of two) is
    CHUNKS_PER_PAGE chunks, and a tile of BLOCK_N tokens is BLOCK_N // CHUNK chunks."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // num_kv_heads
    # int64: in a head-major cache (the engine's) h * stride_kh spans the whole pool
    h = (pid_bh % num_kv_heads).to(tl.int64)

    seq_len = tl.load(SeqLens + b * stride_lb)
    n_sel = tl.load(NSel + b * stride_nb + h * stride_nh)
    # each split takes a share of this (sequence, head)'s own selection: a ragged batch stays
    # balanced, and the host never has to read n_sel (no CPU-GPU sync)
    per_split = tl.cdiv(n_sel, num_splits)
    start = split * per_split
    end = tl.minimum(start + per_split, n_sel)

    offs_g = tl.arange(0, BLOCK_G)  # query heads of the group, padded to >= 16 rows for tl.dot
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)  # token slots of a tile
    g_ok = offs_g < G
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # running sum of p @ v

    for first in range(start * CHUNKS_PER_PAGE, end * CHUNKS_PER_PAGE, BLOCK_N // CHUNK):
        chunk = first + offs_n // CHUNK  # (BLOCK_N,)
        idx = chunk // CHUNKS_PER_PAGE  # position in the selection, repeated over a page's tokens
        within = (chunk % CHUNKS_PER_PAGE) * CHUNK + offs_n % CHUNK  # token slot inside the page
        slot_ok = idx < end
        page = tl.load(Sel + b * stride_sb + h * stride_sh + idx * stride_ss, mask=slot_ok, other=0)
        pos = page * PAGE_SIZE + within  # logical token position
        # pages past the end and the tail of a partial last page are masked out here, which also
        # keeps their page-table entries and cache slots (possibly garbage) from being read
        tok_ok = slot_ok & (within < PAGE_SIZE) & (pos < seq_len)
        phys = tl.load(PageTable + b * stride_ptb + page * stride_ptj, mask=tok_ok, other=0)
        phys = phys.to(tl.int64)  # num_pages * page stride can pass 2**31
        kv_ok = tok_ok[:, None] & d_ok[None, :]
        k_ptrs = K + phys[:, None] * stride_kp + within[:, None] * stride_kt + h * stride_kh \
            + offs_d[None, :] * stride_kd
        v_ptrs = V + phys[:, None] * stride_vp + within[:, None] * stride_vt + h * stride_vh \
            + offs_d[None, :] * stride_vd
        k = tl.load(k_ptrs, mask=kv_ok, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_ptrs, mask=kv_ok, other=0.0)  # (BLOCK_N, BLOCK_D)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N)
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a tile with no valid token leaves m_new at -inf; subtracting 0 instead avoids inf - inf
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_ref[:, None])  # (BLOCK_G, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # an empty split (or an empty sequence) has l_i = 0: it writes zeros and lse = -inf
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]  # (BLOCK_G, BLOCK_D)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # (BLOCK_G,)
    heads = h * G + offs_g
    o_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + split * stride_os \
        + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    num_q_heads = num_kv_heads * G
    tl.store(Lse + (b * num_q_heads + heads) * num_splits + split, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(
    Part, Lse, Out, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program = one (sequence, query head): out = sum_s w_s * o_s / sum_s w_s with
    w_s = 2**lse_s. Part (B * H_q, S, D) and Lse (B * H_q, S) are contiguous fp32 buffers."""
    row = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(Lse + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights 0, output 0
    w = tl.exp2(lse - m)
    part_ptrs = Part + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    part = tl.load(part_ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(den > 0.0, den, 1.0)  # (BLOCK_D,)
    tl.store(Out + row * HEAD_DIM + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


# -----------------------------------------------------------------------------
# Python wrappers


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch, num_kv_heads, max_sel, device):
    """Enough programs to fill the GPU: aim for >= 2 programs per SM, but give each split at least
    MIN_PAGES_PER_SPLIT pages (of the padded selection width, so no device value is read)."""
    device = torch.device(device)
    if device.type != "cuda" or _INTERPRET:
        return 1
    programs = batch * num_kv_heads
    want = triton.cdiv(2 * _sm_count(device.index if device.index is not None else 0), programs)
    return max(1, min(want, triton.cdiv(max_sel, MIN_PAGES_PER_SPLIT), MAX_SPLITS))


def launch_config(G, head_dim, page_size, half, num_splits=1):
    """What block_sparse_decode launches for G query heads of head_dim per KV head, pages of
    page_size tokens, a bf16/fp16 cache on the tensor cores (half) or exact fp32 (an fp32 cache, or
    any under the interpreter), and num_splits: the keyword arguments of the decode kernel (its
    constexprs, num_warps, num_stages) and of the merge kernel (None for one split)."""
    cfg = HALF_CONFIG if half else FP32_CONFIG
    block_t = triton.next_power_of_2(page_size)
    chunk = min(block_t, cfg["tile_tokens"])
    decode = dict(
        G=G, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_G=max(16, triton.next_power_of_2(G)),  # an mma's 16 rows (older tl.dot's minimum)
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=cfg["tile_tokens"], CHUNK=chunk, CHUNKS_PER_PAGE=block_t // chunk,
        UPCAST=not half, DOT_PRECISION="tf32" if half else "ieee",  # tf32 is unused for half inputs
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    merge = None if num_splits == 1 else dict(
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1)
    return decode, merge


def launch_configs(page_sizes=(16, 64)):
    """What block_sparse_decode can launch on a GPU, as the inputs that decide it: a list of
    (cache dtype, q dtype, page_size, num_splits). A covering set, not every product: each cache
    dtype (fp32 exact; bf16, fp16 on the tensor cores), q in the cache's dtype or in fp32 (an fp32
    model over a half cache), pages smaller than a tile and not, one split or several
    (the merge kernel, 2 to MAX_SPLITS). tests/test_kernel_compile.py compiles each for sm_80 and
    sm_90."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    small = min(page_sizes)
    return ([(kv, kv, p, 1) for kv in (f32, bf16) for p in page_sizes]
            + [(f16, f16, small, 1), (bf16, f32, small, 1)]
            + [(kv, kv, small, MAX_SPLITS) for kv in (f32, bf16)]
            + [(f16, f16, max(page_sizes), 2)])


def _check_inputs(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel):
    assert q.dim() == 3, f"q must be (B, H_q, D), got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, \
        f"k_cache and v_cache must both be (num_pages, page_size, H_kv, D), got " \
        f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
    B, H_q, D = q.shape
    H_kv = k_cache.shape[2]
    assert k_cache.shape[3] == D, \
        f"head_dim of q ({D}) and of the cache ({k_cache.shape[3]}) differ"
    assert H_q % H_kv == 0, f"H_q ({H_q}) must be a multiple of H_kv ({H_kv})"
    assert page_table.dim() == 2 and page_table.shape[0] == B, \
        f"page_table must be (B, max_pages), got {tuple(page_table.shape)}"
    assert seq_lens.shape == (B,), f"seq_lens must be (B,), got {tuple(seq_lens.shape)}"
    assert sel.dim() == 3 and sel.shape[:2] == (B, H_kv), \
        f"sel must be (B, H_kv, max_sel) = ({B}, {H_kv}, _), got {tuple(sel.shape)}"
    assert n_sel.shape == (B, H_kv), f"n_sel must be (B, H_kv), got {tuple(n_sel.shape)}"
    for name, t in (("page_table", page_table), ("seq_lens", seq_lens), ("sel", sel),
                    ("n_sel", n_sel)):
        assert not t.is_floating_point(), f"{name} must be an integer tensor, got {t.dtype}"


def block_sparse_decode(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel, scale=None,
                        num_splits=None):
    """Attention of the decode queries q (B, H_q, D) over the selected pages of a paged cache, with
    the Triton kernel. Returns (B, H_q, D) in q's dtype. num_splits=None picks the split count for
    the GPU (1 under the interpreter); an int forces it. See the module docstring for the
    contract."""
    _check_inputs(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel)
    B, H_q, D = q.shape
    _, page_size, H_kv, _ = k_cache.shape
    G = H_q // H_kv
    max_sel = sel.shape[2]
    scale = D ** -0.5 if scale is None else scale
    if num_splits is None:
        num_splits = default_num_splits(B, H_kv, max_sel, q.device)
    assert 1 <= num_splits <= MAX_SPLITS, \
        f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}"

    # the interpreter casts fp32 -> bf16 by truncation (the GPU rounds): there, let torch round
    out = torch.empty((B, H_q, D), device=q.device, dtype=torch.float32 if _INTERPRET else q.dtype)
    lse = torch.empty((B, H_q, num_splits), device=q.device, dtype=torch.float32)
    if num_splits == 1:  # write the final output directly; the split stride is never used
        part, part_strides = out, (out.stride(0), out.stride(1), 0, out.stride(2))
    else:
        part = torch.empty((B, H_q, num_splits, D), device=q.device, dtype=torch.float32)
        part_strides = part.stride()

    # A half-precision cache on a GPU goes to the tensor cores as it is (q is cast to its dtype);
    # anything else (fp32 or fp8 caches, the interpreter) is cast to fp32 after the load and
    # multiplied exactly.
    half = not _INTERPRET and k_cache.dtype in HALF_DTYPES and v_cache.dtype == k_cache.dtype
    decode_kw, merge_kw = launch_config(G, D, page_size, half, num_splits)
    _block_sparse_decode_kernel[(B * H_kv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, sel, n_sel, part, lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *page_table.stride(), seq_lens.stride(0),
        *sel.stride(), *n_sel.stride(), *part_strides,
        H_kv, num_splits, scale * math.log2(math.e),  # scores in log2 units: exp2 is the fast one
        **decode_kw,
    )
    if merge_kw is not None:
        _merge_splits_kernel[(B * H_q,)](part, lse, out, num_splits, **merge_kw)
    return out.to(q.dtype)


def dense_selection(page_table, seq_lens, num_kv_heads, page_size):
    """The selection that reads every page of every sequence: dense decode through the same kernel.
    Returns sel (B, H_kv, max_pages) and n_sel (B, H_kv) as broadcast views (stride 0 over
    heads)."""
    B, max_pages = page_table.shape
    sel = torch.arange(max_pages, device=page_table.device, dtype=torch.int32)
    sel = sel.expand(B, num_kv_heads, max_pages)
    n_sel = ((seq_lens + page_size - 1) // page_size).to(torch.int32)
    return sel, n_sel[:, None].expand(B, num_kv_heads)


def decode_attention(q, k_cache, v_cache, page_table, seq_lens, sel=None, n_sel=None, scale=None,
                     use_triton=None, num_splits=None, slots=None, finite=False):
    """What the rollout engine calls. sel=None means dense (every page). use_triton=None picks the
    Triton kernel for CUDA tensors and the PyTorch path elsewhere; True or False forces one. Off
    Triton, dense decode goes to `dense_decode_ref`; `slots` = dense_slots(...) lets a caller that
    runs every layer over one page table build the gather once. finite=True: the caller vouches
    that the cache holds no NaN or inf anywhere (the engine's pool), so off Triton sparse decode
    of a head-major cache takes `sparse_decode_cpu` instead of the reference."""
    if use_triton is None:
        use_triton = q.is_cuda
    if sel is None and not use_triton:
        if slots is None:
            slots = dense_slots(page_table, seq_lens, k_cache.shape[1])
        return dense_decode_ref(q, k_cache, v_cache, *slots, scale)
    if sel is None:
        sel, n_sel = dense_selection(page_table, seq_lens, k_cache.shape[2], k_cache.shape[1])
    if use_triton:
        return block_sparse_decode(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel, scale,
                                   num_splits)
    # a head-major cache (page_rows views it): the CPU fast path; else None, and the reference
    out = (sparse_decode_cpu(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel, scale)
           if finite else None)
    if out is not None:
        return out
    return block_sparse_decode_ref(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel, scale)


# -----------------------------------------------------------------------------
# PyTorch reference, and the CPU dense paths beside it (sparse: zeros_kernels/sparse_decode_cpu.py)


def cache_rows(cache):
    """A cache (num_pages, page_size, H_kv, D) as a (rows, D) view of its memory, with the row
    strides s of a token slot and h of a head: slot i's head j is row i * s + j * h. One
    index_select on it gathers any (slot, head) pairs, for a token-major cache (s = H_kv, h = 1)
    and for the engine's head-major one (s = 1, h = num_pages * page_size) alike."""
    NP, P, H, D = cache.shape
    sp, st, sh, sd = cache.stride()
    assert sd == 1 and st % D == 0 and (H == 1 or sh % D == 0) and sp == P * st, \
        f"cache strides {cache.stride()}: D values must be contiguous, token slots evenly spaced"
    n = ((NP * P - 1) * st + (H - 1) * sh) // D + 1
    return cache.as_strided((n, D), (D, 1)), st // D, sh // D


def block_sparse_decode_ref(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel, scale=None):
    """The same contract in plain PyTorch, for the whole batch at once: gather the selected pages,
    mask padding and tokens past the end, softmax in fp32. Memory is B * H_kv * max_sel pages of
    K and V in fp32, i.e. the pages the kernel reads, upcast."""
    _check_inputs(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel)
    B, H_q, D = q.shape
    _, P, H_kv, _ = k_cache.shape
    G, S, dev = H_q // H_kv, sel.shape[2], q.device
    scale = D ** -0.5 if scale is None else scale
    seq_lens = seq_lens.long()

    slot_ok = torch.arange(S, device=dev) < n_sel[..., None]  # (B, H_kv, S)
    page = sel.long()
    page_ok = slot_ok & (page * P < seq_lens[:, None, None])  # (B, H_kv, S)
    page = torch.where(page_ok, page, 0)  # padding and pages past the end: never look them up
    phys = page_table.long().gather(1, page.view(B, H_kv * S)).view(B, H_kv, S)
    phys = torch.where(page_ok, phys, 0)  # their table entries may hold anything
    pos = page[..., None] * P + torch.arange(P, device=dev)  # (B, H_kv, S, P)
    tok_ok = (page_ok[..., None] & (pos < seq_lens[:, None, None, None])).view(B, H_kv, 1, S * P)

    # one flat gather per cache: the D values of (token slot phys * P + t, head h) are one row of
    # a (rows, D) view, whatever the layout (token- or head-major). Masked slots read token 0 of
    # the row's first page instead, a real value (the cache may hold NaN elsewhere, and 0 * NaN
    # is NaN), so V needs no masking; their scores are masked below.
    heads = torch.arange(H_kv, device=dev)[None, :, None, None]  # (1, H_kv, 1, 1)
    slot = phys[..., None] * P + torch.arange(P, device=dev)  # (B, H_kv, S, P)
    # an empty row's table may hold anything
    page0 = torch.where(seq_lens > 0, page_table[:, 0].long(), 0)
    slot = torch.where(tok_ok.view(B, H_kv, S, P), slot, (page0 * P)[:, None, None, None])
    k, v = (rows.index_select(0, (slot * s + heads * h).view(-1)).view(B, H_kv, S * P, D).float()
            for rows, s, h in (cache_rows(k_cache), cache_rows(v_cache)))

    qg = q.float().view(B, H_kv, G, D)  # the GQA group of each KV head, as G query positions
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=tok_ok, scale=scale)  # (B, H_kv, G, D)
    # nothing valid (an empty row or selection): 0
    out = torch.where(tok_ok.any(-1, keepdim=True), out, 0.0)
    return out.view(B, H_q, D).to(q.dtype)


def dense_slots(page_table, seq_lens, page_size):
    """What dense decode reads: slots (B, T) rows of the cache viewed as (num_pages * page_size,
    H_kv, D), T = max_pages * page_size, and ok (B, T), True at the cached tokens. The other slots
    point at the sequence's first token, a real value (the cache may hold NaN elsewhere, and 0 * NaN
    is NaN)."""
    B, max_pages = page_table.shape
    pos = torch.arange(max_pages * page_size, device=page_table.device)
    ok = pos < seq_lens.long()[:, None]
    slots = page_table.long()[:, pos // page_size] * page_size + pos % page_size  # (B, T)
    first = torch.where(seq_lens > 0, slots[:, 0], 0)  # an empty row's table may hold anything
    return torch.where(ok, slots, first[:, None]), ok


def dense_decode_ref(q, k_cache, v_cache, slots, ok, scale=None):
    """Dense decode in PyTorch, the CPU fast path: one gather of every cached token (all KV heads at
    once) per cache, then fused SDPA in fp32, with the G query heads of a KV head as G query
    positions (no GQA copies of K and V). slots, ok from `dense_slots`. Returns (B, H_q, D) in q's
    dtype."""
    B, H_q, D = q.shape
    H_kv = k_cache.shape[2]
    # one gather of every slot for all KV heads at once -> (B, H_kv, T, D), through cache_rows
    # (token- and head-major caches alike)
    heads = torch.arange(H_kv, device=q.device)
    k, v = (rows.index_select(0, (slots[..., None] * s + heads * h).view(-1))
            .view(B, -1, H_kv, D).transpose(1, 2)
            for rows, s, h in (cache_rows(k_cache), cache_rows(v_cache)))
    # (B, H_kv, G, D): the GQA group of each KV head
    qg = q.reshape(B, H_kv, H_q // H_kv, D).float()
    out = F.scaled_dot_product_attention(qg, k.float(), v.float(), attn_mask=ok[:, None, None],
                                         scale=scale)
    # an empty sequence (no first token) outputs zeros
    out = torch.where(ok[:, :1, None, None], out, 0.0)
    return out.view(B, H_q, D).to(q.dtype)


def length_mask(lens, T, dtype):
    """(B, 1, 1, T) additive mask for attend_rows: 0 on row b's first lens[b] keys, -inf after."""
    ok = torch.arange(T, device=lens.device) < lens[:, None]
    mask = torch.zeros(ok.shape, dtype=dtype, device=lens.device).masked_fill_(~ok, -math.inf)
    return mask[:, None, None]


def attend_rows(q, k, v, lens=None, lse=False):
    """Decode attention of q (B, H_kv, M, D), the M = G query heads of each KV head (or more: the
    rows of a group over their shared prompt, a verify's G * T), over K, V (B, H_kv, T, D) with
    any strides, e.g. a strided view of a cache whose rows are contiguous runs (no gather); row b
    reads its first lens[b] keys (None: all T; each row must read a key unless lse=True). Returns
    out (B, H_kv, M, D) in q's dtype, and with lse=True also the log-sum-exp of each query's
    scaled scores (B, H_kv, M), for merge_attention (a row with no key: zeros and -inf). On a CPU
    the C++ kernel reads the runs in one pass (attend_runs_cpu); SDPA's CPU flash kernel, with a
    length mask, where it cannot."""
    fast = attend_runs_cpu(q, k, v, lens) if not q.is_cuda else None
    if fast is not None:
        out = fast[0].to(q.dtype)
        return (out, fast[1]) if lse else out
    if k.shape[2] == 0:  # no row has a key (a verify's rows with no own token yet): SDPA's CPU
        out = torch.zeros_like(q)  # flash kernel divides by zero there
        return (out, q.new_full(q.shape[:-1], -math.inf, dtype=torch.float32)) if lse else out
    mask = None if lens is None else length_mask(lens, k.shape[2], q.dtype)
    if not lse:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)[:2]
    # a row with no key: the flash kernel gives zeros and lse 0, where a merge needs -inf
    return out, l if lens is None else l.masked_fill((lens == 0)[:, None, None], -math.inf)


def merge_attention(o1, lse1, o2, lse2):
    """Attention over two disjoint sets of keys from each set's output (..., D) and log-sum-exp
    (...): the softmax over their union, as flash-decoding merges its splits. Set 1 weighs
    sigmoid(lse1 - lse2); a side with lse -inf has no keys (its output must be finite)."""
    w1 = torch.sigmoid(lse1.float() - lse2.float())[..., None]
    return torch.lerp(o2.float(), o1.float(), w1).to(o1.dtype)


def prefix_index(slot_of, slot_lens, device):
    """How shared_prefix_decode lays out the rows that share a prompt. slot_of[j]: row j's prefix
    slot, or -1; slot_lens[s]: the prompt's tokens in slot s. None when no row has one, else (n,
    lens, q_idx, slot, member, lone): n = max(slot_lens); lens = the slots' lengths (None if all
    equal); q_idx (S * R,) the row whose query is member i of slot s, at s * R + i (R: the
    most rows of a slot; padding repeats row 0, its output unread); slot, member (B,) where row j's
    output is; lone (B, 1, 1) True where a row has no prompt (None: none)."""
    S, B = len(slot_lens), len(slot_of)
    members, member = [[] for _ in range(S)], [0] * B
    for j, s in enumerate(slot_of):
        if s >= 0:
            member[j] = len(members[s])
            members[s].append(j)
    R = max(map(len, members), default=0)
    if not R:
        return None
    t = lambda x: torch.tensor(x, device=device)
    n, lone = max(slot_lens), [s < 0 for s in slot_of]
    return (n, t(slot_lens) if len(set(slot_lens)) > 1 else None,
            t([(js + [0] * R)[:R] for js in members]).view(-1), t([max(s, 0) for s in slot_of]),
            t(member), t(lone)[:, None, None] if any(lone) else None)


def shared_prefix_decode(q, k, v, lens, k_pre, v_pre, pre, lse=False):
    """Dense decode of q (B, H_kv, G, D) over each row's own keys k, v (B, H_kv, T, D) (lens: see
    attend_rows) and over the prompt it shares with its group, stored once per prefix slot: k_pre,
    v_pre (S, H_kv, n, D). Each slot's prompt is read once, its rows' queries side by side (pre =
    prefix_index(...)); the two parts merge by log-sum-exp. -> (B, H_kv, G, D), and with lse=True
    also the log-sum-exp over both parts (B, H_kv, G), as attend_rows gives it."""
    _, pre_lens, q_idx, slot, member, lone = pre
    B, H, G, D = q.shape
    S = k_pre.shape[0]
    y, lse_own = attend_rows(q, k, v, lens, lse=True)
    # (S, Hkv, R * G, D): the queries of each slot's rows, one copy
    qp = q.transpose(0, 1).index_select(1, q_idx).view(H, S, -1, D).transpose(0, 1)
    yp, lp = attend_rows(qp, k_pre, v_pre, pre_lens, lse=True)
    R = q_idx.numel() // S
    yp, lp = yp.unflatten(2, (R, G))[slot, :, member], lp.unflatten(2, (R, G))[slot, :, member]
    if lone is not None:  # rows without a shared prompt: their own part alone
        lp = lp.masked_fill(lone, -math.inf)
    y = merge_attention(y, lse_own, yp, lp)
    return (y, torch.logaddexp(lse_own, lp)) if lse else y
