"""
rollout.py: stage 2, the generation engine. G completions per prompt over a paged KV cache, with the
prompt prefilled once per group and, optionally, block-sparse decode attention.

    engine = Engine(model, tokenizer, max_new_tokens=256, temperature=1.0, top_p=1.0,
                    stop=["\\n\\n"])
    ro = engine.generate(prompt_ids, group_size=8, seed=0)  # prompt_ids: list of token-id lists
    ro.tokens, ro.mask, ro.logp     # (N, T) completions, sampled-token mask, log-probs
    ro.budget, ro.timings           # (N, T) KV pages read per position; timings, counts

    engine = Engine(model, tokenizer, topk_logprobs=20)  # also: the top-20 of each distribution
    ro.topk_logp, ro.topk_ids       # (N, T, 20) for the mismatch statistic (sparsity.py)

    from sparsity import fraction_budget  # sparse decode: read 1/8 of the KV pages
    engine = Engine(model, tokenizer, sparse=fraction_budget(1 / 8), scorer="centroid")

    python -m bench rollout [--quick]  # speed against transformers, sharing, sparsity

What one call does:
    1. Prefill: each distinct prompt goes through the model once (prompts batched, right-padded,
       causal SDPA), and its keys and values are scattered into pages of `page_size` tokens. The G
       rows of a prompt point at the same physical pages for every full prompt page; only the
       partial last page is copied, once per row, because every row writes its own first tokens into
       it (copy-on-write done eagerly: at most page_size - 1 tokens per row, against a whole
       prompt).
    2. Decode: one query token per live row. Each layer writes the new key and value into the row's
       last page (a fresh page from the free list when the last one is full) and calls
       `decode_attention` from kernels/block_sparse_decode.py: the Triton kernel on a GPU. On a CPU,
       dense decode gathers every cached token and runs fused SDPA (the gather's slots are built
       once per step, for all layers); sparse decode runs the kernel's PyTorch reference.
    3. Dense decode reads every page. Sparse decode (`sparse=` a budget function from sparsity.py)
       reads, in each layer past the first `dense_layers`, the pages that `sparsity.select_pages`
       picks from the page metadata (mean key, and min/max keys for Quest), which a sparse engine
       writes once, when a page fills. The first `keep_first` pages and the last `keep_recent` (and
       the partial last page) are always read.
    4. Sampling: temperature, top-p, a seeded generator; the log-prob of the sampled token is taken
       under softmax(logits / temperature), which the trainer recomputes, so the two compare token
       by token. With `topk_logprobs=k` the engine also keeps the k largest log-probs of that
       distribution (values and token ids) at every sampled position: what `sparsity.alpha_topk`
       needs to bound the sparse-to-dense acceptance rate. k = vocab_size keeps the whole
       distribution (small vocabularies: the exact alpha).
    5. A row stops at EOS, at a stop string, or at max_new_tokens; it leaves the batch at once and
       its pages go back to the free list (a shared prompt page when its last row finishes).

Options (Engine keywords): page_size=16; sparse=False or a budget function; scorer="centroid" |
"quest" | "oracle" (the true attention mass per page: it reads every key, a yardstick for
calibration, not a speedup); keep_first=1, keep_recent=2, dense_layers=2 (sparse only);
share_prefix=True (False prefills every row on its own, the baseline); num_pages=None (the pool's
size; None is the call's worst case); topk_logprobs=0 (k > 0 fills ro.topk_logp and ro.topk_ids;
padding positions hold -inf and token 0); record_pages=False (sparse only: fills ro.read_pages with
every selection, which distill.ReplayCache replays in a training forward).
Timings: prefill_s, decode_s, new_tokens; prefill_calls, prefill_tokens and prefill_tokens_naive
(what prefilling every row would cost); pages_read and pages_dense (KV pages read by decode
attention, summed over steps, rows and layers, and what dense decode reads); pages_total,
pages_peak, pages_free_end (the pool).

Simplifications:
    1. No continuous batching: a call starts all its rows together and ends when the last one
       finishes. The pool holds the worst case of the call (every row at max_new_tokens) unless
       `num_pages` caps it.
    2. The log-prob ignores top-p truncation (as verl and friends do); with top_p = 1 it is exact.
       So do the top-k log-probs; and with temperature 0 (greedy) both are taken at temperature 1.
    3. Stop strings are checked on the decoded tail of each row, so a stop string must decode the
       same whether or not it is tokenised on its own.
    4. Prefill is always dense, and a row's first token comes from it: `ro.budget[:, 0]` is the
       prompt's page count. The sparse budget is per row, the same in every sparse layer and KV
       head.
    5. Page bookkeeping (free list, reference counts, page tables) lives on the host as Python
       lists; the device gets a few small index tensors per step.

`generate_naive` beside the engine recomputes the whole sequence at every step with no cache. It is
the slow reference that the tests compare the engine against.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.block_sparse_decode import decode_attention, dense_slots
from sparsity import (centroid_scores, oracle_scores, page_metadata, pages_to_read, quest_scores,
                      select_pages)

PREFILL_TOKENS = 16384  # padded tokens per prefill forward: bounds the activations of a long batch


@dataclass
class Rollouts:
    prompt_index: torch.Tensor  # (N,) index of the prompt in the request
    tokens: torch.Tensor  # (N, T) completion ids, padded with pad_id
    mask: torch.Tensor  # (N, T) bool, True where a token was sampled
    logp: torch.Tensor  # (N, T) fp32 log-prob of each sampled token under the rollout policy
    finish: list  # "eos" | "stop" | "length" per completion
    texts: list  # decoded completions (stop string included, EOS not)
    group_size: int = 1
    timings: dict = field(default_factory=dict)
    budget: torch.Tensor = None  # (N, T) KV pages each sparse layer read for each token's step
    budget_dense: torch.Tensor = None  # (N, T) pages cached at that step: what dense decode reads
    topk_logp: torch.Tensor = None  # (N, T, k) fp32 top-k rollout log-probs, or None (k = 0)
    topk_ids: torch.Tensor = None  # (N, T, k) their token ids (descending log-prob), or None
    read_pages: torch.Tensor = None  # (N, T, sparse layers, H_kv, pages) bool: the logical pages
    # each sparse layer and KV head read for the step that produced each token (record_pages=True);
    # all False at position 0 (prefill)

    def __len__(self):
        return self.tokens.shape[0]


class PagedKVCache:
    """One K and one V pool per layer, (num_pages, page_size, H_kv, D), a page table per sequence
    (logical page -> physical page), reference counts and a free list. The engine lays out each
    forward with `begin_prefill` or `begin_decode`; the model then calls `positions`, `attend` per
    layer, and `advance`."""

    def __init__(self, cfg, num_seqs, max_pages, num_pages, page_size, dtype, device, budget=None,
                 scorer="centroid", keep_first=1, keep_recent=2, dense_layers=2):
        L, self.H, self.D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.page_size, self.num_pages = page_size, num_pages
        self.k = torch.zeros(L, num_pages, page_size, self.H, self.D, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        meta = (L, num_pages, self.H, self.D)  # page metadata, kept only where a selection reads it
        self.kmean = torch.zeros(meta, dtype=dtype, device=device) if budget is not None else None
        quest = budget is not None and scorer == "quest"
        self.kmin = torch.zeros(meta, dtype=dtype, device=device) if quest else None
        self.kmax = torch.zeros(meta, dtype=dtype, device=device) if quest else None
        # (N, max_pages) the device copy of every page table: logical page -> physical page id
        self.table = torch.zeros(num_seqs, max_pages, dtype=torch.int32, device=device)
        self.pages = [[] for _ in range(num_seqs)]  # the host's copy of each page table
        self.lens = [0] * num_seqs  # tokens cached per sequence
        self.refs = [0] * num_pages  # sequences holding each page: a shared prompt page has G
        self.free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.peak = 0
        self.budget, self.scorer = budget, scorer
        self.keep_first, self.keep_recent = keep_first, keep_recent
        self.dense_layers = dense_layers
        # a list to record (step, rows, layer, sel, n_sel) of every sparse selection into
        self.record = None
        self.clock = None  # the engine's timing hook (Engine.clock)

    # ---- bookkeeping

    def _alloc(self, seq):
        if not self.free:
            raise RuntimeError(f"the KV pool is out of pages ({self.num_pages} of {self.page_size} "
                               f"tokens): raise Engine(num_pages=...) or leave it None for the "
                               f"worst case")
        p = self.free.pop()
        self.refs[p] = 1
        self.pages[seq].append(p)
        self.peak = max(self.peak, self.num_pages - len(self.free))
        return p

    def release(self, seq):
        """A finished sequence gives its pages back; a shared page returns when its last holder
        leaves."""
        for p in self.pages[seq]:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)
        self.pages[seq] = []

    def _write_meta(self, layer, pages):
        """Metadata of pages that just filled (pages: index tensor): written once, read by every
        later step."""
        if pages is None or self.kmean is None:
            return
        mean, lo, hi = page_metadata(self.k[layer][pages], self.kmin is not None)
        self.kmean[layer][pages] = mean.to(self.kmean.dtype)
        if lo is not None:
            self.kmin[layer][pages], self.kmax[layer][pages] = (lo.to(self.kmin.dtype),
                                                                hi.to(self.kmax.dtype))

    # ---- laying out a forward

    def begin_prefill(self, groups):
        """groups[i] = (length, rows): batch row i is a prompt whose KV belongs to all of `rows`.
        Its full pages are allocated once and shared (refs = len(rows)); its partial last page is
        private to each row."""
        ps, dev = self.page_size, self.table.device
        src_b, src_t, dst, full = [], [], [], []
        for i, (L, rows) in enumerate(groups):
            n_full, tail = divmod(L, ps)
            shared = [self._alloc(rows[0]) for _ in range(n_full)]
            for p in shared:
                self.refs[p] = len(rows)
            for r in rows[1:]:
                self.pages[r] = list(shared)
            t = torch.arange(n_full * ps)  # tokens of the full pages: stored once
            src_b.append(torch.full_like(t, i))
            src_t.append(t)
            dst.append(torch.tensor(shared, dtype=torch.long)[t // ps] * ps + t % ps)  # flat slots
            t = torch.arange(n_full * ps, L)  # tokens of the partial page: stored once per row
            for r in rows:
                if tail:  # copy-on-write of the one page that the rows will each write into
                    src_b.append(torch.full_like(t, i))
                    src_t.append(t)
                    dst.append(self._alloc(r) * ps + t % ps)
                self.lens[r] = L
                self.table[r, :len(self.pages[r])] = torch.tensor(self.pages[r], dtype=torch.int32)
            full += shared
        self._mode, self._B = "prefill", len(groups)
        self._scatter = [torch.cat(x).to(dev) for x in (src_b, src_t, dst)]
        self._filled = torch.tensor(full, dtype=torch.long, device=dev) if full else None

    def begin_decode(self, rows):
        """One new token for each live sequence in `rows`: open a page where the last one is full,
        then build the step's index tensors, which every layer shares."""
        ps, dev = self.page_size, self.table.device
        opened = [(r, len(self.pages[r]), self._alloc(r)) for r in rows if self.lens[r] % ps == 0]
        if opened:  # one scatter for all the new pages: the device table follows the host's lists
            r, j, p = (torch.tensor(x) for x in zip(*opened))
            self.table[r.to(dev), j.to(dev)] = p.to(dev, torch.int32)
        lens = [self.lens[r] for r in rows]  # before the new token: its position
        # the page the new token goes to
        last = [self.pages[r][n // ps] for r, n in zip(rows, lens)]
        self.n_pages = [n // ps + 1 for n in lens]  # pages cached once the new token is in
        n_full = [(n + 1) // ps for n in lens]
        filled = [p for p, n in zip(last, lens) if (n + 1) % ps == 0]
        self._mode, self._rows = "decode", rows
        self._pos = torch.tensor(lens, device=dev)[:, None]  # (B, 1)
        # (B,) flat slot (page * page_size + offset) that each new token's K and V go to
        self._dst = torch.tensor([p * ps + n % ps for p, n in zip(last, lens)], device=dev)
        self._seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev) + 1  # (B,) new one in
        # (B, P) the live rows' tables, cut to the pages in use: P = the longest row's page count
        self._table = self.table[torch.tensor(rows, device=dev), :max(self.n_pages)]
        # dense decode off the GPU gathers every cached
        # token: its slots are built once, for every layer
        self._slots = None if self.table.is_cuda else dense_slots(self._table, self._seq_lens, ps)
        self._filled = torch.tensor(filled, dtype=torch.long, device=dev) if filled else None
        self.n_read = self.n_pages
        if self.budget is not None:
            self.n_read = [pages_to_read(self.budget, n, f, self.keep_first, self.keep_recent)
                           for n, f in zip(self.n_pages, n_full)]
            self._counts = [torch.tensor(x, device=dev)
                            for x in (self.n_pages, n_full, self.n_read)]

    # ---- what the model calls

    def positions(self, T):
        if self._mode == "prefill":
            return torch.arange(T, device=self.table.device).expand(self._B, T)
        return self._pos

    def attend(self, layer, q, k, v):  # q (B, Hq, T, D); k, v (B, Hkv, T, D)
        # (num_pages * page_size, Hkv, D): one row per token slot
        kp = self.k[layer].view(-1, self.H, self.D)
        vp = self.v[layer].view(-1, self.H, self.D)
        if self._mode == "prefill":
            # the prompts are contiguous here: plain causal attention, then store
            b, t, dst = self._scatter  # token t of batch row b goes to slot dst
            kp[dst] = k.transpose(1, 2)[b, t].to(kp.dtype)  # (n, Hkv, D): padding never stored
            vp[dst] = v.transpose(1, 2)[b, t].to(vp.dtype)
            self._write_meta(layer, self._filled)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        kp[self._dst] = k[:, :, 0].to(kp.dtype)  # the new token first: it attends to itself
        vp[self._dst] = v[:, :, 0].to(vp.dtype)
        # before selecting: a page that fills now is scored now
        self._write_meta(layer, self._filled)
        sel = n_sel = None  # dense: every page
        # the bench's timing hook: seconds of page selection and of attention, when set
        clock = self.clock
        if self.budget is not None and layer >= self.dense_layers:
            t0 = time.perf_counter() if clock is not None else 0.0
            sel, n_sel = self._select(layer, q[:, :, 0])
            if clock is not None:
                clock["select"] += time.perf_counter() - t0
            if self.record is not None:
                self.record.append((self.step, self._rows, layer, sel, n_sel))
        t0 = time.perf_counter() if clock is not None else 0.0
        y = decode_attention(q[:, :, 0], self.k[layer], self.v[layer], self._table, self._seq_lens,
                             sel, n_sel, slots=self._slots)
        if clock is not None:
            clock["attn"] += time.perf_counter() - t0
        return y[:, :, None]  # (B, Hq, 1, D)

    def _select(self, layer, q):  # q (B, Hq, D) -> sel (B, Hkv, S), n_sel (B, Hkv)
        # (B, P); entries past a row's pages hold stale ids, masked in selection
        phys = self._table.long()
        if self.scorer == "quest":
            scores = quest_scores(q, self.kmin[layer][phys], self.kmax[layer][phys])
        elif self.scorer == "oracle":
            # the yardstick: every key read, the true attention mass per page
            scores = oracle_scores(q, self.k[layer][phys], self._seq_lens)
        else:
            scores = centroid_scores(q, self.kmean[layer][phys])
        n_pages, n_full, n_read = self._counts
        return select_pages(scores, n_pages, n_full, n_read, self.keep_first, self.keep_recent,
                            max(self.n_read))

    def advance(self, T):
        if self._mode == "decode":
            for r in self._rows:
                self.lens[r] += T


def topk_logprobs(logits, temperature, k):
    """logits (B, V) fp32 -> the k largest log-probs of softmax(logits / T) (B, k) and their token
    ids (B, k), descending; at temperature <= 0 (greedy) the distribution is taken at T = 1, as
    `sample` reports it."""
    t = temperature if temperature > 0 else 1.0
    return F.log_softmax(logits / t, -1).topk(k, dim=-1)


def sample(logits, temperature, top_p, gen):
    """logits (B, V) fp32 -> token (B,), log-prob of it under softmax(logits / T) (B,)."""
    if temperature <= 0:  # greedy; the log-prob is reported at temperature 1
        tok = logits.argmax(-1)
        return tok, F.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    logp = F.log_softmax(logits / temperature, -1)
    probs = logp.exp()
    if top_p < 1.0:  # keep the smallest prefix of sorted tokens whose mass reaches top_p
        sp, si = probs.sort(-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= top_p  # mass before each token: the top one always stays
        probs = probs.scatter(-1, si, sp.masked_fill(drop, 0.0))
    tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


class Engine:
    def __init__(self, model, tokenizer, max_new_tokens=256, temperature=1.0, top_p=1.0, stop=(),
                 eos_ids=None, page_size=16, sparse=False, scorer="centroid", keep_recent=2,
                 dense_layers=2, keep_first=1, share_prefix=True, num_pages=None, topk_logprobs=0,
                 record_pages=False):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stop = [s for s in stop if s]
        eos = eos_ids if eos_ids is not None else tokenizer.eos_token_id
        self.eos = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos], dtype=torch.long)
        self.pad_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                       else int(self.eos[0]))
        self.max_len = model.config.max_position_embeddings
        if not (isinstance(page_size, int) and page_size >= 1):
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if sparse is not False and sparse is not None and not callable(sparse):
            raise TypeError(f"sparse must be False or a budget function n_pages -> pages (see "
                            f"sparsity.py), got {sparse!r}")
        if scorer not in ("centroid", "quest", "oracle"):
            raise ValueError(f"scorer must be 'centroid', 'quest' or 'oracle', got {scorer!r}")
        for name, x in (("keep_recent", keep_recent), ("dense_layers", dense_layers),
                        ("keep_first", keep_first)):
            if not (isinstance(x, int) and x >= 0):
                raise ValueError(f"{name} must be an int >= 0, got {x!r}")
        self.page_size, self.budget, self.scorer = page_size, (sparse or None), scorer
        self.keep_recent, self.dense_layers, self.keep_first = keep_recent, dense_layers, keep_first
        self.share_prefix, self.num_pages = share_prefix, num_pages
        V = model.config.vocab_size
        if not (isinstance(topk_logprobs, int) and 0 <= topk_logprobs <= V):
            raise ValueError(f"topk_logprobs must be an int in [0, vocab_size={V}], got "
                             f"{topk_logprobs!r}")
        self.topk = topk_logprobs
        self.record_pages = record_pages and self.budget is not None
        # {"attn": s, "select": s}: decode adds its attention and page-selection seconds (bench)
        self.clock = None

    def _check_lengths(self, prompt_ids):
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + self.max_new_tokens > self.max_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; with "
                                 f"max_new_tokens={self.max_new_tokens} it exceeds the model's "
                                 f"context of {self.max_len}")

    def _stopped(self, out, rows):
        """Rows (indices into out) whose decoded tail contains a stop string."""
        # tokens, generously: a token is at least one character
        tail = max(len(s) for s in self.stop) + 8
        texts = self.tok.batch_decode([out[r][-tail:] for r in rows], skip_special_tokens=True)
        return [r for r, t in zip(rows, texts) if any(s in t for s in self.stop)]

    def _groups(self, prompt_ids, G):
        """[(prompt, rows)] per distinct prompt: the rows (of the N = len(prompt_ids) * G) that
        share its pages. Without prefix sharing every row is its own group, prefilled on its own."""
        if not self.share_prefix:
            return [(list(p), [i * G + g]) for i, p in enumerate(prompt_ids) for g in range(G)]
        groups = {}
        for i, p in enumerate(prompt_ids):
            groups.setdefault(tuple(p), []).extend(range(i * G, (i + 1) * G))
        return [(list(p), rows) for p, rows in groups.items()]

    def _new_cache(self, groups, N):
        ps, new = self.page_size, self.max_new_tokens
        longest = max(len(p) for p, _ in groups)
        # worst case: every row runs to max_new_tokens; -(-a // b) is ceil(a / b)
        need = sum(len(p) // ps + len(rows) * -(-(len(p) % ps + new) // ps) for p, rows in groups)
        w = self.model.lm_head.weight
        cache = PagedKVCache(self.model.config, N, -(-(longest + new) // ps),
                             self.num_pages or need, ps, w.dtype, w.device, self.budget,
                             self.scorer, self.keep_first, self.keep_recent, self.dense_layers)
        cache.clock = self.clock
        return cache

    def _prefill(self, cache, groups, N):
        """Each distinct prompt through the model once, in length-sorted chunks of at most
        PREFILL_TOKENS padded tokens. Returns the next-token logits of every row (N, V) fp32 and the
        number of forwards."""
        model, dev = self.model, self.model.lm_head.weight.device
        chunks, cur = [], []
        for g in sorted(groups, key=lambda g: len(g[0])):
            if cur and (len(cur) + 1) * len(g[0]) > PREFILL_TOKENS:
                chunks.append(cur)
                cur = []
            cur.append(g)
        chunks.append(cur)
        logits = None
        for chunk in chunks:
            lens = torch.tensor([len(p) for p, _ in chunk])
            ids = torch.full((len(chunk), int(lens.max())), self.pad_id, dtype=torch.long)
            for i, (p, _) in enumerate(chunk):
                # right padding: real tokens never attend to the pads after them
                ids[i, :len(p)] = torch.tensor(p)
            cache.begin_prefill([(len(p), rows) for p, rows in chunk])
            # (b, T, C); only the last real token is projected
            h = model(ids.to(dev), cache=cache, hidden=True)
            lg = model.lm_head(h[torch.arange(len(chunk)), lens - 1]).float()  # (b, V)
            if logits is None:
                logits = lg.new_empty(N, lg.shape[-1])
            rows = torch.tensor([r for _, rs in chunk for r in rs])
            logits[rows.to(dev)] = lg[torch.tensor([i for i, (_, rs) in enumerate(chunk)
                                                    for _ in rs], device=dev)]
        return logits, len(chunks)

    @torch.no_grad()
    def generate(self, prompt_ids, group_size=1, seed=0):
        self._check_lengths(prompt_ids)
        model, dev = self.model, self.model.lm_head.weight.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        N, ps, L = len(prompt_ids) * group_size, self.page_size, model.config.num_hidden_layers
        groups = self._groups(prompt_ids, group_size)
        cache = self._new_cache(groups, N)
        cache.record = [] if self.record_pages else None
        t0 = time.perf_counter()
        logits, calls = self._prefill(cache, groups, N)
        t1 = time.perf_counter()
        out, lps = [[] for _ in range(N)], [[] for _ in range(N)]
        # prefill reads every page
        budget = [[-(-len(prompt_ids[r // group_size]) // ps)] for r in range(N)]
        dense = [list(b) for b in budget]
        finish = ["length"] * N
        live = list(range(N))  # row id of each row still in the batch
        eos_set = set(self.eos.tolist())
        sparse_layers = max(0, L - self.dense_layers) if self.budget is not None else 0
        pages_read = pages_dense = 0
        topk = []  # per step: (rows live at it, values (B, k), ids (B, k)), kept on the device
        for step in range(self.max_new_tokens):
            if self.topk:
                topk.append((list(live), *topk_logprobs(logits, self.temperature, self.topk)))
            tok, lp = sample(logits, self.temperature, self.top_p, gen)
            tok_l, lp_l = tok.tolist(), lp.tolist()  # CPU-GPU sync point, once per step
            done = set()
            for j, r in enumerate(live):
                out[r].append(tok_l[j])  # EOS is sampled and trained on; it is not part of the text
                lps[r].append(lp_l[j])
                if tok_l[j] in eos_set:
                    finish[r] = "eos"
                    done.add(j)
            if self.stop:
                cand = [r for j, r in enumerate(live) if j not in done]
                hit = set(self._stopped(out, cand))
                for j, r in enumerate(live):
                    if r in hit:
                        finish[r] = "stop"
                        done.add(j)
            if step == self.max_new_tokens - 1:  # the last token needs no forward
                break
            if done:  # finished rows leave the batch and give their pages back
                for j in done:
                    cache.release(live[j])
                keep = [j for j in range(len(live)) if j not in done]
                live, tok = ([live[j] for j in keep],
                             tok[torch.tensor(keep, dtype=torch.long, device=dev)])
                if not live:
                    break
            cache.begin_decode(live)
            cache.step = step + 1  # the completion position this forward produces
            for j, r in enumerate(live):
                budget[r].append(cache.n_read[j])
                dense[r].append(cache.n_pages[j])
            pages_read += (sum(cache.n_read) * sparse_layers
                           + sum(cache.n_pages) * (L - sparse_layers))
            pages_dense += sum(cache.n_pages) * L
            logits = model(tok[:, None], cache=cache)[:, -1]  # (B, V): one token per live row
        for r in live:
            cache.release(r)
        t2 = time.perf_counter()
        # every row's prompt: what a naive engine prefills
        real = sum(len(p) * len(rows) for p, rows in groups)
        timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_calls": calls,
                   "prefill_tokens": sum(len(p) for p, _ in groups), "prefill_tokens_naive": real,
                   "pages_read": pages_read, "pages_dense": pages_dense,
                   "pages_total": cache.num_pages, "pages_peak": cache.peak,
                   "pages_free_end": len(cache.free)}
        ro = self._pack(prompt_ids, group_size, out, lps, finish, timings, budget, dense)
        if self.topk:
            ro.topk_logp, ro.topk_ids = self._pack_topk(topk, N, ro.tokens.shape[1])
        if self.record_pages:
            ro.read_pages = self._pack_pages(cache, N, ro.tokens.shape[1])
        return ro

    def _pack_pages(self, cache, N, T):
        """The recorded selections -> (N, T, sparse layers, H_kv, P) bool, what distill.ReplayCache
        replays."""
        L, dl, P = self.model.config.num_hidden_layers, self.dense_layers, cache.table.shape[1]
        # column P: padding
        out = torch.zeros(N, T, max(0, L - dl), cache.H, P + 1, dtype=torch.bool)
        for step, rows, layer, sel, n_sel in cache.record:
            # (B, H_kv, S)
            valid = torch.arange(sel.shape[-1], device=sel.device) < n_sel[..., None]
            idx = torch.where(valid, sel.long(), P).cpu()
            out[torch.tensor(rows)[:, None, None], step, layer - dl,
                torch.arange(cache.H)[None, :, None], idx] = True
        return out[..., :P]

    def _pack_topk(self, topk, N, T):
        """Per-step top-k of the live rows -> (N, T, k) values and ids. Every live row samples one
        token per step, so step s fills completion position s of the rows that were live at it."""
        k, dev = self.topk, topk[0][1].device
        vals = torch.full((N, T, k), float("-inf"), device=dev)  # padding: probability 0
        ids = torch.zeros((N, T, k), dtype=torch.long, device=dev)
        for s, (rows, v, i) in enumerate(topk):
            r = torch.tensor(rows, device=dev)
            vals[r, s], ids[r, s] = v, i
        return vals.cpu(), ids.cpu()

    def _pack(self, prompt_ids, G, out, lps, finish, timings, budget, dense):
        N, T = len(out), max(1, max(len(o) for o in out))
        tokens = torch.full((N, T), self.pad_id, dtype=torch.long)
        mask = torch.zeros(N, T, dtype=torch.bool)
        logp, bud, bud_dense = torch.zeros(N, T), torch.zeros(N, T), torch.zeros(N, T)
        for i, (o, l) in enumerate(zip(out, lps)):
            tokens[i, :len(o)], mask[i, :len(o)] = torch.tensor(o, dtype=torch.long), True
            logp[i, :len(l)] = torch.tensor(l)
            bud[i, :len(o)] = torch.tensor(budget[i][:len(o)], dtype=torch.float)
            bud_dense[i, :len(o)] = torch.tensor(dense[i][:len(o)], dtype=torch.float)
        texts = self.tok.batch_decode(out, skip_special_tokens=True)
        pidx = torch.arange(len(prompt_ids)).repeat_interleave(G)
        timings["new_tokens"] = int(mask.sum())
        return Rollouts(pidx, tokens, mask, logp, finish, texts, G, timings, bud, bud_dense)


@torch.no_grad()
def generate_naive(model, tokenizer, prompt_ids, group_size=1, seed=0, max_new_tokens=16,
                   temperature=1.0, top_p=1.0, eos_ids=None):
    """The slow reference: no cache, no batching tricks; every step recomputes each row from
    scratch. Returns (tokens per row, log-probs per row) as lists. Shares only `sample` with the
    engine."""
    dev = model.lm_head.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    eos = eos_ids if eos_ids is not None else [tokenizer.eos_token_id]
    rows = [list(p) for p in prompt_ids for _ in range(group_size)]
    out, lps, live = [[] for _ in rows], [[] for _ in rows], list(range(len(rows)))
    for _ in range(max_new_tokens):
        logits = torch.stack([model(torch.tensor([rows[r] + out[r]], device=dev))[0, -1]
                              for r in live])
        tok, lp = sample(logits, temperature, top_p, gen)
        for j, r in enumerate(live):
            out[r].append(tok[j].item())
            lps[r].append(lp[j].item())
        live = [r for r in live if out[r][-1] not in eos]
        if not live:
            break
    return out, lps
