"""
zeros_kernels/block_sparse_bench.py: the benchmark of block_sparse_decode.py's kernel, and the
paged problems it and bench/gpu.py time.

    python -m zeros_kernels.block_sparse_bench

With CUDA: the Triton kernel against SDPA over the whole (unpaged) cache and FlexAttention over the
same selected pages, in microseconds and GB/s, each output checked against the PyTorch reference
first. Without: the PyTorch reference against the CPU fast path (sparse_decode_cpu) on the engine's
head-major layout, at three page budgets.
"""

import time

import torch
import torch.nn.functional as F
import triton

from zeros_kernels.block_sparse_decode import (block_sparse_decode, block_sparse_decode_ref,
                                               dense_selection)
from zeros_kernels.sparse_decode_cpu import sparse_decode_cpu



def make_problem(B, H_kv, G, D, page_size, context, budget_pages, dtype, device, seed=0):
    """Full-length sequences in a shuffled paged cache, and a Sparrow-style selection per (sequence,
    KV head): the first page, the two most recent pages, and random others, sorted."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    max_pages = triton.cdiv(context, page_size)
    num_pages = B * max_pages
    k_cache = torch.randn(num_pages, page_size, H_kv, D, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_pages, page_size, H_kv, D, generator=gen).to(device, dtype)
    q = torch.randn(B, G * H_kv, D, generator=gen).to(device, dtype)
    page_table = torch.randperm(num_pages, generator=gen).view(B, max_pages).to(device, torch.int32)
    seq_lens = torch.full((B,), context, dtype=torch.int32, device=device)
    budget = min(budget_pages, max_pages)
    if budget == max_pages:
        sel, n_sel = dense_selection(page_table, seq_lens, H_kv, page_size)
        return q, k_cache, v_cache, page_table, seq_lens, sel.contiguous(), n_sel.contiguous()
    middle = torch.rand(B, H_kv, max_pages - 3, generator=gen).argsort(-1)[..., :budget - 3] + 1
    edges = torch.tensor([0, max_pages - 2, max_pages - 1]).expand(B, H_kv, 3)
    sel = torch.cat([edges, middle], -1).sort(-1).values.to(device, torch.int32)
    n_sel = torch.full((B, H_kv), budget, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, page_table, seq_lens, sel, n_sel


def bytes_read(k_cache, page_table, seq_lens, sel, n_sel):
    """Bytes of K and V that a page-reading kernel actually loads: valid tokens of selected
    pages."""
    _, P, H_kv, D = k_cache.shape
    slot_ok = torch.arange(sel.shape[2], device=sel.device) < n_sel[..., None]
    tokens = (seq_lens.long()[:, None, None] - sel.long() * P).clamp(0, P) * slot_ok
    return int(tokens.sum()) * D * 2 * k_cache.element_size()


def bench_cuda(configs):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    print(f"{'B':>3} {'Hkv':>3} {'G':>2} {'D':>4} {'ctx':>6} {'pages':>6} | "
          f"{'kernel us':>9} {'GB/s':>6} | {'SDPA dense us':>13} {'GB/s':>6} | {'flex us':>8} "
          f"{'GB/s':>6}")
    for B, H_kv, G, D, page_size, context, budget in configs:
        q, k_cache, v_cache, page_table, seq_lens, sel, n_sel = make_problem(
            B, H_kv, G, D, page_size, context, budget, torch.bfloat16, "cuda")
        max_pages, scale = page_table.shape[1], D ** -0.5
        out = block_sparse_decode(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel)
        ref = block_sparse_decode_ref(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel)
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 2e-2, f"kernel differs from the reference by {err}"

        # the unpaged copy that SDPA and FlexAttention read: (B, H_kv, T, D)
        kc = k_cache[page_table.long()].flatten(1, 2).transpose(1, 2).contiguous()
        vc = v_cache[page_table.long()].flatten(1, 2).transpose(1, 2).contiguous()
        q4 = q[:, :, None, :]  # (B, H_q, 1, D)
        # FlexAttention on the same logical pages, one KV block per page. The selection is per KV
        # head, and flex's decoding kernel takes a per-head block mask only without GQA, so the G
        # queries of a group go in as G query positions of one head: (B, H_kv, G, D).
        kv_indices = torch.zeros(B, H_kv, 1, max_pages, dtype=torch.int32, device="cuda")
        kv_indices[..., :sel.shape[2]] = sel[:, :, None]
        block_mask = BlockMask.from_kv_blocks(
            n_sel[..., None].contiguous(), kv_indices, BLOCK_SIZE=(128, page_size),
            seq_lengths=(G, max_pages * page_size), compute_q_blocks=False,
            mask_mod=lambda b, h, q_idx, kv_idx: kv_idx < seq_lens[b])
        q_groups = q.view(B, H_kv, G, D)

        run_kernel = lambda: block_sparse_decode(q, k_cache, v_cache, page_table, seq_lens, sel,
                                                 n_sel)
        run_sdpa = lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True)
        run_flex = lambda: flex(q_groups, kc, vc, block_mask=block_mask, scale=scale)
        flex_err = (run_flex().reshape(B, H_kv * G, D).float() - ref.float()).abs().max().item()
        assert flex_err < 2e-2, f"FlexAttention differs from the reference by {flex_err}"

        sparse_bytes = bytes_read(k_cache, page_table, seq_lens, sel, n_sel)
        dense_bytes = kc.numel() * kc.element_size() * 2
        t_kernel, t_sdpa, t_flex = (triton.testing.do_bench(f) * 1e3
                                    for f in (run_kernel, run_sdpa, run_flex))
        gbs = lambda nbytes, us: nbytes / us / 1e3
        print(f"{B:>3} {H_kv:>3} {G:>2} {D:>4} {context:>6} {int(n_sel.max()):>6} | "
              f"{t_kernel:>9.1f} {gbs(sparse_bytes, t_kernel):>6.0f} | "
              f"{t_sdpa:>13.1f} {gbs(dense_bytes, t_sdpa):>6.0f} | "
              f"{t_flex:>8.1f} {gbs(sparse_bytes, t_flex):>6.0f}")


def bench_cpu():
    print("no CUDA: the PyTorch reference against the CPU fast path (sparse_decode_cpu) on the "
          "engine's head-major layout")
    for budget in (8, 32, 128):  # 128 pages of 16 = the whole 2,048-token context: dense
        q, k, v, *rest = make_problem(4, 2, 4, 64, 16, 2048, budget, torch.float32, "cpu")
        hm = [c.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for c in (k, v)]
        ms = []
        for f, args in ((block_sparse_decode_ref, (q, k, v)), (sparse_decode_cpu, (q, *hm))):
            f(*args, *rest)  # warm up (and build the C++ kernel)
            t0 = time.perf_counter()
            for _ in range(10):
                f(*args, *rest)
            ms.append((time.perf_counter() - t0) / 10 * 1e3)
        print(f"B=4 H_kv=2 G=4 D=64 ctx=2048 pages read={budget:>4}: reference {ms[0]:.2f} ms, "
              f"fast path {ms[1]:.2f} ms")


if __name__ == "__main__":
    if torch.cuda.is_available():
        # (B, H_kv, G, D, page_size, context, pages selected); Qwen3-1.7B has H_kv=8, G=2, D=128
        bench_cuda([
            (1, 8, 2, 128, 16, 32768, 2048),  # dense: everything selected
            (1, 8, 2, 128, 16, 32768, 128),  # a 2,048-token budget at 32K, batch 1: splits matter
            (16, 8, 2, 128, 16, 32768, 128),
            (16, 8, 2, 128, 16, 32768, 2048),
            (64, 8, 2, 128, 16, 8192, 128),
            (16, 8, 4, 128, 64, 32768, 32),  # 64-token pages
        ])
    else:
        bench_cpu()
