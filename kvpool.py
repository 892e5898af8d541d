"""
kvpool.py: stage 2, the KV cache's storage, kept across generate calls: flat buffers that each
call's kvcache.PagedKVCache views from their start, sized in tokens, of their own dtype.

    pool = KVPool(tokens=65536)      # a cap (0: none, grown when a call needs more)
    Engine(model, tokenizer, pool=pool)   # engines given one pool share its memory
    pool.nbytes()                    # what it holds

Simplifications:
    1. One buffer per (name, dtype): a call that needs more than a buffer holds (or on another
       device) drops it and makes a larger one; nothing shrinks.
"""

import math

import torch


class KVPool:
    """The KV cache's storage, kept across generate calls: flat buffers (K, V, the sparse page
    metadata) that each call's PagedKVCache views from their start. So a run allocates its pool
    once and reuses it (freeing and reallocating tens of GiB a call fragments the GPU's memory),
    and the engines that share one (rollout, dense comparison, held-out evaluation) share the
    memory. tokens: the capacity every call must fit, rounded up to pages (rollout.Engine splits
    a call that does not; 0: none, and a buffer grows when a call needs more than it holds). A
    buffer starts at zero and then holds the keys of earlier calls: finite either way, as the
    kernels need (they read the unwritten tail of a partial page)."""

    def __init__(self, tokens=0):
        self.tokens, self.bufs = tokens, {}

    def take(self, name, shape, numel, dtype, device):
        """A view of `shape` at the start of buffer (name, dtype), which is made afresh (zeros)
        where it holds fewer than max(numel, the view's) elements or lives on another device."""
        n, key = math.prod(shape), (name, dtype)
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < max(n, numel) or buf.device != torch.device(device):
            self.bufs.pop(key, None)  # the old one goes first: its memory can serve the new one
            buf = self.bufs[key] = torch.zeros(max(n, numel), dtype=dtype, device=device)
        return buf[:n].view(shape)

    def nbytes(self):
        return sum(b.numel() * b.element_size() for b in self.bufs.values())
