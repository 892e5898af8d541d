"""
zeros_kernels/sparse_decode_cpu.py: sparse decode on a CPU, beside block_sparse_decode.py's PyTorch
reference (same contract: q (B, H_q, D), a paged cache, page tables, the selected logical pages).

    ext = cpu_kernel()               # the C++ kernel of sparse_decode_cpu.cpp, or None
    sel, n_sel = select_pages_cpu(q, [kmean], table, n_pages, n_full, n_read)   # the engine's
    out = sparse_decode_cpu(q, k_cache, v_cache, table, seq_lens, sel, n_sel)   # selection, read
    out, lse = attend_runs_cpu(q4, k, v, lens)   # dense decode over contiguous runs (lanes)
    out, lse = attend_runs_cpu(qv, k, v, lens, tail=T)   # a verify's G * T queries, causal on
                                                         # the last T keys (its new tokens)
    out = attend_lanes_cpu(q, k_pool, v_pool, layer, first, size, T, lens)  # the same, no views
    write_tokens_cpu(k_pool, v_pool, layer, k, v, dst)   # new tokens' K and V into their slots
    python -m zeros_kernels.sparse_decode_cpu    # decode vs verify, ns per key (1 thread)

What it does:
    1. cpu_kernel builds sparse_decode_cpu.cpp on first use (zeros_kernels/cpu_ext.py: about a minute;
       torch caches the build, named by the CPU's instruction set). ZEROS_CPU_KERNEL=0, or no C++
       compiler or ninja: None, and a warning.
    2. select_pages_cpu: sparsity.select_pages over centroid or Quest scores, the page metadata
       read in place through the page tables, in one call.
    3. sparse_decode_cpu: attention over the selected pages, read in place in a head-major cache
       (page_rows views it). Without the kernel, or for a group size or head dim it has no
       instance for (G in 1-4 and 8, D in 32, 64, 128): whole pages gathered a chunk of rows at a
       time, then SDPA.
    4. attend_runs_cpu: dense decode over each row's keys where they lie, contiguous per (row,
       KV head) (the engine's lanes), in one pass with a running softmax; None where the kernel
       has no instance for the shape (the caller runs SDPA). A speculative verify (tail = T: the
       last T keys are its new tokens, causal) and any M > 8 queries go in blocks of 32 keys, each
       read once for all M queries as two small GEMMs (Q K^T, then P V), the causal mask on the
       block that holds the new tokens; attend_runs_ref is its plain PyTorch reference.
    5. A dense decode step (tail 1, at most 4 queries a KV head, head dim 32, 64 or 128) takes
       the path that reads its shape fastest (run_path): `Few` transposes each block of 16 keys
       in the registers, so every vector lane scores a key (in blocks the G = 2 queries fill 2
       lanes of 16; `Online` sums across the lanes for every key), at head dim 32; `Online` at 64
       and 128 on AVX-512. 1.7x and 3.4-3.6x faster a key than the blocks that long lanes took
       before (`python -m zeros_kernels.sparse_decode_cpu`); FEW = False gives that rule back.
    6. attend_lanes_cpu and write_tokens_cpu: a decode step's lanes read, and its new tokens'
       K and V written, straight from the pool's shape and offsets: the engine's step calls each
       once a layer in place of about twenty small ops (views, index_copy_, casts) around
       attend_runs_cpu, the fixed cost a small model's step pays outside attention.

Simplifications:
    1. The gather path reads the unread tail of a partial page, so the cache must hold finite
       values there (the engine's pool starts at zero: decode_attention's finite=True).
    2. Ties between equal page scores may break another way than sparsity.select_pages'.
"""

import math
import time
import warnings

import torch
import torch.nn.functional as F

from zeros_kernels.cpu_ext import load_cpu_ext


# Without the C++ kernel, the CPU fast path gathers the selected pages of a chunk of rows at a
# time into buffers of at most this many bytes (K and V together), which SDPA then reads back from
# the core's cache rather than from memory.
SPARSE_CHUNK_BYTES = 1 << 19


# attend_runs_cpu takes a verify and more than 8 queries through blocks of keys for all of them;
# False: the decode kernel in chunks of 8, each reading the run again (the path before the blocks,
# bench verifycost's "before"; a verify then gets None)
BLOCKS = True


# a decode step (tail 1, at most 8 queries a KV head) reads keys in blocks too from this many keys
# of a lane on: the one-pass kernel (`Online`) takes a horizontal sum a key and query, and on an
# AVX2 CPU (AMD EPYC) the blocks cut a step's attention about 3x at head dim 32 (`python -m bench
# verifycost`'s decode column: 7.37 -> 2.68 ms at 1K keys, 27.79 -> 9.24 at 4K) and left head dim
# 128 as it was. Shorter lanes keep the one-pass kernel: the default's contexts (under 150 tokens)
# and their figures are unchanged. Since FEW (below) this holds only with FEW off and for 5-8
# queries a KV head: measured on an AVX-512 CPU, the blocks were the slowest of the three paths
DECODE_BLOCKS_FROM = 512


# a dense decode step on the lanes (at most 4 queries a KV head) takes a path by head dim
# (`run_path`; `python -m zeros_kernels.sparse_decode_cpu` times all three, on an AMD EPYC with
# AVX-512, lanes of 1K-4K keys read from memory): `Few` (a block of keys transposed in the
# registers, every lane scoring a key) at head dim 32, 14.3-18.5 ns a key against one-pass
# `Online`'s 14.0-16.8 (as fast, from memory) and the blocks' 25.3-30.5;
# `Online` at 128, 51-57 ns against Few's 104-109 and the blocks' 186-194 (its sum across one
# 16-float register is cheap there). Where a vector holds 8 floats (AVX2) `Online`'s sum spans two
# registers and Few takes every head dim (not measured there). False: the rule before, blocks from
# DECODE_BLOCKS_FROM keys
FEW = True

# attend_runs' paths (sparse_decode_cpu.cpp's kOnline, kBlocks, kFew)
ONLINE, BLOCK_PATH, FEW_PATH = 0, 1, 2


def run_path(M, D, T, tail, lanes=16):
    """The C++ path for M queries a KV head over lanes of T keys, in a build whose vectors hold
    `lanes` floats: a decode step's few queries as FEW says, a verify or more than 8 queries in
    blocks, else the blocks from DECODE_BLOCKS_FROM keys and `Online` below."""
    if FEW and tail == 1 and M <= 4 and D in (32, 64, 128):
        return FEW_PATH if D == 32 or lanes < 16 else ONLINE
    return BLOCK_PATH if BLOCKS and (tail > 1 or M > 8 or T >= DECODE_BLOCKS_FROM) else ONLINE


# sparse_decode_cpu.cpp's interface version (its `version`), which cpu_kernel checks
KERNEL_VERSION = 5


# the stored score of a page that was not full when scored (the C++ kernel's kUnscored): it is read
# until the next rescoring, as a page that fills between two scorings must be
UNSCORED = 3.0e38


def cpu_kernel():
    """The C++ kernel of sparse_decode_cpu.cpp, built on first use (zeros_kernels/cpu_ext.py), or None.
    A build of another version of the file (its `version`: torch's build cache, shared with
    another checkout, can hand one over) is refused, with a warning: the PyTorch paths run."""
    ext = load_cpu_ext("sparse_decode_cpu")
    if ext is not None and getattr(ext, "version", 1) != KERNEL_VERSION:
        warnings.warn(f"{ext.__file__} is a build of another version of sparse_decode_cpu.cpp "
                      f"({getattr(ext, 'version', 1)}, not {KERNEL_VERSION}): the PyTorch path")
        return None
    return ext


def select_pages_cpu(q, meta, page_table, n_pages, n_full, n_read, keep_first=1, keep_recent=2,
                     max_read=None, scores=None, rescore=True):
    """sparsity.select_pages over centroid_scores (meta = [kmean]) or quest_scores ([kmin, kmax])
    in one C++ call, the layer's page metadata (num_pages, H_kv, D) read in place through the page
    tables: no gather and no small tensor ops per layer. Same arguments and result (ties between
    equal scores may break the other way); None without the C++ kernel. `scores` (B, H_kv, W)
    float32, contiguous: with rescore=True every full page's score is written there (UNSCORED for
    a page not full yet); with rescore=False the selection reads them there instead of scoring
    (the engine's kv_rescore_every)."""
    ext = cpu_kernel()
    if ext is None:
        return None
    B, H_q, D = q.shape
    H = meta[0].shape[1]
    k = int(n_read.max()) if max_read is None else max_read
    n_pages, n_full, n_read = (x.int().contiguous() for x in (n_pages, n_full, n_read))
    sel = ext.select_pages(q.reshape(B, H, H_q // H, D).float().contiguous(), list(meta),
                           page_table.int().contiguous(), n_pages, n_full, n_read, keep_first,
                           keep_recent, k, scores, rescore)
    return sel, n_read[:, None].expand(B, H).contiguous()


def page_rows(cache):
    """A cache (num_pages, page_size, H_kv, D) whose pages are contiguous per KV head (the engine's
    head-major pool) as a (rows, page_size * D) view, with the row strides s of a page and h of a
    head: page i of head j is row i * s + j * h. None for other layouts (a token-major cache)."""
    NP, P, H, D = cache.shape
    sp, st, sh, sd = cache.stride()
    if sd != 1 or st != D or sp % (P * D) or (H > 1 and sh % (P * D)):
        return None
    n = ((NP - 1) * sp + (H - 1) * sh) // (P * D) + 1
    return cache.as_strided((n, P * D), (P * D, 1)), sp // (P * D), sh // (P * D)


def sparse_decode_cpu(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel, scale=None,
                      kernel=True):
    """The CPU fast path of sparse decode, beside the reference: the same contract, for a cache
    that `page_rows` can view (head-major; None for another). The C++ kernel (`cpu_kernel`) reads
    the selected pages in place; without it (or kernel=False) whole pages are gathered, one
    index_select per cache for all KV heads, in the cache's dtype, a chunk of rows at a time, and
    SDPA masks the tokens past each row's end: that path reads the unread tail of a partial page
    too, so the cache must hold finite values there (0 * NaN is NaN; the engine's pool starts at
    zero)."""
    B, H_q, D = q.shape
    _, P, H, _ = k_cache.shape
    S, G, dev = sel.shape[2], H_q // H, q.device
    scale = D ** -0.5 if scale is None else scale
    kr, vr = page_rows(k_cache), page_rows(v_cache)
    if kr is None or vr is None:  # not head-major: the caller takes the reference
        return None
    (kr, ks, kh), (vr, vs, vh) = kr, vr
    qg, ext = q.reshape(B, H, G, D), cpu_kernel() if kernel else None
    if ext is not None:  # the index work too: no small tensor ops per layer
        ints = [t if t.dtype == torch.int32 and t.is_contiguous() else t.int().contiguous()
                for t in (page_table, seq_lens, sel, n_sel)]
        out = ext.sparse_decode(qg if q.dtype == torch.float32 and qg.is_contiguous()
                                else qg.float().contiguous(), kr, vr, *ints, P, ks, kh, vs, vh,
                                scale)
        if out is not None:  # None: no instance for this G and head dim; gathered below
            return out.view(B, H_q, D).to(q.dtype)
    seq_lens, page = seq_lens.long(), sel.long()
    slot_ok = torch.arange(S, device=dev) < n_sel[..., None]
    page_ok = slot_ok & (page * P < seq_lens[:, None, None])  # (B, H_kv, S)
    page = torch.where(page_ok, page, 0)  # padding and pages past the end: never look them up
    phys = page_table.long().gather(1, page.view(B, H * S)).view(B, H, S)
    first = torch.where(seq_lens > 0, page_table[:, 0].long(), 0)  # an empty row's table: anything
    phys = torch.where(page_ok, phys, first[:, None, None])  # a real page, read for nothing
    heads = torch.arange(H, device=dev)[:, None]
    krow, vrow = phys * ks + heads * kh, phys * vs + heads * vh  # (B, H_kv, S)
    # tokens to read from the start of each selected page: all, the partial last page's, or none
    cnt = torch.where(page_ok, (seq_lens[:, None, None] - page * P).clamp(max=P), 0)
    ok = (torch.arange(P, device=dev) < cnt[..., None]).view(B, H, 1, S * P)
    qg, out = qg.to(k_cache.dtype), qg.new_empty(qg.shape, dtype=k_cache.dtype)
    c = max(1, SPARSE_CHUNK_BYTES // (2 * H * S * P * D * k_cache.element_size()))
    kb, vb = (torch.empty(min(c, B) * H * S, P * D, dtype=x.dtype, device=dev) for x in (kr, vr))
    for b0 in range(0, B, c):
        b1 = min(B, b0 + c)
        n = (b1 - b0) * H * S
        k, v = (torch.index_select(rows, 0, idx[b0:b1].reshape(-1), out=buf[:n])
                .view(b1 - b0, H, S * P, D) for rows, idx, buf in ((kr, krow, kb), (vr, vrow, vb)))
        out[b0:b1] = F.scaled_dot_product_attention(qg[b0:b1], k, v, attn_mask=ok[b0:b1],
                                                    scale=scale)
    # nothing valid (an empty row or selection): 0
    out = torch.where(ok.any(-1, keepdim=True), out, 0.0)
    return out.view(B, H_q, D).to(q.dtype)


def attend_runs_cpu(q, k, v, lens=None, scale=None, tail=1):
    """Dense decode attention of q (B, H_kv, M, D), the M queries of each KV head, over K, V
    (B, H_kv, T, D) views whose tokens are contiguous (any row and head strides: the engine's
    lanes, read in place), the first lens[b] keys of row b (None: all T), in the C++ kernel.
    tail = T > 1: a speculative verify, M = G * T queries ordered g * T + i (token i), the last T
    of a row's keys its new tokens, which query i sees up to its own (attend_runs_ref).
    -> (out (B, H_kv, M, D) float32, lse (B, H_kv, M) float32), a query with no key giving zeros
    and -inf. The path is run_path's: a decode step's few queries through Few or the one pass
    with them in registers, a verify or more queries in blocks of keys for all of them. None
    without the kernel or where it has no instance (decode: D not in 32, 64, 128; blocks: D not
    a multiple of the vector width, 8 or 16 floats): the caller runs SDPA, or for a verify its
    two-part path."""
    ext = cpu_kernel()
    D = q.shape[-1]
    if (ext is None or q.is_cuda or any(t.stride(-1) != 1 or t.stride(-2) != D for t in (k, v))
            or k.dtype != v.dtype or (tail > 1 and not BLOCKS)):
        return None
    lens = None if lens is None else lens.int().contiguous()
    path = run_path(q.shape[2], D, k.shape[2], tail, getattr(ext, "lanes", 8))
    res = ext.attend_runs(q.float().contiguous(), k, v, lens, D ** -0.5 if scale is None else scale,
                          tail, path)
    return tuple(res) if res else None


def attend_lanes_cpu(q, k_pool, v_pool, layer, first, size, T, lens=None):
    """attend_runs_cpu over the engine's lanes without views: row b's keys of KV head h in
    `layer` are the first lens[b] (None: T) of the T token slots from first + b * size of
    k_pool, v_pool (L, H_kv, N, D) (kvcache's pool). q (B, H_q, 1, D) float32 contiguous, a decode
    step's queries. -> out (B, H_q, 1, D) float32, or None where attend_runs_cpu would give None
    (the caller takes that path). One C++ call where the views cost about ten ops a layer."""
    ext, D = cpu_kernel(), q.shape[-1]
    if (ext is None or q.is_cuda or q.dtype != torch.float32 or not q.is_contiguous()
            or k_pool.dtype != torch.float32  # a bf16 pool: q is rounded to it (the views' path)
            or not (k_pool.is_contiguous() and v_pool.is_contiguous())):
        return None
    path = run_path(q.shape[1] // k_pool.shape[1], D, T, 1, getattr(ext, "lanes", 8))
    res = ext.attend_lanes(q, k_pool, v_pool, layer, first, size, T, lens, D ** -0.5, path)
    return res[0] if res else None


def write_tokens_cpu(k_pool, v_pool, layer, k, v, dst):
    """The new tokens' K and V (B, H_kv, T, D) float32 into slots dst (B * T,) int64 (token t of
    row b: dst[b * T + t]) of `layer` of k_pool, v_pool (L, H_kv, N, D): kvcache's two
    index_copy_ calls in one C++ call. -> False where it does not apply (no kernel, another
    dtype, a pool that is not contiguous): nothing written, the caller's index_copy_ runs."""
    if (k.is_cuda or k.dtype != torch.float32 or dst.dtype != torch.long  # before the kernel:
            or k_pool.dtype not in (torch.float32, torch.bfloat16, torch.float16)  # a GPU run
            or not (k_pool.is_contiguous() and v_pool.is_contiguous())):  # never builds it
        return False
    ext = cpu_kernel()
    if ext is None:
        return False
    ext.write_tokens(k_pool, v_pool, layer, k, v, dst)
    return True


def attend_runs_ref(q, k, v, lens=None, scale=None, tail=1):
    """attend_runs_cpu in plain PyTorch, fp32: row b's first lens[b] keys, query m of a KV head
    seeing those before lens[b] - tail + 1 + m % tail (a verify's causal mask; tail = 1: all).
    -> (out, lse); a query with no key: zeros and -inf."""
    B, H, M, D = q.shape
    T, dev = k.shape[2], q.device
    n = torch.full((B,), T, device=dev) if lens is None else lens.long().clamp(max=T)
    limit = n[:, None] - tail + 1 + torch.arange(M, device=dev) % tail  # (B, M)
    see = (torch.arange(T, device=dev) < limit[..., None])[:, None]  # (B, 1, M, T)
    s = (q.float() @ k.float().transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    lse = s.masked_fill(~see, -math.inf).logsumexp(-1)  # (B, H, M)
    p = (s - lse[..., None]).exp().masked_fill(~see, 0.0)  # no key: lse -inf, every weight 0
    return p @ v.float(), lse


# -----------------------------------------------------------------------------
# Benchmark


def _bench(B=8, T=9, contexts=(1024, 2048, 4096), shapes=((2, 2, 32), (8, 2, 128)), rounds=5):
    """ns per cached key and KV head, 1 thread: a decode step's G queries through each of the
    three paths (Few, the one pass, blocks; `*` marks run_path's pick) against a verify's G * T,
    in blocks and in the one-pass kernel's chunks of 8 (its path before the blocks: its cached
    part only, the T x T part apart); K and V fp32 in lanes, 64 MB of them (layers), read from
    memory."""
    torch.set_num_threads(1)
    ext = cpu_kernel()
    for H, G, D in shapes:
        for n in contexts:
            L = max(1, (64 << 20) // (2 * B * H * n * D * 4))  # layers that make 64 MB of K and V
            kv = [[torch.randn(H, B, n + 64, D).transpose(0, 1) for _ in "kv"] for _ in range(L)]
            lens = torch.full((B,), n, dtype=torch.int32)
            q1, qT = torch.randn(B, H, G, D), torch.randn(B, H, G * T, D)
            # (queries, new tokens, tail, path)
            arms = {"decode, Few": (q1, 0, 1, FEW_PATH), "decode, one pass": (q1, 0, 1, ONLINE),
                    "decode, blocks": (q1, 0, 1, BLOCK_PATH),
                    "verify, blocks": (qT, T, T, BLOCK_PATH), "verify, chunks": (qT, 0, 1, ONLINE)}
            best = dict.fromkeys(arms, math.inf)
            for _ in range(rounds):  # the arms take turns: a machine's load hits them all
                for arm, (q, new, tail, path) in arms.items():
                    t0 = time.perf_counter()
                    for k, v in kv:
                        ext.attend_runs(q, k[:, :, :n + new], v[:, :, :n + new], lens + new,
                                        D ** -0.5, tail, path)
                    best[arm] = min(best[arm], (time.perf_counter() - t0) / (L * B * H * n))
            pick = {FEW_PATH: "decode, Few", ONLINE: "decode, one pass",
                    BLOCK_PATH: "decode, blocks"}[run_path(G, D, n, 1, ext.lanes)]
            print(f"H_kv {H}, G {G}, D {D}, {n} keys: " + ", ".join(
                f"{a}{'*' if a == pick else ''} {t * 1e9:.1f} ns" for a, t in best.items())
                + f"; verify / decode {best['verify, blocks'] / best[pick]:.2f}x")


if __name__ == "__main__":
    if cpu_kernel() is None:
        raise SystemExit("no C++ kernel here")
    _bench()
