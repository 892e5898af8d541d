"""
lanes.py: stage 2, the KV cache's dense attention on a CPU, where each row's own tokens lie in a
lane: contiguous token slots of the pool, one run a (row, KV head). kvcache.PagedKVCache takes these
methods (it is a LaneAttention); they read its pools, lanes and the step's index tensors.

    y = cache._own_lanes(layer, q)       # a decode step, rows with no shared prompt: one C++ call
    y = cache._attend_lanes(kp, vp, qg)  # the views' path: a shared prompt, moved rows (reference)
    y = cache._attend_verify(layer, kp, vp, q, k, v)   # a speculative verify's T tokens a row

How it works:
    1. A decode step whose rows read only their own lanes (no shared prompt, the lanes in the
       rows' order) reads them in one call (`_own_lanes`: sparse_decode_cpu.attend_lanes_cpu finds
       each lane from the pool's offsets). Otherwise (`_attend_lanes`) the lanes are strided views
       of the pool, no copy, read by the same kernel (attend_rows); a shared prompt is read once
       per group and merged by log-sum-exp (shared_prefix_decode). The two give the same numbers
       (tests/test_lanes.py); the first saves about twenty small ops a layer, which is most of
       what a small model's step spends around its attention.
    2. A verify writes its T = k + 1 tokens' K and V over the draft's, then reads each lane once
       for all G * T queries of a KV head, causal on the new tokens (`_verify_lanes`); where the
       kernel has no instance, the lane as G * T queries of one decode step and the new tokens
       among themselves, merged. The reference (verify_ref, a GPU, the free list) gathers each
       row's cache through its page table and runs SDPA with begin_verify's mask.
    3. New tokens' K and V go into their slots in one C++ call (write_tokens_cpu); index_copy_
       is the reference, and the path on a GPU.
"""

import math

import torch.nn.functional as F

from zeros_kernels.block_sparse_decode import attend_rows, merge_attention, shared_prefix_decode
from zeros_kernels.sparse_decode_cpu import attend_lanes_cpu, attend_runs_cpu, write_tokens_cpu


class LaneAttention:
    """The dense attention of kvcache.PagedKVCache on a CPU's lanes, and its verify."""

    def _attend_verify(self, layer, kp, vp, q, k, v):  # q (B, Hq, T, D); k, v (B, Hkv, T, D)
        """The verify forward's dense attention: the T new tokens' K and V into their slots (over
        the draft's), the touched pages' metadata, then the lanes read in place (`_verify_lanes`)
        or, the reference, one gather of each row's cache through its page table and SDPA with the
        causal mask of `begin_verify`."""
        B, H, T, D = k.shape
        t0 = self._tick(None, 0.0)
        if not write_tokens_cpu(self.k, self.v, layer, k, v, self._dst):  # the reference:
            kp.index_copy_(1, self._dst, k.transpose(0, 1).reshape(H, B * T, D).to(kp.dtype))
            vp.index_copy_(1, self._dst, v.transpose(0, 1).reshape(H, B * T, D).to(vp.dtype))
        self._write_meta(layer, self._filled)
        if self._slots is None:
            y = self._verify_lanes(kp, vp, q, k.to(kp.dtype), v.to(vp.dtype))
            self._tick("attn", t0)
            return y
        S = self._slots.shape[1]
        # (B, Hkv, S, D): the pool is head-major, so one index_select over its token slots
        kc, vc = (p.index_select(1, self._slots.view(-1)).view(H, B, S, D).transpose(0, 1)
                  for p in (kp, vp))
        y = F.scaled_dot_product_attention(q, kc.to(q.dtype), vc.to(q.dtype), attn_mask=self._see,
                                           enable_gqa=True)
        self._tick("attn", t0)
        return y  # (B, Hq, T, D)

    def _own_lanes(self, layer, q):  # q (B, Hq, 1, D) -> (B, Hq, 1, D), or None
        """A decode step's dense attention where each row reads only its own lane (no shared
        prompt, lanes in the rows' order): attend_lanes_cpu, the lanes found from the pool's
        offsets in one C++ call. None elsewhere: `_attend_lanes`, the views' path, the
        reference (tests/test_lanes.py holds the two together)."""
        if self._pre or self._by_lane is not None or not self.lanes_fast:
            return None
        (S, P, R), ps = self.lanes, self.page_size
        return attend_lanes_cpu(q, self.k, self.v, layer, S * P * ps, R * ps, self._own,
                                self._own_lens)

    def _attend_lanes(self, kp, vp, qg, lse=False, tail=0):  # kp, vp (Hkv, N, D); qg (B, Hkv, M, D)
        """CPU dense attention on the lanes, for M queries a KV head (a decode step's G query
        heads, a verify's G * T): the live rows' own tokens are one strided view of the pool, read
        in place; a shared prompt is read once per group, merged by log-sum-exp. -> (B, Hkv, M,
        D), and with lse=True each query's log-sum-exp (B, Hkv, M) too. tail = T: a verify's T new
        tokens, in each lane right after the row's own, in the same pass, causal (the C++ kernel's
        blocks of keys, out only; None where it has none)."""
        (S, P, R), ps, H, D, B = self.lanes, self.page_size, self.H, self.D, qg.shape[0]
        # (n, Hkv, T, D) views, no copy: n runs of `size` token slots from slot `first`, cut to T
        runs = lambda t, first, n, size, T: (t[:, first:first + n * size].view(H, n, size, D)
                                             [:, :, :T].transpose(0, 1))
        if self._by_lane is not None:  # rows moved by _compact: q in lane order, and back below
            qg = qg.index_select(0, self._by_lane)
        own = [runs(t, S * P * ps, B, R * ps, self._own + tail) for t in (kp, vp)]
        pre = self._pre and [runs(t, 0, S, P * ps, self._pre[0]) for t in (kp, vp)]
        if tail:  # the lanes and their new tokens in one pass; the shared prompt apart, merged
            lens = None if self._own_lens is None else self._own_lens + tail
            y, ly = attend_runs_cpu(qg, *own, lens, tail=tail) or (None, None)
            if y is not None and pre:  # every query sees all of the prompt; its rows' queries
                _, n_pre, q_idx, slot, member, lone = self._pre  # as in shared_prefix_decode
                qp = qg.transpose(0, 1).index_select(1, q_idx).view(H, S, -1, D).transpose(0, 1)
                yp, lp = (t.unflatten(2, (q_idx.numel() // S, -1))[slot, :, member]
                          for t in attend_rows(qp, *pre, n_pre, lse=True))
                lp = lp if lone is None else lp.masked_fill(lone, -math.inf)  # rows without one
                y = merge_attention(y, ly, yp, lp)
            y = y if y is None else y.to(qg.dtype)
        elif pre is None:
            y = attend_rows(qg, *own, self._own_lens, lse=lse)
        else:
            y = shared_prefix_decode(qg, *own, self._own_lens, *pre, self._pre, lse=lse)
        if self._by_lane is None or y is None:
            return y
        back = lambda t: t.index_select(0, self._lane)  # (B, ...) lane order -> the rows' order
        return tuple(map(back, y)) if lse else back(y)

    def _verify_lanes(self, kp, vp, q, k, v):  # q (B, Hq, T, D); k, v (B, Hkv, T, D)
        """The verify's attention on a CPU's lanes. The T new tokens lie in each row's lane right
        after its cached ones (`_attend_verify` wrote them), so `_attend_lanes(tail=T)` reads the
        lane once for the G * T queries of a KV head, a block of keys at a time (the C++ kernel,
        causal on the new tokens). Without it (or BLOCKS off in sparse_decode_cpu), two parts
        merged by log-sum-exp: (a) the cache before the T, where every one of the T queries sees
        the same keys, as G * T queries of one decode step; (b) the T new tokens among
        themselves, causal: a (G * T) x T attention over the k and v the forward just made."""
        B, Hq, T, D = q.shape
        qg = q.reshape(B, self.H, -1, D)  # (B, Hkv, G * T, D): head h * G + g, token i -> g * T + i
        y = self._attend_lanes(kp, vp, qg.to(kp.dtype), tail=T)  # the pool's dtype
        if y is not None:
            return y.view(B, Hq, T, D).to(q.dtype)
        y, lse = self._attend_lanes(kp, vp, qg.to(kp.dtype), lse=True)
        s = (qg.float() @ k.float().transpose(-1, -2)) * D ** -0.5  # (B, Hkv, G * T, T)
        s = s.masked_fill(~self._causal, -math.inf)
        lse_new = s.logsumexp(-1)  # finite: every query sees itself
        y_new = (s - lse_new[..., None]).exp() @ v.float()
        return merge_attention(y, lse, y_new, lse_new).view(B, Hq, T, D).to(q.dtype)
