"""
zeros_kernels/sparse_decode_cpu.py: sparse decode on a CPU, beside block_sparse_decode.py's PyTorch
reference (same contract: q (B, H_q, D), a paged cache, page tables, the selected logical pages).

    ext = cpu_kernel()               # the C++ kernel of sparse_decode_cpu.cpp, or None
    sel, n_sel = select_pages_cpu(q, [kmean], table, n_pages, n_full, n_read)   # the engine's
    out = sparse_decode_cpu(q, k_cache, v_cache, table, seq_lens, sel, n_sel)   # selection, read
    out, lse = attend_runs_cpu(q4, k, v, lens)   # dense decode over contiguous runs (lanes)

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
       has no instance for the shape (the caller runs SDPA).

Simplifications:
    1. The gather path reads the unread tail of a partial page, so the cache must hold finite
       values there (the engine's pool starts at zero: decode_attention's finite=True).
    2. Ties between equal page scores may break another way than sparsity.select_pages'.
"""

import torch
import torch.nn.functional as F

from zeros_kernels.cpu_ext import load_cpu_ext


# Without the C++ kernel, the CPU fast path gathers the selected pages of a chunk of rows at a
# time into buffers of at most this many bytes (K and V together), which SDPA then reads back from
# the core's cache rather than from memory.
SPARSE_CHUNK_BYTES = 1 << 19


# the stored score of a page that was not full when scored (the C++ kernel's kUnscored): it is read
# until the next rescoring, as a page that fills between two scorings must be
UNSCORED = 3.0e38


def cpu_kernel():
    """The C++ kernel of sparse_decode_cpu.cpp, built on first use (zeros_kernels/cpu_ext.py), or None."""
    return load_cpu_ext("sparse_decode_cpu")


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


def attend_runs_cpu(q, k, v, lens=None, scale=None):
    """Dense decode attention of q (B, H_kv, M, D), the M queries of each KV head, over K, V
    (B, H_kv, T, D) views whose tokens are contiguous (any row and head strides: the engine's
    lanes, read in place), the first lens[b] keys of row b (None: all T), in the C++ kernel.
    -> (out (B, H_kv, M, D) float32, lse (B, H_kv, M) float32), a row with no key giving zeros and
    -inf. Any M (the queries go in chunks of 8, 4, 3, 2 or 1, each chunk reading the run while the
    last one left it in cache); None without the kernel or where it has no instance (D not in 32,
    64, 128): the caller runs SDPA."""
    ext = cpu_kernel()
    D = q.shape[-1]
    if (ext is None or q.is_cuda or any(t.stride(-1) != 1 or t.stride(-2) != D for t in (k, v))
            or k.dtype != v.dtype):
        return None
    lens = None if lens is None else lens.int().contiguous()
    res = ext.attend_runs(q.float().contiguous(), k, v, lens, D ** -0.5 if scale is None else scale)
    return tuple(res) if res else None
