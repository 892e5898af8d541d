"""
kvcache.py: stage 2, the paged KV cache that rollout.py's engine generates over: pages, page
tables, lanes, the shared prompt's pages, and the decode step's attention, dense or over the pages
a sparse selection picks.

    cache = PagedKVCache(model.config, num_seqs, max_pages, num_pages, page_size, dtype, device,
                         budget=fraction_budget(1 / 8), scorer="centroid", rescore_every=1,
                         pool=KVPool())  # storage kept across calls (None: the cache's own)
    cache.begin_prefill(groups)  # [(prompt length, rows)]: a shared prompt's full pages stored once
    rows = cache.begin_round(rows, slots, state)  # a round of static decode steps (decode.py)
    cache.lay_step(slots)        # each of its steps: the index tensors, on the device
    model(tokens, cache=cache)   # the model calls cache.positions, cache.attend, cache.advance
    cache.begin_decode(rows)     # the reference: one step's index tensors from the host's lists
    cache.begin_verify(rows, T)  # speculative decoding: T new tokens a row, dense, causal
    cache.truncate(row, n)       # and a row cut back to n tokens after a rejection

The engine (rollout.Engine) makes one per generate call and drives it; the model reaches it through
`positions`, `attend` (each layer) and `advance`. Its K, V and metadata are views of a KVPool,
storage that outlives the call: an engine's pool is allocated once and reused by every call.

What it holds:
    1. K and V pools, head-major (L, H_kv, num_pages * page_size, D): a KV head's token slots are
       contiguous. A prefix slot per shared prompt, then a lane per row that its own pages fill in
       order, so the live rows' own tokens are one strided view; rows move from the last lanes into
       those that finished rows free (`_compact`, CPU). Capped by `num_pages`, the pool hands out
       pages from a free list instead.
    2. Page tables on the host (lists) and the device (one int32 tensor), reference counts (a
       shared prompt page has one per row), and, for sparse decode, each full page's metadata (mean
       key; min and max keys for Quest), written once, when the page fills.
    3. Decode attention (`attend`): the new token's key and value go to the row's last page; dense
       on a CPU reads the lanes in place and each shared prompt once per group (merged by
       log-sum-exp; lanes.py, whose methods PagedKVCache takes from LaneAttention); sparse layers
       read the pages that `_select` picks (sparsity.select_pages over the scorer's page scores,
       or the C++ kernel's one call), through `decode_attention`.
    4. Rescoring (rescore_every = k > 1, centroid or Quest): the pages are scored once in every
       window of k decode steps, at a hashed offset (`rescores`: a fixed stride would alias with a
       task's rhythm), and the kept scores (L, N, H_kv, max_pages) serve the steps between; a
       page that filled since has none (UNSCORED) and is read until the next scoring, and a step
       whose rows and page counts are the last one's takes that step's pick as it is.
    5. Speculative decoding (rollout.Engine(speculative=k)): `begin_verify` lays out a verify
       forward, T = k + 1 tokens a row at positions lens[r] ..., whose `attend` writes their K and
       V over the draft's (pages opened as needed), rewrites the metadata of each page they touch
       that is full afterwards, and attends each new query to its row's cache up to itself (a
       gather through the page table and SDPA with a mask). `truncate` cuts a row back: its pages
       past the cut go back, a page left partial keeps stale metadata that nothing reads until it
       fills and is rewritten, and the lanes' index tensors (`_laid`) are rebuilt at the next
       decode step. Lanes and the free list both work: a lane's pages are its row's in order.

    6. Static decode steps (decode.py): `begin_round` opens the pages of a round's tokens and
       fills the slots' state in one copy; `lay_step` computes each step's index tensors from it
       on the device (slots of tokens to write, lengths, pages to read), which every layer shares.
       Padding slots write to the scratch page, the pool's last, past num_pages.

Simplifications:
    1. Page bookkeeping lives on the host as Python lists, once a round; the device gets the
       round's state in one host-to-device copy (`_upload`).
    2. The sparse budget is per row, the same in every sparse layer and KV head; the first
       `dense_layers` layers read every page.
"""

import math
import time

import torch
import torch.nn.functional as F

from zeros_kernels.block_sparse_decode import decode_attention, dense_slots, prefix_index
from zeros_kernels.sparse_decode_cpu import UNSCORED, cpu_kernel, select_pages_cpu, write_tokens_cpu
from kvpool import KVPool
from lanes import LaneAttention
from moe import record_routes
from sparsity import (centroid_scores, oracle_scores, page_metadata, pages_to_read, quest_scores,
                      select_pages)


def rescores(step, every):
    """Whether decode step `step` (from 1) scores the pages afresh, rescoring once in `every`
    steps on average. Not at a fixed stride: a task with a rhythm (a copy token every 2 steps)
    would meet a stride that divides into it at the same phase every time, and the same positions
    would always run on stale scores. Each window of `every` steps rescores once, at an offset
    that a hash of the window's index picks (window 0 at its first step: the first step has no
    scores yet), so every phase of any rhythm is rescored, and the gaps run 1 to 2 * every - 1."""
    if every <= 1:
        return True
    window, at = divmod(step - 1, every)
    x = (window * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF  # splitmix64's mixer: the offsets
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF  # look random mod any k
    return at == (0 if window == 0 else (x ^ (x >> 27)) % every)


class PagedKVCache(LaneAttention):
    """K and V pools, a page table per sequence (logical -> physical page), reference counts, and
    lanes = (S prefix slots of P pages, R pages a row) or a free list (lanes=None). The engine lays
    out a forward (`begin_prefill`, `begin_decode`); the model calls positions, attend, advance."""

    def __init__(self, cfg, num_seqs, max_pages, num_pages, page_size, dtype, device, budget=None,
                 scorer="centroid", keep_first=1, keep_recent=2, dense_layers=2, lanes=None,
                 rescore_every=1, pool=None):
        L, self.H, self.D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.G = cfg.num_attention_heads // self.H  # query heads per KV head
        self.page_size, self.num_pages, self.lanes = page_size, num_pages, lanes
        pool = pool if pool is not None else KVPool()  # none given: storage of its own
        # a capped pool is allocated whole, at its first call; one page more, the last: the
        # scratch page that a static decode step's padding slots write to (decode.py)
        self.scratch, n = num_pages, num_pages + 1
        room = max(num_pages, -(-pool.tokens // page_size)) + 1
        take = lambda name, *shape: pool.take(name, (L, *shape), L * math.prod(shape) // n * room,
                                              dtype, device)
        # (L, H_kv, (num_pages + 1) * page_size, D): head-major, so that a run of token slots of
        # one KV head is contiguous memory; `paged` shows a layer in the kernel's layout
        self.k = take("k", self.H, n * page_size, self.D)
        self.v = take("v", self.H, n * page_size, self.D)
        meta = (n, self.H, self.D)  # page metadata, kept only where a selection reads it
        self.kmean = take("kmean", *meta) if budget is not None else None
        quest = budget is not None and scorer == "quest"
        self.kmin = take("kmin", *meta) if quest else None
        self.kmax = take("kmax", *meta) if quest else None
        # (N + 1, max_pages) the device copy of every page table: logical page -> physical page
        # id; row N, the padding slots' row, is all the scratch page
        self.table = torch.zeros(num_seqs + 1, max_pages, dtype=torch.int32, device=device)
        self.table[num_seqs] = self.scratch
        self.pages = [[] for _ in range(num_seqs)]  # the host's copy of each page table
        self.n_shared = [0] * num_seqs  # the shared prompt pages that open each page table
        self.lens = [0] * num_seqs  # tokens cached per sequence
        self.refs = [0] * num_pages  # sequences holding each page: a shared prompt page has G
        # the free list (pop() hands out low ids first), or, with lanes, each row's lane
        self.free = list(range(num_pages - 1, -1, -1)) if lanes is None else None
        self.lane = list(range(num_seqs)) if lanes is not None else None
        self.prefixes = []  # (shared tokens, rows) of the shared prompt in each prefix slot
        self.used = self.peak = 0  # pages held now, and at most
        self.budget, self.scorer, self.dense_layers = budget, scorer, dense_layers
        self.keep_first, self.keep_recent = keep_first, keep_recent
        # page scores kept between rescorings (rescore_every > 1): (L, N + 1, H_kv, max_pages)
        self.rescore_every, self.scores, self._last = rescore_every, None, {}
        self.step = 1  # the decode step (the completion position it produces), set by the engine
        if budget is not None and rescore_every > 1 and scorer != "oracle":
            self.scores = torch.full((L, num_seqs + 1, self.H, max_pages), UNSCORED,
                                     device=device)
        self.record = None  # a list to record (step, rows, layer, sel, n_sel) of every selection
        self.clock, self.routes = None, record_routes(None, 0)  # the engine's hooks (Engine.clock)
        # (L,) pages the sparse layers' selections read, summed over KV heads and steps (the
        # engine adds the dense layers' and divides by H_kv): the read fraction, counted
        self.read_layer = torch.zeros(L, dtype=torch.long, device=device)
        self._laid = None  # the rows the lanes' index tensors were built for
        self._budget = None  # static steps: pages the budget reads at 0..max_pages pages
        self.fills = True  # static steps: False where the host knows that no page fills
        # True: a verify attends through the gather + SDPA reference even on a CPU's lanes (tests)
        self.verify_ref = False
        # False: a decode step reads the lanes through views (`_attend_lanes`), the reference of
        # `_own_lanes`' one call (tests)
        self.lanes_fast = True

    # ---- bookkeeping

    def _take(self, p, holders):
        """Hold page p (None: the free list's next) for `holders` sequences."""
        if p is None:
            if not self.free:
                raise RuntimeError(f"the KV pool is out of pages ({self.num_pages}): raise "
                                   f"Engine(num_pages=...) or leave it None")
            p = self.free.pop()
        self.refs[p], self.used = holders, self.used + 1
        self.peak = max(self.peak, self.used)
        return p

    def _lane_page(self, seq, i):  # page i of the lane of sequence seq
        return self.lanes[0] * self.lanes[1] + self.lane[seq] * self.lanes[2] + i

    def _alloc(self, seq):
        """The next page of `seq`'s own: the next one of its lane, or the free list's."""
        own = len(self.pages[seq]) - self.n_shared[seq]
        self.pages[seq].append(self._take(self._lane_page(seq, own) if self.lanes else None, 1))
        return self.pages[seq][-1]

    def release(self, seq):
        """A finished sequence gives its pages back (a shared one when its last holder leaves)."""
        for p in self.pages[seq]:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.used -= 1
                if self.free is not None:
                    self.free.append(p)
        self.pages[seq] = []

    def _compact(self, rows):
        """Lanes: the live rows in lanes >= B = len(rows) move to those below B that rows left."""
        holes = sorted(set(range(len(rows))) - {self.lane[r] for r in rows})
        if not holes:  # the rows hold the first lanes already (a verify's rows: the draft's)
            return
        src, dst, table = [], [], []  # pages; the moved rows' new table entries
        for r, lane in zip([r for r in rows if self.lane[r] >= len(rows)], holes):
            n, self.lane[r] = self.n_shared[r], lane
            src += self.pages[r][n:]
            self.pages[r][n:] = [self._lane_page(r, i) for i in range(len(self.pages[r]) - n)]
            dst += self.pages[r][n:]
            table += [(r, n + i, p) for i, p in enumerate(self.pages[r][n:])]
        self._set_table(table)
        s, d = self._upload(src, dst)
        for pool in (self.k, self.v):
            pages = pool.unflatten(2, (-1, self.page_size))  # (L, H_kv, pages, page_size, D)
            pages[:, :, d] = pages[:, :, s]
        for meta in filter(lambda t: t is not None, (self.kmean, self.kmin, self.kmax)):
            meta[:, d] = meta[:, s]  # (L, pages, H_kv, D)
        for a, b in zip(src, dst):
            self.refs[a], self.refs[b] = 0, 1

    def paged(self, pool, layer):  # a layer of self.k or .v as (num_pages, page_size, H_kv, D)
        return pool[layer].view(self.H, -1, self.page_size, self.D).permute(1, 2, 0, 3)

    def _write_meta(self, layer, pages):
        """Metadata of the pages that just filled (index tensor), read by every later step."""
        if pages is None or self.kmean is None:
            return
        mean, lo, hi = page_metadata(self.paged(self.k, layer)[pages], self.kmin is not None)
        self.kmean[layer][pages] = mean.to(self.kmean.dtype)
        if lo is not None:
            self.kmin[layer][pages], self.kmax[layer][pages] = (lo.to(self.kmin.dtype),
                                                                hi.to(self.kmax.dtype))

    # ---- laying out a forward

    def begin_prefill(self, groups):
        """groups[i] = (length, rows): batch row i is a prompt whose KV belongs to all of `rows`.
        Shared by several rows, its full pages are stored once (refs = len(rows)) and its partial
        last page once per row (eager copy-on-write); a prompt of one row is all its own."""
        ps, dev = self.page_size, self.table.device
        src_b, src_t, dst, full, table = [], [], [], [], []
        host = lambda x: torch.tensor(x, dtype=torch.long, device="cpu")  # to the device below

        def store(i, t, pages, first):  # tokens t of batch row i go to pages from token first
            src_b.append(torch.full_like(t, i))
            src_t.append(t)
            dst.append(host(pages)[(t - first) // ps] * ps + t % ps)
        for i, (L, rows) in enumerate(groups):
            n_sh = L // ps if len(rows) > 1 else 0
            first = len(self.prefixes) * (self.lanes[1] if self.lanes else 0)  # its prefix slot
            shared = [self._take(first + j if self.lanes else None, len(rows)) for j in range(n_sh)]
            self.prefixes += [(n_sh * ps, rows)] if n_sh else []
            store(i, torch.arange(n_sh * ps, device="cpu"), shared, 0)
            own = torch.arange(n_sh * ps, L, device="cpu")  # the tokens each row stores for itself
            for r in rows:
                self.pages[r], self.n_shared[r] = list(shared), n_sh
                mine = [self._alloc(r) for _ in range(-(-len(own) // ps))]
                store(i, own, mine, n_sh * ps)
                self.lens[r] = L
                table += [(r, j, p) for j, p in enumerate(self.pages[r])]
                full += mine[:len(own) // ps]
            full += shared
        self._set_table(table)
        self._mode, self._B, self._groups = "prefill", len(groups), groups
        # (3, tokens): batch row, position, slot of each prompt token; one copy to the device
        self._scatter = torch.stack([torch.cat(x) for x in (src_b, src_t, dst)]).to(dev).unbind(0)
        self._filled = torch.tensor(full, dtype=torch.long, device=dev) if full else None

    def _upload(self, *parts):
        """Lists of ints -> int64 tensors on the cache's device, in one host-to-device copy: a
        step's small index tensors (a copy each would cost a transfer and a sync each)."""
        flat = [x for part in parts for x in part]
        # CPU-GPU sync point: a copy from pageable host memory waits for the device's stream
        return torch.tensor(flat, dtype=torch.long, device=self.table.device).split(
            [len(part) for part in parts])

    def _set_table(self, entries):
        """(row, logical page, physical page) triples into the device's page tables, one copy:
        the device table follows the host's lists."""
        if entries:
            r, j, p = self._upload([x for e in entries for x in e])[0].view(-1, 3).unbind(1)
            self.table[r, j] = p.to(torch.int32)

    def begin_decode(self, rows):
        """One new token for each live sequence in `rows`: open a page where the last one is full,
        then build the step's index tensors, which every layer shares."""
        ps, cpu = self.page_size, not self.table.is_cuda
        if self.lanes is not None and cpu and rows != self._laid:  # rows left since last step
            self._compact(rows)  # (a GPU reads through the page tables: lanes need no order)
        opened = [(r, len(self.pages[r]), self._alloc(r)) for r in rows if self.lens[r] % ps == 0]
        lens = [self.lens[r] for r in rows]  # before the new token: its position
        last = [self.pages[r][n // ps] for r, n in zip(rows, lens)]  # the new token's page
        self.n_pages = [n // ps + 1 for n in lens]  # pages cached once the new token is in
        n_full = [(n + 1) // ps for n in lens]
        filled = [p for p, n in zip(last, lens) if (n + 1) % ps == 0]
        self.n_read, sparse = self.n_pages, self.budget is not None
        if sparse:
            self.n_read = [pages_to_read(self.budget, n, f, self.keep_first, self.keep_recent)
                           for n, f in zip(self.n_pages, n_full)]
        # the step's index tensors in one copy; dst: the flat slot (page * page_size + offset)
        # that each new token's K and V go to
        pos, dst, rows_t, counts, filled_t, new = self._upload(
            lens, [p * ps + n % ps for p, n in zip(last, lens)], rows,
            self.n_pages + n_full + self.n_read if sparse else [], filled,
            [x for o in opened for x in o])
        if opened:  # the new pages: the device table follows the host's lists
            r, j, p = new.view(-1, 3).unbind(1)
            self.table[r, j] = p.to(torch.int32)
        self._mode, self._rows = "decode", rows
        self._pos, self._dst = pos[:, None], dst  # (B, 1), (B,)
        self._seq_lens = (pos + 1).to(torch.int32)  # (B,) the new one in
        # (B, P) the live rows' tables, cut to the pages in use: P = the longest row's page count
        self._table = self.table[rows_t, :max(self.n_pages)]
        # CPU dense decode without lanes gathers every cached token: slots built once, all layers
        gather = cpu and self.lanes is None
        self._slots = dense_slots(self._table, self._seq_lens, ps) if gather else None
        if self.lanes is not None and cpu:
            self._lay_lanes(rows, lens)
        self._filled = filled_t if filled else None
        if sparse:  # n_pages, n_full, n_read (B,) int32 each
            self._counts = list(counts.to(torch.int32).view(3, -1))
        self._k_read, self._rescore = max(self.n_read), rescores(self.step, self.rescore_every)
        if self.scores is not None:  # kv_rescore_every: the rows' scores and the step's key
            self._rows_t = rows_t
            self._key = (tuple(rows), tuple(self.n_pages), tuple(n_full), tuple(self.n_read))

    def _lay_lanes(self, rows, lens, new=1):
        """The index tensors of `_attend_lanes`, rebuilt when the live rows change: lane order, own
        tokens per lane (+new a call: 1 a decode step, 0 for a verify's cached part), the shared
        prompts' queries (prefix_index) and lengths."""
        B, dev = len(rows), self.table.device
        if rows != self._laid:
            self._laid, lane = list(rows), [self.lane[r] for r in rows]  # a permutation of 0..B-1
            self._lane = torch.tensor(lane, device=dev)  # live row j sits in lane lane[j]
            order = sorted(range(B), key=lane.__getitem__)  # the live row in each lane
            self._by_lane = None if order == list(range(B)) else torch.tensor(order, device=dev)
            own = [lens[j] - self.n_shared[rows[j]] * self.page_size for j in order]
            self._own_max, self._steps = max(own), 0
            self._own_base = None if min(own) == max(own) else torch.tensor(own, device=dev)
            slot = {r: s for s, (_, rs) in enumerate(self.prefixes) for r in rs}
            self._pre = prefix_index([slot.get(rows[j], -1) for j in order],
                                     [n for n, _ in self.prefixes], dev)
        self._steps += new  # the new token
        self._own = self._own_max + self._steps
        self._own_lens = None if self._own_base is None else self._own_base + self._steps

    # ---- a round of static decode steps (decode.py): laid once on the host, stepped on the device

    def begin_round(self, rows, s, state, fixed=False):
        """A round of static decode steps (decode.py) for `rows` -> them in slot order: on a CPU
        with lanes they move into lanes 0..n-1 (`_compact`) and take the slots in lane order
        (slot j reads lane j in place); elsewhere as given. Then pages for each row's next
        tokens, and the slots `s` (B >= n of them; the rest padding, which writes to the
        scratch page) filled in one copy: rows, cached lengths, shared prompt tokens, page
        tables, the budget per page count, and the engine's state(row) = (tokens ahead, last
        token, completion position, limit). fixed: the lanes' views keep one width (the whole
        lane: a compiled or captured step's shapes), else the round's longest."""
        ps, B, n, P = self.page_size, s.rows.shape[0], len(rows), s.table.shape[1]
        if self.lanes is not None and not self.table.is_cuda:
            self._compact(rows)
            rows = sorted(rows, key=self.lane.__getitem__)
        ahead, tok, pos, limit = zip(*map(state, rows))
        opened = [(r, len(self.pages[r]), self._alloc(r)) for r, a in zip(rows, ahead)
                  for _ in range(max(0, -(-(self.lens[r] + a) // ps) - len(self.pages[r])))]
        if self.budget is not None and self._budget is None:  # once a call: pages_to_read at
            self._budget = [pages_to_read(self.budget, i, i - f, self.keep_first,  # n = i pages,
                                          self.keep_recent) for i in range(P + 1)  # the last
                            for f in (0, 1)]  # full (f = 0) or partial, at 2i + f
            self._k_read = max(self._budget)  # the selections' width: the most a step reads
        pad = [0] * (B - n)
        ints, live, budget, new = self._upload(
            [*rows, *[len(self.pages)] * (B - n), *tok, *pad]
            + [self.lens[r] for r in rows] + pad + [*pos, *pad, *limit, *pad]
            + [self.n_shared[r] * ps for r in rows] + pad, [1] * n + pad, self._budget or [],
            [x for o in opened for x in o])
        if opened:  # the device table follows the host's lists
            r, j, p = new.view(-1, 3).unbind(1)
            self.table[r, j] = p.to(torch.int32)
        s.ints.copy_(ints.view(6, B))
        s.live.copy_(live)
        s.table.copy_(self.table[s.rows, :P])
        s.n, s.host_rows, self._laid, self._s = n, list(rows), None, s
        if self.budget is not None:
            s.budget.copy_(budget)
        if self.lanes is not None and not self.table.is_cuda:  # slot j reads lane j in place
            slot = {r: i for i, (_, rs) in enumerate(self.prefixes) for r in rs}
            self._pre = prefix_index([slot.get(r, -1) for r in rows] + [-1] * (B - n),
                                     [m for m, _ in self.prefixes], self.table.device)
            own = max(self.lens[r] - self.n_shared[r] * ps + a for r, a in zip(rows, ahead))
            self._by_lane = None  # lengths: lay_step's
            self._own = self.lanes[2] * ps if fixed else max(own, 1)
        return rows

    def lay_step(self, s):
        """One static decode step's index tensors, from the slots' state on the device: no host
        list and no copy, so that the step compiles and captures (decode.py). The new token goes
        to the slot's page for position lens; a page that fills gets its metadata (the others'
        writes go to the scratch page); sparse: the pages to read from the budget table."""
        ps, cpu, lens = self.page_size, not s.lens.is_cuda, s.lens
        at, lens1 = lens // ps, lens + 1  # the new token's logical page; the tokens with it
        page = s.table.gather(1, at[:, None])[:, 0].long()  # (B,) its physical page
        self._mode, self._s, self._rows, self._rows_t = "step", s, s.host_rows, s.rows
        self._pos, self._dst = lens[:, None], page * ps + lens % ps  # (B, 1), (B,)
        self._seq_lens, self._table, self._key = lens1, s.table, None  # (B,) the new one in
        self._rescore = rescores(self.step, self.rescore_every)
        self._filled = None  # a page that fills gets its metadata; the others, the scratch page
        if self.kmean is not None and self.fills:  # (fills: the host's word that one may fill)
            self._filled = torch.where(lens1 % ps == 0, page, self.scratch)
        self._slots = dense_slots(s.table, lens1, ps) if cpu and not self.lanes else None
        if self.lanes is not None and cpu:
            self._own_lens = lens1 - s.shared  # (B,) each lane's own tokens, the new one in
        if self.budget is not None:  # n_pages, n_full, and the table's pages to read
            n_full = lens1 // ps
            self._counts = [at + 1, n_full, s.budget[3 * at + 3 - n_full]]

    # ---- speculative decoding: the verify forward, and cutting a row back

    def begin_verify(self, rows, T):
        """T new tokens for each live sequence in `rows`, at positions lens[r] .. lens[r] + T - 1:
        the verify forward of speculative decoding (rollout.Engine(speculative=k), T = k + 1), a
        chunk of prefill on paged KV. Pages open where the T tokens need them; `attend` writes
        their K and V over whatever the draft wrote there, rewrites the metadata of every page
        they touch that is full afterwards, and attends each new query to its row's whole cache
        up to and including itself (dense, causal within the T). The new positions must lie past
        the shared prompt pages (completion tokens only).
            On a CPU with lanes the attention reads the cache in place (`_verify_lanes`); on a
        GPU, with the free list, or with verify_ref = True, it gathers each row's cache (the
        reference)."""
        ps, dev = self.page_size, self.table.device
        lanes = self.lanes is not None and not self.table.is_cuda and not self.verify_ref
        if lanes:
            self._compact(rows)  # before pages open: a lane's pages are its row's, in order
        lens = [self.lens[r] for r in rows]
        opened = []
        for r, n in zip(rows, lens):
            while len(self.pages[r]) * ps < n + T:
                opened.append((r, len(self.pages[r]), self._alloc(r)))
        # pages the new tokens touch that are full once they are in: their metadata is rewritten
        filled = [self.pages[r][j] for r, n in zip(rows, lens)
                  for j in range(n // ps, (n + T) // ps)]
        # the verify's index tensors in one copy; dst (B * T,): the flat slot of each new token,
        # batch row-major
        lens_t, rows_t, self._dst, filled_t, new = self._upload(
            lens, rows, [self.pages[r][t // ps] * ps + t % ps
                         for r, n in zip(rows, lens) for t in range(n, n + T)],
            filled, [x for o in opened for x in o])
        if opened:  # the device table follows the host's lists
            r, j, p = new.view(-1, 3).unbind(1)
            self.table[r, j] = p.to(torch.int32)
        self._mode, self._rows, self._T = "verify", rows, T
        self._pos = lens_t[:, None] + torch.arange(T, device=dev)  # (B, T)
        self._seq_lens = (lens_t + T).to(torch.int32)
        self.n_pages = self.n_read = [-(-(n + T) // ps) for n in lens]
        self._table = self.table[rows_t, :max(self.n_pages)]
        if lanes:  # the cached part: the lanes' index tensors, at the lengths before the T
            self._laid, self._slots = None, None
            self._lay_lanes(rows, lens, new=0)
            i = torch.arange(T, device=dev)  # (G * T, T): query g * T + i sees new token j <= i
            self._causal = i.repeat(self.G)[:, None] >= i
        else:
            slots, _ = dense_slots(self._table, self._seq_lens, ps)  # (B, S) every cached token
            # (B, 1, T, S): new token i of row b sees the keys at positions <= lens[b] + i
            see = torch.arange(slots.shape[1], device=dev) <= self._pos[:, :, None]
            self._slots, self._see = slots, see[:, None]
        self._filled = filled_t if filled else None
        self._laid = None  # lanes: lengths moved by T, not one: the next decode step re-lays

    def truncate(self, seq, n):
        """Cut sequence `seq` back to its first n cached tokens (speculative decoding, after a
        rejection): its pages past them go back. A page left partial keeps its metadata, which no
        selection reads (the partial last page is always read) and which is rewritten when the
        page fills again; kept scores (rescore_every > 1) of such a page stay stale until the next
        rescoring. Never into the shared prompt pages."""
        ps, keep = self.page_size, -(-n // self.page_size)
        if n < self.n_shared[seq] * ps or n > self.lens[seq]:
            raise ValueError(f"truncate: sequence {seq} holds {self.lens[seq]} tokens, "
                             f"{self.n_shared[seq] * ps} of them shared; cannot cut to {n}")
        for p in self.pages[seq][keep:]:  # own pages: one holder each
            self.refs[p], self.used = 0, self.used - 1
            if self.free is not None:
                self.free.append(p)
        del self.pages[seq][keep:]
        self.lens[seq], self._laid = n, None

    # ---- what the model calls

    def positions(self, T):
        if self._mode == "prefill":
            return torch.arange(T, device=self.table.device).expand(self._B, T)
        return self._pos

    def attend(self, layer, q, k, v):  # q (B, Hq, T, D); k, v (B, Hkv, T, D)
        pools = lambda: (self.k[layer], self.v[layer])  # (Hkv, num_pages * page_size, D) each
        if self._mode == "prefill":
            kp, vp = pools()
            b, t, dst = self._scatter  # causal SDPA, and token t of batch row b into slot dst
            kp.index_copy_(1, dst, k[b, :, t].transpose(0, 1).to(kp.dtype))
            vp.index_copy_(1, dst, v[b, :, t].transpose(0, 1).to(vp.dtype))
            self._write_meta(layer, self._filled)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if self._mode == "verify":
            return self._attend_verify(layer, *pools(), q, k, v)
        # the new token first: it attends to itself; (Hkv, B, D) into B token slots (on a CPU
        # one C++ call; index_copy_ is its reference)
        if not write_tokens_cpu(self.k, self.v, layer, k, v, self._dst):
            kp, vp = pools()
            kp.index_copy_(1, self._dst, k[:, :, 0].transpose(0, 1).to(kp.dtype))
            vp.index_copy_(1, self._dst, v[:, :, 0].transpose(0, 1).to(vp.dtype))
        self._write_meta(layer, self._filled)  # before selecting: a page that fills is scored now
        sel = n_sel = None  # dense: every page
        t0 = self._tick(None, 0.0)
        if self.budget is not None and layer >= self.dense_layers:
            sel, n_sel = self._select(layer, q[:, :, 0])
            t0 = self._tick("select", t0)
            self._count(layer, sel, n_sel)
        if sel is None and self.lanes is not None and not q.is_cuda:  # (B, Hkv, G, D) queries
            y = self._own_lanes(layer, q)  # the lanes read from the pool's offsets, no views
            if y is not None:
                self._tick("attn", t0)
                return y
            # in the pool's dtype, as the Triton kernel casts them (kv_dtype may not be q's)
            kp, vp = pools()
            qg = q[:, :, 0].view(q.shape[0], self.H, -1, self.D).to(kp.dtype)
            y = self._attend_lanes(kp, vp, qg).flatten(1, 2).to(q.dtype)
        else:
            y = decode_attention(q[:, :, 0], self.paged(self.k, layer), self.paged(self.v, layer),
                                 self._table, self._seq_lens, sel, n_sel, slots=self._slots,
                                 finite=True)  # the pool starts at zero: no NaN to mask
        self._tick("attn", t0)
        return y[:, :, None]  # (B, Hq, 1, D)

    def _count(self, layer, sel, n_sel):
        """A sparse layer's selection: what it really reads, summed over KV heads, into
        read_layer (a static step: into the slots' own counts, the live slots' only), and the
        record (record_pages). A static step's record holds each slot's completion position (a
        tensor; past the end for a padding or finished slot) and its row, for Engine._pack_pages."""
        if self._mode != "step":
            self.read_layer[layer] += n_sel.sum()
            if self.record is not None:
                self.record.append((self.step, self._rows, layer, sel, n_sel))
            return
        s = self._s
        s.read[layer] += (n_sel.sum(1) * s.live).sum()
        if self.record is not None:
            self.record.append((torch.where(s.live, s.pos, 2**30), s.rows.clone(), layer, sel,
                                n_sel))

    def _tick(self, name, t0):
        """Engine.clock, the bench's timer: adds the seconds since t0 to clock[name] (name None:
        none); -> now. Without a clock it reads no time: a compiled step would guard on it."""
        if self.clock is None:
            return 0.0
        now = time.perf_counter()
        if name is not None:
            self.clock[name] += now - t0
        return now

    def _select(self, layer, q):  # q (B, Hq, D) -> sel (B, Hkv, S), n_sel (B, Hkv)
        meta = [m[layer] for m in (self.kmin, self.kmax) if m is not None] or [self.kmean[layer]]
        args = (*self._counts, self.keep_first, self.keep_recent, self._k_read)
        kept, rescore = None, self._rescore
        last = self._last.get(layer)
        if (self.scores is not None and not rescore and last is not None and self._key is not None
                and last[0] == self._key):
            return last[1]  # the same scores, pages and budgets as the step before: its pick
        if self.scores is not None:  # the live rows' scores, as the last rescoring left them
            kept = self.scores[layer].index_select(0, self._rows_t)[:, :, :self._table.shape[1]]
            kept = kept.contiguous()
        if self.scorer != "oracle" and not q.is_cuda and cpu_kernel() is not None:
            sel = select_pages_cpu(q, meta, self._table, *args, scores=kept, rescore=rescore)
        else:
            phys = self._table.long()  # (B, P); entries past a row's pages: stale, masked later
            if kept is not None and not rescore:
                scores = kept
            elif self.scorer == "oracle":  # the yardstick: every key read, the true mass per page
                scores = oracle_scores(q, self.paged(self.k, layer)[phys], self._seq_lens)
            else:  # gathered through the page tables
                scores = (centroid_scores, quest_scores)[len(meta) - 1](q, *(m[phys] for m in meta))
                if kept is not None:  # pages not full yet: read until the next rescoring
                    full = torch.arange(kept.shape[2], device=q.device) < self._counts[1][:, None]
                    kept.copy_(scores.float().masked_fill(~full[:, None], UNSCORED))
            sel = select_pages(scores, *args)
        if kept is not None:
            if rescore:
                self.scores[layer, :, :, :kept.shape[2]].index_copy_(0, self._rows_t, kept)
            self._last[layer] = (self._key, sel)
        return sel

    def advance(self, T):  # a static step's lengths move on the device (decode.py)
        self.routes.add(self._mode, self._groups if self._mode == "prefill" else self._rows)  # MoE
        if self._mode in ("decode", "verify"):
            for r in self._rows:
                self.lens[r] += T
