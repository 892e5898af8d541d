"""
rollout.py: stage 2, the generation engine. G completions per prompt over a paged KV cache, with the
prompt prefilled once per group and, optionally, block-sparse decode attention.

    engine = Engine(model, tokenizer, max_new_tokens=256, temperature=1.0, top_p=1.0,
                    stop=["\\n\\n"])
    ro = engine.generate(prompt_ids, group_size=8, seed=0)  # prompt_ids: list of token-id lists
    ro.tokens, ro.mask, ro.logp     # (N, T) completions, sampled-token mask, log-probs
    ro.budget, ro.timings           # (N, T) KV pages read per position; timings, counts
    ro.experts                      # MoE only: moe.Routes, the experts of every token and layer

    engine = Engine(model, tokenizer, topk_logprobs=20)  # also: the top-20 of each distribution
    ro.topk_logp, ro.topk_ids       # (N, T, 20) for the mismatch statistic (sparsity.py)

    from sparsity import fraction_budget  # sparse decode: read 1/8 of the KV pages
    engine = Engine(model, tokenizer, sparse=fraction_budget(1 / 8), scorer="centroid")

    # lossless: the sparse policy drafts 4 tokens, the dense policy verifies them in one forward
    engine = Engine(model, tokenizer, sparse=fraction_budget(1 / 8), speculative=4)
    ro.timings["acceptance"], ro.timings["tokens_per_verify"]  # every token a dense sample

    # the KV pool: bf16, at most 65,536 tokens (a call that needs more runs as several calls)
    engine = Engine(model, tokenizer, kv_dtype="bfloat16", pool_tokens=65536)
    engine.calls(prompt_ids, group_size=8)  # [(start, end)]: the prompts of each call that fits
    pool_pages(cfg, longest_prompt)          # config key kv_pool_tokens in pages (0: one batch)

    python -m bench rollout [--quick]  # speed against transformers, sharing, sparsity

What one call does:
    1. Prefill: each distinct prompt goes through the model once (prompts batched, right-padded,
       causal SDPA), and its keys and values are scattered into pages of `page_size` tokens. The G
       rows of a prompt point at the same physical pages for every full prompt page; only the
       partial last page is copied, once per row (copy-on-write done eagerly: at most page_size - 1
       tokens per row, against a whole prompt). A prompt of one row is all the row's own.
    2. Pages, lanes and decode attention are the cache's (kvcache.PagedKVCache): a shared
       prompt's full pages are stored once, each row's own pages fill a lane of a head-major pool,
       and each decode step reads the lanes in place (dense, CPU) or the pages a selection picks
       (`decode_attention`: Triton on a GPU, a C++ kernel on a CPU).
    3. Decode: one query token per live row, through the model, which calls the cache's
       positions, attend and advance.
    4. Dense decode reads every page. Sparse decode (`sparse=` a budget function from sparsity.py)
       reads, in each layer past the first `dense_layers`, the pages that `sparsity.select_pages`
       picks from the page metadata (mean key, and min/max keys for Quest). The first
       `keep_first` pages and the last `keep_recent` (and the partial last page) are always read;
       `rescore_every=k` scores the pages once in k steps (kvcache.py).
    5. Sampling (`sample`, in speculative.py): temperature, top-p, a seeded generator; the
       log-prob of the sampled token is taken under softmax(logits / temperature), which the
       trainer recomputes, so the two compare token by token. With `topk_logprobs=k` the engine
       also keeps the k largest log-probs of that distribution (values and token ids) at every
       sampled position, what `sparsity.alpha_topk` needs to bound the acceptance rate (k =
       vocab_size: the whole distribution, exact alpha).
    6. A row stops at EOS, at a stop string, or at max_new_tokens; it leaves the batch at once and
       its pages go back (a shared prompt page when its last row finishes). The model runs the
       call inside `Transformer.packed()`: on a CPU, its weight matmuls on packed copies.
    7. The KV storage is the engine's pool (kvcache.KVPool), kept across calls and shared by the
       engines given the same one: allocated at the first call (whole, where it has a cap) and
       grown only when a call needs more than it holds. Its dtype is `kv_dtype`; with a cap
       (`pool_tokens`) a call whose pages do not fit runs as consecutive calls that do
       (`calls`: a prompt's rows stay together), the part i > 0 seeded seed + i * SPLIT_SEED, and
       the parts' Rollouts are joined (`concat_rollouts`).

Options (Engine keywords): page_size=16; sparse=False or a budget function; scorer="centroid" |
"quest" | "oracle" (the true attention mass per page: it reads every key, a yardstick for
calibration, not a speedup); keep_first=1, keep_recent=2, dense_layers=2 (sparse only);
share_prefix=True (False prefills every row on its own, the baseline); num_pages=None (the pool's
size; None is the call's worst case); topk_logprobs=0 (k > 0 fills ro.topk_logp and ro.topk_ids;
padding positions hold -inf and token 0); record_pages=False (sparse only: fills ro.read_pages with
every selection, which distill.ReplayCache replays in a training forward); rescore_every=1
(sparse, centroid or Quest: score the pages once in that many steps); speculative=0 (k > 0:
lossless sparse rollout, k draft tokens per verify; below); draft=None (speculative only: the
model that drafts, of the same shapes as `model`, e.g. DistillSparse's adapter copy; default
`model`; record_pages then records the draft's selections); adapt_k=0 (speculative only: K > 0
chooses each call's k in 1..K from the last call's acceptance and costs, speculative.best_k);
kv_dtype="auto" | "float32" | "bfloat16" (the KV pool's dtype; auto: bf16 on CUDA, the model's
weight dtype elsewhere: `kv_dtype_for`); pool_tokens=0 (the KV pool's cap in tokens, rounded up to
pages; 0: none, each call takes what it needs); pool=None (a kvcache.KVPool to share with other
engines, its own cap holding; None: one of the engine's own).
Timings: prefill_s, decode_s, new_tokens; prefill_calls, prefill_tokens and prefill_tokens_naive
(what prefilling every row would cost); pages_read and pages_dense (KV pages read by decode
attention, summed over steps, rows and layers, and what dense decode reads); pages_read_layer
(per layer: what its selections read, counted in the cache, summed over steps and rows, averaged
over KV heads; a dense layer reads pages_dense / layers); pages_total,
pages_peak, pages_free_end (the pages the call laid out, held at most, free at its end);
generate_calls (1, or the calls a split ran).

Simplifications:
    1. No continuous batching: a call starts all its rows together and ends when the last one
       finishes. The call lays out the worst case (every lane as long as the longest row can
       get) unless `num_pages` caps it (a free list): a pool's cap counts the pages a call could
       need, not the pages it ends up using.
    2. The log-prob ignores top-p truncation (as verl and friends do); with top_p = 1 it is exact.
       So do the top-k log-probs; and with temperature 0 (greedy) both are taken at temperature 1.
    3. Stop strings are checked on the decoded tail of each row, so a stop string must decode the
       same whether or not it is tokenised on its own.
    4. Prefill is always dense, and a row's first token comes from it: `ro.budget[:, 0]` is the
       prompt's page count. The sparse budget is per row, the same in every sparse layer and head.

Speculative decoding (speculative = k > 0, "lossless sparse rollout": every completion an exact
sample of the dense policy, drafted by the sparse one) runs in speculative.py, which holds its
manual, and `sample`, the sampling rule both modes share.

`generate_naive` beside the engine recomputes the whole sequence at every step with no cache. It is
the slow reference that the tests compare the engine against.
"""

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvcache import KVPool, PagedKVCache
from moe import Routes, record_routes
from speculative import generate_speculative, sample, topk_logprobs

PREFILL_TOKENS = 16384  # padded tokens per prefill forward: bounds the activations of a long batch
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # kv_dtype's, besides auto
SPLIT_SEED = 0x5917  # part i > 0 of a split call samples with seed + i * this


def kv_dtype_for(kv_dtype, weight):
    """Config key kv_dtype -> the KV pool's dtype. auto: bf16 on a GPU (half the bytes of fp32
    master weights, and the Triton kernel's tensor-core path), elsewhere the weights' own dtype
    (a CPU run keeps its fp32 results)."""
    if kv_dtype == "auto":
        return torch.bfloat16 if weight.is_cuda else weight.dtype
    return KV_DTYPES[kv_dtype]


def lane_pages(groups, page_size, new):
    """The pool a call lays out as lanes. groups: (prompt length, rows) of each distinct prompt;
    new: tokens a row adds at the most -> (S prefix slots, P pages each, R pages a lane): the call
    holds S * P + rows * R pages. A prompt of several rows stores its full pages once, in a prefix
    slot; a row's lane holds the partial prompt page it copies and its new tokens."""
    shared = [n // page_size if rows > 1 else 0 for n, rows in groups]
    own = [-(-(n - s * page_size + new) // page_size) for (n, _), s in zip(groups, shared)]
    return sum(s > 0 for s in shared), max(shared), max(own)  # -(-a // b) is ceil(a / b)


def pool_pages(cfg, longest_prompt, page_size=None, longest_eval=0):
    """Config key kv_pool_tokens in pages (of page_size; cfg's by default): the key rounded up, or
    at 0 the larger of one rollout batch at its largest and one sampled held-out group.
    A rollout batch: prompts_per_step groups of group_size rows, every prompt up to
    longest_prompt tokens (its full pages once, shared), every row max_new_tokens (plus the
    speculative draft's k) and the partial prompt page it copies. A held-out group (eval_sampled
    only): one prompt of up to longest_eval tokens with eval_k rows, the largest call held-out
    evaluation cannot split. What lane_pages gives any batch of those sizes, at the most: the
    memory model's KV pool (times page_size tokens of K and V)."""
    ps = page_size or cfg.page_size
    if cfg.kv_pool_tokens:
        return -(-cfg.kv_pool_tokens // ps)
    k = max(cfg.spec_k, cfg.spec_k_max) if cfg.rollout_mode == "speculative" else 0
    batch = cfg.prompts_per_step * _group_pages(longest_prompt, cfg.group_size,
                                                cfg.max_new_tokens + k, ps)
    if not cfg.eval_sampled:
        return batch
    rows = cfg.eval_k or cfg.group_size
    return max(batch, _group_pages(max(longest_eval, longest_prompt), rows, cfg.max_new_tokens, ps))


def _group_pages(prompt, G, new, ps):
    """The most pages one prompt of up to `prompt` tokens with G rows of `new` tokens can take."""
    if G == 1:  # nothing shared: a row holds its whole prompt
        return -(-(prompt + new) // ps)
    # a prompt shorter than the longest can leave page_size - 1 tokens on its partial page
    return prompt // ps + G * -(-(min(prompt, ps - 1) + new) // ps)


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
    # each sparse layer and KV head read for each token's step (record_pages=True; none at 0)
    experts: object = None  # MoE: moe.Routes, every layer's experts (the prompt's once per group)

    def __len__(self):
        return self.tokens.shape[0]


class Engine:
    def __init__(self, model, tokenizer, max_new_tokens=256, temperature=1.0, top_p=1.0, stop=(),
                 eos_ids=None, page_size=16, sparse=False, scorer="centroid", keep_recent=2,
                 dense_layers=2, keep_first=1, share_prefix=True, num_pages=None, topk_logprobs=0,
                 record_pages=False, rescore_every=1, speculative=0, draft=None, adapt_k=0,
                 kv_dtype="auto", pool_tokens=0, pool=None):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stop = [s for s in stop if s]
        # by default any of the tokenizer's EOS and the model's own end ids ends a row (Qwen3:
        # <|im_end|> and <|endoftext|>, which warmstart.build_policy reads from its generation
        # config into model.config.eos_token_id)
        own = getattr(model.config, "eos_token_id", None)
        eos = eos_ids if eos_ids is not None else [e for e in dict.fromkeys(
            [tokenizer.eos_token_id, *(own if isinstance(own, list) else [own])]) if e is not None]
        # host: only read as a list (the stop checks run on the host)
        self.eos = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos], dtype=torch.long,
                                device="cpu")
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
        if not (isinstance(rescore_every, int) and rescore_every >= 1):
            raise ValueError(f"rescore_every must be an int >= 1, got {rescore_every!r}")
        self.rescore_every = rescore_every
        if not (isinstance(speculative, int) and speculative >= 0):
            raise ValueError(f"speculative must be an int >= 0 (draft tokens per verify; 0: "
                             f"off), got {speculative!r}")
        if draft is not None:
            shape = lambda m: tuple(getattr(m.config, k) for k in (
                "num_hidden_layers", "num_key_value_heads", "head_dim", "vocab_size"))
            if not speculative:
                raise ValueError("draft is the speculative mode's drafting model: it needs "
                                 "speculative = k > 0")
            if shape(draft) != shape(model):
                raise ValueError(f"the draft model writes the same KV cache as the model: layers, "
                                 f"KV heads, head_dim and vocab must match, got {shape(draft)} "
                                 f"and {shape(model)}")
        if not (isinstance(adapt_k, int) and adapt_k >= 0) or (adapt_k and not speculative):
            raise ValueError(f"adapt_k must be an int >= 0 (0: k fixed; K: each call's k chosen "
                             f"in 1..K from the last call's figures), with speculative = k > 0; "
                             f"got {adapt_k!r}")
        self.speculative, self.draft = speculative, (draft if draft is not None else model)
        self.adapt_k = adapt_k
        self.page_size, self.budget, self.scorer = page_size, (sparse or None), scorer
        self.keep_recent, self.dense_layers, self.keep_first = keep_recent, dense_layers, keep_first
        self.share_prefix, self.num_pages, V = share_prefix, num_pages, model.config.vocab_size
        if not (isinstance(topk_logprobs, int) and 0 <= topk_logprobs <= V):
            raise ValueError(f"topk_logprobs must be an int in [0, vocab_size={V}], got "
                             f"{topk_logprobs!r}")
        self.topk, self.record_pages = topk_logprobs, record_pages and self.budget is not None
        if kv_dtype not in ("auto", *KV_DTYPES):
            raise ValueError(f"kv_dtype must be 'auto', 'float32' or 'bfloat16', got "
                             f"{kv_dtype!r}")
        ok = isinstance(pool_tokens, int) and pool_tokens >= 0
        if not ok or (pool_tokens and pool is not None):
            raise ValueError(f"pool_tokens must be an int >= 0 (the KV pool's tokens; 0: no cap), "
                             f"and 0 with a shared pool (its own cap holds), got {pool_tokens!r}")
        # the KV storage, kept across calls; engines given one pool share it (kvcache.KVPool)
        self.kv_dtype, self.pool = kv_dtype, pool if pool is not None else KVPool(pool_tokens)
        self.clock = None  # {"attn": s, "select": s}: decode adds its seconds in each (the bench)

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
        tail = max(len(s) for s in self.stop) + 8  # tokens, generously: a token is a char or more
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
        """The call's cache: lanes (PagedKVCache) that hold the worst case, every row at
        max_new_tokens, or num_pages pages from a free list; its storage is the engine's pool."""
        # speculative: a verify writes up to k tokens past the last one a row can keep
        ps, new = self.page_size, self.max_new_tokens + self.speculative
        lanes = (None if self.num_pages else
                 lane_pages([(len(p), len(rows)) for p, rows in groups], ps, new))
        num_pages = self.num_pages or lanes[0] * lanes[1] + N * lanes[2]
        w, longest = self.model.lm_head.weight, max(len(p) for p, _ in groups)
        cache = PagedKVCache(self.model.config, N, -(-(longest + new) // ps), num_pages, ps,
                             kv_dtype_for(self.kv_dtype, w), w.device, self.budget, self.scorer,
                             self.keep_first, self.keep_recent, self.dense_layers, lanes,
                             self.rescore_every, pool=self.pool)
        cache.clock, cache.routes = self.clock, record_routes(self.model, N)
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
            lens = [len(p) for p, _ in chunk]
            # built on the host row by row, then one copy to the device (the forward below)
            ids = torch.full((len(chunk), max(lens)), self.pad_id, dtype=torch.long, device="cpu")
            for i, (p, _) in enumerate(chunk):  # right padding: no real token sees the pads
                ids[i, :len(p)] = torch.tensor(p, dtype=torch.long, device="cpu")
            cache.begin_prefill([(len(p), rows) for p, rows in chunk])
            # (b, T, C); only the last real token is projected
            h = model(ids.to(dev), cache=cache, hidden=True)
            last = torch.tensor([n - 1 for n in lens], device=dev)
            lg = model.lm_head(h[torch.arange(len(chunk), device=dev), last]).float()  # (b, V)
            if logits is None:
                logits = lg.new_empty(N, lg.shape[-1])
            rows = torch.tensor([r for _, rs in chunk for r in rs], device=dev)
            logits[rows] = lg[torch.tensor([i for i, (_, rs) in enumerate(chunk)
                                            for _ in rs], device=dev)]
        return logits, len(chunks)

    @torch.no_grad()
    def generate(self, prompt_ids, group_size=1, seed=0, force=None):
        """G completions of each prompt (token-id lists) -> Rollouts; Transformer.packed() on.
        force: a token list per row (N = len(prompt_ids) * G): decode those tokens instead of
        sampling, each row ending where its list ends ("length" unless its last token is EOS), with
        ro.logp their log-probs under this engine's model. The same tokens at the same lengths,
        so the same work: how train.py times dense decode against a sparse rollout."""
        parts, G = [], group_size
        with getattr(self.model, "packed", contextlib.nullcontext)():
            for i, (a, b) in enumerate(self.calls(prompt_ids, G)):  # one, unless the pool is small
                s = seed if i == 0 else (seed + i * SPLIT_SEED) % 2**63
                if self.speculative and force is None:
                    parts.append(generate_speculative(self, prompt_ids[a:b], G, s))
                else:
                    parts.append(self._generate(prompt_ids[a:b], G, s, None if force is None
                                                else force[a * G:b * G]))
        ro = parts[0] if len(parts) == 1 else concat_rollouts(parts, self.pad_id)
        ro.timings["generate_calls"] = len(parts)
        return ro

    def calls(self, prompt_ids, G):
        """The call's prompts in consecutive runs [(start, end)] whose pages fit the pool (one run
        where it has no cap or num_pages is set); a prompt's G rows are never split. What
        generate runs, and how held-out evaluation cuts its prompts into calls."""
        ps, n = self.page_size, len(prompt_ids)
        cap = -(-self.pool.tokens // ps)
        if not cap or self.num_pages or not n:
            return [(0, n)]
        new = self.max_new_tokens + max(self.speculative, self.adapt_k)  # adapt_k: k may grow
        keys = [tuple(p) for p in prompt_ids] if self.share_prefix else None
        spans, a = [], 0
        while a < n:
            groups, b = {}, a  # distinct prompt (or row, unshared) -> (length, rows)
            while b < n:
                for k, rows in ([(keys[b], G)] if keys else [((b, g), 1) for g in range(G)]):
                    groups[k] = (len(prompt_ids[b]), groups.get(k, (0, 0))[1] + rows)
                S, P, R = lane_pages(groups.values(), ps, new)
                need = S * P + (b + 1 - a) * G * R
                if need > cap:  # prompt b opens the next call
                    break
                b += 1
            if b == a:
                raise ValueError(f"prompt {a} ({len(prompt_ids[a])} tokens) with its {G} rows "
                                 f"needs {need} KV pages of {ps} tokens; the pool holds {cap} "
                                 f"(config key kv_pool_tokens, Engine(pool_tokens=...) = "
                                 f"{self.pool.tokens}): raise it, or 0 for one rollout batch")
            spans.append((a, b))
            a = b
        return spans

    def _take_step(self, out, lps, finish, live, tok, lp, force):
        """Row live[j] takes token tok[j] (log-prob lp[j]) -> the j of the rows that end at it: at
        EOS, at a stop string, or at the end of its forced tokens."""
        tok_l, lp_l = tok.tolist(), lp.tolist()  # CPU-GPU sync point, once per step
        eos, done = set(self.eos.tolist()), set()
        for j, r in enumerate(live):
            out[r].append(tok_l[j])  # EOS is sampled and trained on; it is not part of the text
            lps[r].append(lp_l[j])
            if tok_l[j] in eos:
                finish[r] = "eos"
                done.add(j)
            elif force is not None and len(out[r]) == len(force[r]):
                done.add(j)
        if self.stop:
            cand = [r for j, r in enumerate(live) if j not in done]
            hit = set(self._stopped(out, cand))
            for j, r in enumerate(live):
                if r in hit:
                    finish[r] = "stop"
                    done.add(j)
        return done

    def _generate(self, prompt_ids, group_size, seed, force=None):
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
        budget = [[-(-len(prompt_ids[r // group_size]) // ps)] for r in range(N)]  # all pages
        dense = [list(b) for b in budget]
        finish = ["length"] * N
        live = list(range(N))  # row id of each row still in the batch
        sparse_layers = max(0, L - self.dense_layers) if self.budget is not None else 0
        pages_read = pages_dense = 0
        topk = []  # per step: (rows live at it, values (B, k), ids (B, k)), kept on the device
        for step in range(self.max_new_tokens):
            if self.topk:
                topk.append((list(live), *topk_logprobs(logits, self.temperature, self.topk)))
            tok, lp = sample(logits, self.temperature, self.top_p, gen)
            if force is not None:  # teacher-forced: the given tokens, their log-probs here
                tok = torch.tensor([force[r][step] for r in live], device=dev)
                t = self.temperature if self.temperature > 0 else 1.0
                lp = F.log_softmax(logits / t, -1).gather(-1, tok[:, None])[:, 0]
            done = self._take_step(out, lps, finish, live, tok, lp, force)
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
        real = sum(len(p) * len(rows) for p, rows in groups)  # what a naive engine prefills
        # per layer: what the selections really read (counted in the cache), dense layers all
        per_layer = pages_dense / L
        counted = (cache.read_layer.double() / cache.H).tolist()  # CPU-GPU sync point, once
        read_layer = [per_layer if l < L - sparse_layers else counted[l] for l in range(L)]
        timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_calls": calls,
                   "prefill_tokens": sum(len(p) for p, _ in groups), "prefill_tokens_naive": real,
                   "pages_read": pages_read, "pages_dense": pages_dense,
                   "pages_read_layer": read_layer,
                   "pages_total": cache.num_pages, "pages_peak": cache.peak,
                   "pages_free_end": cache.num_pages - cache.used}
        ro = self._pack(prompt_ids, group_size, out, lps, finish, timings, budget, dense)
        if self.topk:
            ro.topk_logp, ro.topk_ids = self._pack_topk(topk, N, ro.tokens.shape[1])
        if self.record_pages:
            ro.read_pages = self._pack_pages(cache, N, ro.tokens.shape[1])
        ro.experts = cache.routes.result(ro.tokens.shape[1])  # None unless MoE
        return ro

    # ---- speculative decoding (speculative = k > 0)

    def _pack_pages(self, cache, N, T):
        """The recorded selections -> (N, T, sparse layers, H_kv, P) bool, what distill.ReplayCache
        replays. A record's step is the completion position it made (an int, or one a row in
        speculative mode, where a later draft at a position replaces an earlier one)."""
        L, dl, P = self.model.config.num_hidden_layers, self.dense_layers, cache.table.shape[1]
        # host: ro.read_pages lives there (P: padding), as every Rollouts field does
        out = torch.zeros(N, T, max(0, L - dl), cache.H, P + 1, dtype=torch.bool, device="cpu")
        heads = torch.arange(cache.H, device="cpu")[None, :, None]
        for step, rows, layer, sel, n_sel in cache.record:
            valid = torch.arange(sel.shape[-1], device=sel.device) < n_sel[..., None]  # (B, Hkv, S)
            idx = torch.where(valid, sel.long(), P).cpu()
            r = torch.tensor(rows, device="cpu")
            if torch.is_tensor(step):
                step = step.cpu()
                keep = step < T  # a draft past the row's end (dropped after its EOS)
                r, step, idx = r[keep], step[keep], idx[keep]
                out[r, step, layer - dl] = False
                step = step[:, None, None]
            out[r[:, None, None], step, layer - dl, heads, idx] = True
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
        N, T, cpu = len(out), max(1, max(len(o) for o in out)), "cpu"  # Rollouts: on the host
        tokens = torch.full((N, T), self.pad_id, dtype=torch.long, device=cpu)
        mask = torch.zeros(N, T, dtype=torch.bool, device=cpu)
        logp, bud, bud_dense = (torch.zeros(N, T, device=cpu) for _ in range(3))
        for i, (o, l) in enumerate(zip(out, lps)):
            tokens[i, :len(o)] = torch.tensor(o, dtype=torch.long, device=cpu)
            mask[i, :len(o)] = True
            logp[i, :len(l)] = torch.tensor(l, device=cpu)
            bud[i, :len(o)] = torch.tensor(budget[i][:len(o)], dtype=torch.float, device=cpu)
            bud_dense[i, :len(o)] = torch.tensor(dense[i][:len(o)], dtype=torch.float, device=cpu)
        texts = self.tok.batch_decode(out, skip_special_tokens=True)
        pidx = torch.arange(len(prompt_ids), device=cpu).repeat_interleave(G)
        timings["new_tokens"] = int(mask.sum())
        return Rollouts(pidx, tokens, mask, logp, finish, texts, G, timings, bud, bud_dense)


def concat_rollouts(parts, pad_id):
    """The Rollouts of consecutive calls (Engine.generate split one that did not fit the pool) as
    one: rows in order, each field padded as its call pads it; timings summed, the pool's figures
    their extreme, the speculative ratios recomputed over the whole."""
    def cat(xs, fill):  # (n_i, *dims) on the host -> (sum n_i, *max dims), `fill` past each
        if xs[0] is None:
            return None
        dims = [max(x.shape[d] for x in xs) for d in range(1, xs[0].dim())]
        out, i = xs[0].new_full((sum(len(x) for x in xs), *dims), fill), 0
        for x in xs:
            out[(slice(i, i + len(x)), *(slice(0, s) for s in x.shape[1:]))] = x
            i += len(x)
        return out
    field = lambda name, fill: cat([getattr(ro, name) for ro in parts], fill)
    first, offsets = parts[0], [0]
    for ro in parts:  # prompt indices: each call numbers its own prompts from 0
        offsets.append(offsets[-1] + len(ro) // ro.group_size)
    ro = Rollouts(torch.cat([x.prompt_index + o for x, o in zip(parts, offsets)]),
                  field("tokens", pad_id), field("mask", False), field("logp", 0.0),
                  [f for x in parts for f in x.finish], [t for x in parts for t in x.texts],
                  first.group_size, _sum_timings(parts), field("budget", 0.0),
                  field("budget_dense", 0.0), field("topk_logp", float("-inf")),
                  field("topk_ids", 0), field("read_pages", False))
    if first.experts is not None:  # MoE: the prompts' entries renumbered, completions padded
        pre, at = [], []
        for x in parts:
            at.append(x.experts.prompt_of + len(pre))
            pre += x.experts.prompts
        ro.experts = Routes(pre, torch.cat(at), cat([x.experts.completion for x in parts], -1))
    return ro


def _sum_timings(parts):
    """The timings of a split call: counts and seconds summed, per-layer lists summed by layer,
    the pool's sizes their extreme, ratios recomputed."""
    t = {}
    for ro in parts:
        for k, v in ro.timings.items():
            if k not in t:
                t[k] = list(v) if isinstance(v, list) else v
            elif k in ("pages_total", "pages_peak", "k"):  # the pool's; k: the largest used
                t[k] = max(t[k], v)
            elif k == "pages_free_end":
                t[k] = min(t[k], v)
            else:
                t[k] = [a + b for a, b in zip(t[k], v)] if isinstance(v, list) else t[k] + v
    if "drafted" in t:  # speculative: the ratios of the whole
        t["acceptance"] = t["accepted"] / t["drafted"] if t["drafted"] else 1.0
        t["tokens_per_verify"] = (t["new_tokens"] - sum(map(len, parts))) / max(1, t["verifies"])
        t["accept_geom"] = t["accepted"] / max(1, t["accepted"] + t["rejections"])
    return t


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
