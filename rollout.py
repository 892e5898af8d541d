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

    # the decode step (decode.py): rounds of 8 static steps, the host looking once a round
    engine = Engine(model, tokenizer, sync_every=8, step="auto")  # eager|fused|compile|graph
    call = engine.start(prompt_ids, 8, seed=0)   # prefill, first tokens: a decode.Call
    while call.live:
        engine.decode(call, 8)                     # 8 decode steps of the live rows
    ro = engine.finish(call)

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
    3. Decode: rounds of decode steps (`decode`, the public step API: decode.decode_step, the
       one step, with static shapes: the live rows in a padded bucket, their state on the
       device, EOS and length checked there), one query token per row through the model, which
       calls the cache's positions, attend and advance; the host looks once a round.
    4. Dense decode reads every page. Sparse decode (`sparse=` a budget function from sparsity.py)
       reads, in each layer past the first `dense_layers`, the pages that `sparsity.select_pages`
       picks from the page metadata (mean key, and min/max keys for Quest). The first
       `keep_first` pages and the last `keep_recent` (and the partial last page) are always read;
       `rescore_every=k` scores the pages once in k steps (kvcache.py).
    5. Sampling (`sample`, in speculative.py): temperature, top-p, draws keyed by the seed,
       the row and its position (speculative.Noise: a row's tokens never depend on its batch); the
       log-prob of the sampled token is taken under softmax(logits / temperature), which the
       trainer recomputes, so the two compare token by token. With `topk_logprobs=k` the engine
       also keeps the k largest log-probs of that distribution (values and token ids) at every
       sampled position, what `sparsity.alpha_topk` needs to bound the acceptance rate (k =
       vocab_size: the whole distribution, exact alpha).
    6. A row stops at EOS, at a stop string, or at max_new_tokens; it leaves the batch when the
       host next looks (the end of its round) and its pages go back (a shared prompt page when
       its last row finishes). The model runs the
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
spec_draft="sparse" | "suffix" | "mix" (speculative only: the drafts, from the sparse policy, from
the group's own text, drafts.py, or each row's better one per round); kv_dtype="auto" | "float32"
| "bfloat16" (the KV pool's dtype; auto: bf16 on CUDA, the model's weight dtype elsewhere:
`kv_dtype_for`); pool_tokens=0 (the KV pool's cap in tokens, rounded up to pages; 0: none, each
call takes what it needs); pool=None (a kvcache.KVPool to share with other engines, its own cap
holding; None: one of the engine's own); sync_every=8 (decode steps a round: the host looks at
the rows once a round); step="auto" | "eager" | "fused" | "compile" | "graph" (how the step's
forward runs, decode.Runner; auto: a CUDA graph per bucket where safe, on a CPU the fused step
where the model allows it, else eager).
Timings: prefill_s, decode_s, new_tokens; prefill_calls, prefill_tokens and prefill_tokens_naive
(what prefilling every row would cost); pages_read and pages_dense (KV pages read by decode
attention, summed over steps, rows and layers, and what dense decode reads); pages_read_layer
(per layer: what its selections read, counted in the cache, summed over steps and rows, averaged
over KV heads; a dense layer reads pages_dense / layers); pages_total,
pages_peak, pages_free_end (the pages the call laid out, held at most, free at its end);
generate_calls (1, or the calls a split ran); compile_s (compiling or capturing the decode
step, not in decode_s); decode_steps (decode.decode_step calls).

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

from decode import STEPS, Call, Runner, look, run_mode, run_round, take
from drafts import DraftStats, RolloutHistory
from kvcache import PagedKVCache
from kvpool import KVPool
from moe import Routes, record_routes
from speculative import Noise, generate_speculative, sample, topk_logprobs

PREFILL_TOKENS = 16384  # padded tokens per prefill forward: bounds the activations of a long batch
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # kv_dtype's, besides auto
SPLIT_SEED = 0x5917  # part i > 0 of a split call samples with seed + i * this
SPEC_DRAFTS = ("sparse", "suffix", "mix")  # Engine(spec_draft=...), config key spec_draft


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
                 kv_dtype="auto", pool_tokens=0, pool=None, sync_every=8, step="auto",
                 spec_draft="sparse"):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stop = [s for s in stop if s]
        own = getattr(model.config, "eos_token_id", None)  # Qwen3 has two (warmstart.py)
        eos = eos_ids if eos_ids is not None else [e for e in dict.fromkeys(  # any ends a row
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
        self._speculative_options(model, speculative, draft, adapt_k, spec_draft)
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
        if not (isinstance(sync_every, int) and sync_every >= 1) or step not in STEPS:
            raise ValueError(f"sync_every must be an int >= 1 and step one of {STEPS}, got "
                             f"{sync_every!r}, {step!r}")
        # decode.py: rounds of sync_every steps; MoE's router syncs and its routes are recorded
        # by the host, so its rounds are single steps with no padding slots
        self.sync_every, self.step_mode, self.slots = sync_every, step, {}
        self.one_step = bool(getattr(model.config, "num_experts", 0))
        self.run = Runner("eager")

    def _speculative_options(self, model, speculative, draft, adapt_k, spec_draft):
        """Engine's speculative keywords, checked, and the state speculative.py keeps across
        calls."""
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
        if spec_draft not in SPEC_DRAFTS:
            raise ValueError(f"spec_draft must be one of {SPEC_DRAFTS}, got {spec_draft!r}")
        # speculative.py: the drafters' running figures (drafts.choose), the verify's seconds,
        # and each prompt's earlier rollouts (the suffix drafter's), kept across calls
        self.spec_draft, self.history = spec_draft, RolloutHistory()
        self.draft_stats = {name: DraftStats(name) for name in ("suffix", "sparse")}
        self.verify_time, self.warm = [0.0, 0], set()  # warm: what ran once (its time counts)
        self.since_sparse = 0  # rounds since the sparse draft last ran (spec_draft=mix)

    def check_lengths(self, prompt_ids):
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

    def groups(self, prompt_ids, G):
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
        width = -(-(longest + new) // ps)  # page-table width; on CUDA a power of two (a
        if w.is_cuda:  # captured decode step is kept per width: few widths, few graphs)
            width = max(width, min(1 << (width - 1).bit_length(), -(-self.max_len // ps)))
        cache = PagedKVCache(self.model.config, N, width, num_pages, ps,
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

    # ---- one call: its start, rounds of decode steps, its Rollouts (the public step API)

    def start(self, prompt_ids, group_size, seed, force=None):
        """A call's start, what dense, sparse and speculative decoding share: the prompts
        prefilled (each distinct one once), each row's first token sampled from the prefill's
        logits (or forced) and taken. -> decode.Call, whose buffers the decode steps fill."""
        self.check_lengths(prompt_ids)
        dev, G, T = self.model.lm_head.weight.device, group_size, self.max_new_tokens
        self.run.mode = run_mode(self)
        N, ps = len(prompt_ids) * G, self.page_size
        groups = self.groups(prompt_ids, G)
        cache = self._new_cache(groups, N)
        cache.record = [] if self.record_pages else None
        self.eos_dev = self.eos.to(dev)  # the finish checks run on the device
        t0 = time.perf_counter()
        logits, calls = self._prefill(cache, groups, N)
        buf = lambda fill, dtype, *k: torch.full((N + 1, T, *k), fill, dtype=dtype, device=dev)
        call = Call(prompt_ids, G, groups, cache, Noise(seed), [[] for _ in range(N)],
                    [[] for _ in range(N)], ["length"] * N,
                    [T] * N if force is None else [len(f) for f in force], list(range(N)),
                    buf(self.pad_id, torch.long), buf(0.0, torch.float32, 3), prefill_calls=calls,
                    times=[t0, time.perf_counter(), self.run.seconds])
        if self.topk:
            call.topv, call.topi = buf(float("-inf"), torch.float32, self.topk), buf(
                0, torch.long, self.topk)
        rows = torch.arange(N, device=dev)
        if force is not None:  # host lists, padded, to the device in one copy
            call.force = buf(0, torch.long)
            call.force[:N] = torch.tensor([list(f) + [0] * (T - len(f)) for f in force],
                                          dtype=torch.long, device="cpu").to(dev)
            tok = call.force[:N, 0]
            t = self.temperature if self.temperature > 0 else 1.0
            lp = F.log_softmax(logits / t, -1).gather(-1, tok[:, None])[:, 0]
        else:
            tok, lp = sample(logits, self.temperature, self.top_p,
                             call.noise.at(rows, torch.zeros_like(rows)))
        call.tokens[:N, 0], call.vals[:N, 0, 0] = tok, lp
        pages = torch.tensor([-(-len(prompt_ids[r // G]) // ps) for r in range(N)],
                             dtype=torch.float32, device="cpu")  # the prompt's: all read
        call.vals[:N, 0, 1:] = pages.to(dev)[:, None]
        if self.topk:
            call.topv[:N, 0], call.topi[:N, 0] = topk_logprobs(logits, self.temperature,
                                                               self.topk)
        # CPU-GPU sync point: the first tokens, on the host
        look(self, call, [[t] for t in tok.tolist()], [[x] for x in lp.tolist()])
        return call

    def decode(self, call, steps, draft=False):
        """`steps` decode steps of the call's live rows, each one decode.decode_step: the one
        step that dense, sparse and speculative decoding run (decode.run_round: the round laid
        out once, the host's one look at its end). draft=True: speculative.py's draft steps, on
        the draft model -> (ids, q, draws)."""
        return run_round(self, call, steps, draft)

    def take(self, call, rows, toks, lps):
        """Row rows[j] takes toks[j] (log-probs lps[j]) in order, as one token a step would: it
        ends at EOS, at a stop string or at its limit (decode.take). -> (taken, done)."""
        return take(self, call, rows, toks, lps)

    def _generate(self, prompt_ids, group_size, seed, force=None):
        """Dense or sparse decoding: the call's start, rounds of sync_every decode steps (one
        where the host must see every step: MoE), its Rollouts."""
        call = self.start(prompt_ids, group_size, seed, force)
        while call.live:
            left = max(call.limit[r] - len(call.out[r]) for r in call.live)
            self.decode(call, min(1 if self.one_step else self.sync_every, left))
        return self.finish(call)

    def finish(self, call, timings=None, pages=None):
        """The call's Rollouts: tokens, log-probs, pages per token (from the call's buffers, or
        `pages` (N, T) on the host: every token the dense policy's, speculative.py), top-k,
        records, routes, and the timings (`timings` adds to them; pages_read, pages_dense and
        pages_read_layer are counted here from the pages per token unless it has them)."""
        cache, N, G = call.cache, len(call.out), call.G
        for r in call.live:
            cache.release(r)
        t0, t1, compile0 = call.times
        compile_s = self.run.seconds - compile0
        T, L = max(1, max(map(len, call.out))), self.model.config.num_hidden_layers
        sparse_layers = max(0, L - self.dense_layers) if self.budget is not None else 0
        n = torch.tensor([len(o) for o in call.out], device="cpu")
        mask = torch.arange(T, device="cpu") < n[:, None]  # host: Rollouts live there
        budget, dense = ((pages, pages) if pages is not None else
                         call.vals[:N, :T, 1:].cpu().unbind(-1))
        budget, dense = budget * mask, dense * mask
        step = mask.clone()
        step[:, 0] = False  # the first token is the prefill's
        read = budget[step].sum() * sparse_layers + dense[step].sum() * (L - sparse_layers)
        counted = (cache.read_layer.double() / cache.H).tolist()  # CPU-GPU sync point, once
        per_layer = float(dense[step].sum())
        timings = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1 - compile_s,
                   "compile_s": compile_s, "prefill_calls": call.prefill_calls,
                   "prefill_tokens": sum(len(p) for p, _ in call.groups),
                   "prefill_tokens_naive": sum(len(p) * len(rs) for p, rs in call.groups),
                   "pages_read": int(read), "pages_dense": int(dense[step].sum()) * L,
                   "pages_read_layer": [per_layer if l < L - sparse_layers else counted[l]
                                        for l in range(L)],
                   "pages_total": cache.num_pages, "pages_peak": cache.peak,
                   "pages_free_end": cache.num_pages - cache.used, **(timings or {})}
        tokens = torch.full((N, T), self.pad_id, dtype=torch.long, device="cpu")
        logp = torch.zeros(N, T, device="cpu")
        for i, (o, l) in enumerate(zip(call.out, call.lps)):
            tokens[i, :len(o)] = torch.tensor(o, dtype=torch.long, device="cpu")
            logp[i, :len(l)] = torch.tensor(l, device="cpu")
        timings["new_tokens"], timings["decode_steps"] = int(mask.sum()), call.steps
        ro = Rollouts(torch.arange(len(call.prompt_ids), device="cpu").repeat_interleave(G),
                      tokens, mask, logp, call.finish,
                      self.tok.batch_decode(call.out, skip_special_tokens=True), G, timings,
                      budget, dense)
        if self.topk:  # positions past a row's end (a round's steps after its stop): padding
            ro.topk_logp = call.topv[:N, :T].cpu().masked_fill(~mask[..., None], float("-inf"))
            ro.topk_ids = call.topi[:N, :T].cpu().masked_fill(~mask[..., None], 0)
        if self.record_pages:
            ro.read_pages = self._pack_pages(cache, N, T) & mask[:, :, None, None, None]
        ro.experts = cache.routes.result(T)  # None unless MoE (and speculative: not recorded)
        return ro

    def _pack_pages(self, cache, N, T):
        """The recorded selections -> (N, T, sparse layers, H_kv, P) bool, what distill.ReplayCache
        replays. A record's step is the completion position it made, and its rows the rows it
        ran (a static step's: tensors, a slot past its row's end or a padding slot at T or
        more, row N); a later record at a position (a draft's) replaces an earlier one."""
        L, dl, P = self.model.config.num_hidden_layers, self.dense_layers, cache.table.shape[1]
        # host: ro.read_pages lives there (P: padding), as every Rollouts field does
        out = torch.zeros(N, T, max(0, L - dl), cache.H, P + 1, dtype=torch.bool, device="cpu")
        heads = torch.arange(cache.H, device="cpu")[None, :, None]
        for step, rows, layer, sel, n_sel in cache.record:
            valid = torch.arange(sel.shape[-1], device=sel.device) < n_sel[..., None]  # (B, Hkv, S)
            idx = torch.where(valid, sel.long(), P).cpu()
            r = rows.cpu() if torch.is_tensor(rows) else torch.tensor(rows, device="cpu")
            if torch.is_tensor(step):
                step = step.cpu()
                keep = (step < T) & (r < N)
                r, step, idx = r[keep], step[keep], idx[keep]
                out[r, step, layer - dl] = False
                step = step[:, None, None]
            out[r[:, None, None], step, layer - dl, heads, idx] = True
        return out[..., :P]


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
    if "drafted" in t:  # speculative: the ratios of the whole, and of each drafter
        t["acceptance"] = t["accepted"] / t["drafted"] if t["drafted"] else 1.0
        for d in ("suffix", "sparse"):
            a, n, r = t[f"{d}_accepted"], t[f"{d}_drafted"], t[f"{d}_rejections"]
            t[f"{d}_acceptance"], t[f"{d}_accept_geom"] = a / max(1, n), a / max(1, a + r)
        t["tokens_per_verify"] = (t["new_tokens"] - sum(map(len, parts))) / max(1, t["verifies"])
        t["accept_geom"] = t["accepted"] / max(1, t["accepted"] + t["rejections"])
    return t


@torch.no_grad()
def generate_naive(model, tokenizer, prompt_ids, group_size=1, seed=0, max_new_tokens=16,
                   temperature=1.0, top_p=1.0, eos_ids=None):
    """The slow reference: no cache, no batching tricks; every step recomputes each row from
    scratch. Returns (tokens per row, log-probs per row) as lists. Shares only `sample` and its
    keyed draws (speculative.Noise) with the engine."""
    dev, noise = model.lm_head.weight.device, Noise(seed)
    eos = eos_ids if eos_ids is not None else [tokenizer.eos_token_id]
    rows = [list(p) for p in prompt_ids for _ in range(group_size)]
    out, lps, live = [[] for _ in rows], [[] for _ in rows], list(range(len(rows)))
    for step in range(max_new_tokens):
        logits = torch.stack([model(torch.tensor([rows[r] + out[r]], device=dev))[0, -1]
                              for r in live])
        ids = torch.tensor(live, device=dev)  # the draws of these rows at this position
        tok, lp = sample(logits, temperature, top_p, noise.at(ids, torch.full_like(ids, step)))
        for j, r in enumerate(live):
            out[r].append(tok[j].item())
            lps[r].append(lp[j].item())
        live = [r for r in live if out[r][-1] not in eos]
        if not live:
            break
    return out, lps
