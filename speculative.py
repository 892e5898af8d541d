"""
speculative.py: stage 2, the sampling rules and lossless sparse rollout (self-speculative decoding):
the sparse policy drafts k tokens, the dense policy verifies them in one forward, and speculative
rejection sampling makes every completion an exact sample of the dense policy, while most steps
read only the pages a sparse budget picks. rollout.Engine runs it (Engine(speculative=k) calls
`generate_speculative`); `sample`, the rule that dense decoding draws with, sits here beside the
two functions that must reproduce it exactly.

    from sparsity import fraction_budget
    engine = Engine(model, tokenizer, sparse=fraction_budget(1 / 8), speculative=4)
    ro = engine.generate(prompt_ids, group_size=8, seed=0)  # every token a dense sample
    ro.timings["acceptance"], ro.timings["tokens_per_verify"]

    python -m bench specdecode --threads 1   # against dense decode at 1k-4k cached tokens
    python -m pytest tests/test_speculative.py

A call (speculative = k > 0):
    1. The first token comes from the dense prefill, as above. Then each round, per live row: k
       draft steps of ordinary decode with the engine's budget, scorer and kernels (`sparse=`;
       without it the draft is dense and every draft is accepted), keeping each step's
       distribution q; then one verify forward of the row's last token and its k drafts with dense
       attention over the row's paged cache (PagedKVCache.begin_verify: a chunk of prefill on
       paged KV), which writes the dense K and V over the draft's.
    2. `speculative_sample`: draft x is accepted with probability min(1, p(x) / q(x)); the first
       rejected one is replaced by a draw from norm(max(0, p - q)); after k acceptances a bonus
       token comes from p. So a round yields 1 to k + 1 tokens, and the cache is cut back
       (PagedKVCache.truncate) to the accepted ones. Temperature 0: a draft is kept iff it is the
       dense argmax. With top_p < 1, p and q are both the top-p-truncated, renormalised
       distributions: the samples are exactly what dense decoding's `sample` draws.
    3. ro.logp is the dense policy's log-softmax(logits / T) at each token (as in dense decoding:
       top-p ignored, greedy at T = 1), ro.topk_* are the dense distribution's (alpha against
       dense is 1: "exact"), and ro.budget = ro.budget_dense (the dense policy's pages). A row
       ends exactly as in dense decoding: tokens after an EOS, a stop string or max_new_tokens
       inside an accepted block are dropped.
    4. Random streams: drafts and the token after them draw from the seed's generator in (B, V)
       multinomials, as dense decoding's steps do; the acceptance uniforms from a second one
       (seed + ACCEPT_SEED). At full budget (p = q) every draft is accepted and the tokens are
       dense decoding's under the same seed.
    5. Timings add k, draft_s, verify_s (its acceptance step included), drafted, accepted, verifies
       (row-verifies), verify_calls (forwards), rejections (row-verifies that rejected a draft),
       acceptance = accepted / drafted, accept_geom = accepted / (accepted + rejections) (the
       chance a draft is accepted after accepted ones) and
       tokens_per_verify = (new_tokens - rows) / verifies (the first token is the prefill's).
       pages_read (and pages_read_layer) counts both passes (the draft's selections, and every
       page of a row once per verify); pages_dense is what dense decoding reads for the same
       tokens.
    6. The draft model (Engine(draft=...)) may differ from the verifying one: any draft keeps
       the samples exact; a better one only raises acceptance. DistillSparse's adapter copy is
       such a draft (sparse_rollout.py). record_pages then records the draft's selections at
       each row's own positions (the last draft at a position wins), and a token no draft made
       (the bonus after k acceptances) is recorded as reading every page.
    7. Adaptive k (Engine(adapt_k=K)): after each call the engine sets the next call's k to
       `best_k` of this call's figures: the per-draft acceptance, a draft step's and a verify's
       seconds, k in 1..K. The samples stay exact for any k.
    8. Simplifications: k is fixed within a call; a verify writes up to k positions past the last
       token a row can keep (the pool holds max_new_tokens + k a row); MoE routes are not
       recorded (ro.experts is None). The draft attends over the verify's K and V for the
       positions before its round, not over K and V of its own.

Where a verify's time goes: on a CPU with lanes its attention (kvcache.PagedKVCache.begin_verify)
reads each row's cache in place, the k + 1 queries of a KV head joining its group as G * (k + 1)
queries of one decode step, so a verify reads the KV once, as a dense step does, and does k + 1
times its arithmetic; on a GPU (and with the free list) it gathers each row's cache and runs SDPA,
the reference. Every round also runs k + 1 forwards' fixed costs (k drafts and the verify): where
a step's weights and launches cost as much as its KV reads, the draft saves little.
"""

import time

import torch
import torch.nn.functional as F

from moe import record_routes

ACCEPT_SEED = 0x5EC  # the acceptance uniforms' generator is seeded seed + this


def topk_logprobs(logits, temperature, k):
    """logits (B, V) fp32 -> the k largest log-probs of softmax(logits / T) (B, k) and their token
    ids (B, k), descending; at temperature <= 0 (greedy) the distribution is taken at T = 1, as
    `sample` reports it."""
    t = temperature if temperature > 0 else 1.0
    return F.log_softmax(logits / t, -1).topk(k, dim=-1)


def top_p_probs(probs, top_p):
    """probs (..., V) -> the same with the tokens outside the nucleus zeroed, not renormalised:
    kept is the smallest prefix of sorted tokens whose mass reaches top_p (all of them at 1)."""
    if top_p >= 1.0:
        return probs
    sp, si = probs.sort(-1, descending=True)
    drop = (sp.cumsum(-1) - sp) >= top_p  # mass before each token: the top one always stays
    return probs.scatter(-1, si, sp.masked_fill(drop, 0.0))


def sample(logits, temperature, top_p, gen):
    """logits (B, V) fp32 -> token (B,), log-prob of it under softmax(logits / T) (B,)."""
    if temperature <= 0:  # greedy; the log-prob is reported at temperature 1
        tok = logits.argmax(-1)
        return tok, F.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    logp = F.log_softmax(logits / temperature, -1)
    probs = top_p_probs(logp.exp(), top_p)
    tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def draft_sample(logits, temperature, top_p, gen):
    """A draft step of speculative decoding: logits (B, V) fp32 -> token (B,) drawn with the same
    generator calls as `sample`, and q (B, V), the distribution it was drawn from (top-p-truncated,
    renormalised); q is None at temperature 0 (greedy: the argmax)."""
    if temperature <= 0:
        return logits.argmax(-1), None
    probs = top_p_probs(F.log_softmax(logits / temperature, -1).exp(), top_p)
    tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return tok, probs / probs.sum(-1, keepdim=True)


def speculative_sample(logits, drafts, q, temperature, top_p, gen, gen_accept):
    """Speculative rejection sampling. logits (B, k + 1, V) fp32: the dense policy's at each draft
    position and at the one after the last; drafts (B, k); q (B, k, V) the draft's distributions
    (draft_sample) -> n (B,) drafts accepted, next (B,) the token that follows them.
        Draft i is accepted with probability min(1, p(x) / q(x)) (while every draft before it was);
    the first rejected one is replaced by a draw from norm(max(0, p - q)); a row that accepts all
    k draws a bonus token from p at position k. Each accepted token and `next` are then exact
    samples of p given the tokens before them. p and q are both the top-p-truncated, renormalised
    distributions at the temperature: exactly what `sample` draws from. Temperature 0: a draft is
    accepted iff it is the dense argmax, and next is the dense argmax after the accepted ones.
        The acceptance uniforms come from gen_accept; `next` from gen, in one (B, V) multinomial
    as `sample` draws a step: where p == q (the full budget), gen serves the draft steps and the
    bonus token exactly as it serves dense decoding's steps, so the tokens are dense decoding's."""
    B, k = drafts.shape
    ar = torch.arange(B, device=drafts.device)
    if temperature <= 0:
        best = logits.argmax(-1)  # (B, k + 1)
        n = (drafts == best[:, :k]).long().cumprod(-1).sum(-1)
        return n, best[ar, n]
    p = top_p_probs(F.log_softmax(logits / temperature, -1).exp(), top_p)
    p = p / p.sum(-1, keepdim=True)  # (B, k + 1, V)
    px, qx = (d[:, :k].gather(-1, drafts[..., None])[..., 0] for d in (p, q))  # (B, k)
    u = torch.rand(B, k, generator=gen_accept, device=logits.device)
    n = (u * qx < px).long().cumprod(-1).sum(-1)  # accepted while u < p(x) / q(x)
    # row b draws at position n[b] from the residual; past the last draft q is 0: p itself
    qn = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], 1)[ar, n]  # (B, V)
    res = (p[ar, n] - qn).clamp_(min=0)
    res = torch.where(res.sum(-1, keepdim=True) > 0, res, p[ar, n])  # p == q but for rounding
    return n, torch.multinomial(res, 1, generator=gen)[:, 0]


def best_k(accept, draft_s, verify_s, k_max):
    """The draft length with the most tokens a second, from a call's measured figures: accept, the
    chance a draft is accepted given the ones before it were (a geometric model: accepted /
    (accepted + rejections)); draft_s, seconds a draft step; verify_s, seconds a verify. A round of
    k drafts yields (1 - a^(k+1)) / (1 - a) tokens in k * draft_s + verify_s seconds (the verify's
    cost taken as fixed in k: its weights and launches, not its k + 1 queries, dominate where
    drafting pays) -> k in 1..k_max."""
    a = min(max(accept, 0.0), 1 - 1e-9)
    rate = lambda k: (1 - a ** (k + 1)) / (1 - a) / (k * draft_s + verify_s)
    return max(range(1, k_max + 1), key=rate)


def generate_speculative(eng, prompt_ids, group_size, seed):
    """The dense prefill's first token, then rounds over the live rows: k draft steps
    (`_draft`: the engine's decode, sparse if `sparse=`), one dense verify forward of k + 1
    tokens a row (`_verify`), speculative_sample, and the rows' bookkeeping (`_take`). Every
    token is an exact sample of the dense policy; its log-prob and top-k are the dense ones."""
    eng._check_lengths(prompt_ids)
    model, dev, k = eng.model, eng.model.lm_head.weight.device, eng.speculative
    gen = torch.Generator(device=dev).manual_seed(seed)  # drafts and the token after them
    gen_accept = torch.Generator(device=dev).manual_seed(seed + ACCEPT_SEED)  # uniforms
    N, ps, L = len(prompt_ids) * group_size, eng.page_size, model.config.num_hidden_layers
    groups = eng._groups(prompt_ids, group_size)
    cache = eng._new_cache(groups, N)
    cache.routes = record_routes(None, 0)  # MoE routes: not recorded in this mode
    cache.record = [] if eng.record_pages else None  # the draft's selections
    st = dict(draft_s=0.0, verify_s=0.0, drafted=0, accepted=0, verifies=0, verify_calls=0,
              draft_steps=0, full_rounds=0, pages_read=0, pages_dense=0, draft_pages=0,
              verify_pages=0)
    t0 = time.perf_counter()
    logits, calls = eng._prefill(cache, groups, N)
    t1 = time.perf_counter()
    out, lps, finish = [[] for _ in range(N)], [[] for _ in range(N)], ["length"] * N
    # pages cached at the step that made each token (the prompt's for the first): every
    # token is the dense policy's, so ro.budget and ro.budget_dense are both this
    pages = [[-(-len(prompt_ids[r // group_size]) // ps)] for r in range(N)]
    topk, live = [], list(range(N))
    last, lp = sample(logits, eng.temperature, eng.top_p, gen)  # dense, as Engine._generate
    _record_topk(eng, topk, logits[:, None], live, [0] * N, [1] * N)
    taken, done = _take(eng, out, lps, finish, live, [[t] for t in last.tolist()],
                        [[x] for x in lp.tolist()])
    while True:
        for j in done:
            cache.release(live[j])
        keep = [j for j in range(len(live)) if j not in done]
        if not keep:
            break
        live, last = [live[j] for j in keep], last[torch.tensor(keep, device=dev)]
        n0 = [cache.lens[r] for r in live]  # cached tokens; `last` goes in at n0
        t2 = time.perf_counter()
        drafts, q = _draft(eng, cache, live, last, gen, st, [len(out[r]) for r in live])
        t3 = time.perf_counter()
        logits = _verify(eng, cache, live, n0, last, drafts, st)  # (B, k + 1, V)
        n, nxt = speculative_sample(logits, drafts, q, eng.temperature, eng.top_p, gen,
                                    gen_accept)
        ar = torch.arange(len(live), device=dev)
        toks = torch.cat([drafts, nxt[:, None]], 1)
        toks[ar, n] = nxt  # (B, k + 1): the accepted drafts, next, then what is dropped
        t = eng.temperature if eng.temperature > 0 else 1.0  # as `sample` reports it
        lp = F.log_softmax(logits / t, -1).gather(-1, toks[..., None])[..., 0]
        n_l, toks_l, lp_l = n.tolist(), toks.tolist(), lp.tolist()  # CPU-GPU sync point
        st["draft_s"], st["verify_s"] = (st["draft_s"] + t3 - t2,
                                         st["verify_s"] + time.perf_counter() - t3)
        st["drafted"], st["accepted"] = st["drafted"] + k * len(live), st["accepted"] + sum(n_l)
        st["full_rounds"] += sum(a == k for a in n_l)
        taken, done = _take(eng, out, lps, finish, live,
                            [x[:a + 1] for x, a in zip(toks_l, n_l)], lp_l)
        _record_topk(eng, topk, logits, live, [len(out[r]) - c for r, c in zip(live, taken)],
                     taken)
        for j, (r, c) in enumerate(zip(live, taken)):
            pages[r] += [(n0[j] + i) // ps + 1 for i in range(c)]
            st["pages_dense"] += L * sum(pages[r][-c:])
            if j not in done:  # the accepted drafts' positions stay; the rest is cut
                cache.truncate(r, n0[j] + c)
        last = nxt
    t4 = time.perf_counter()
    return _pack(eng, prompt_ids, group_size, groups, cache, out, lps, finish, pages, topk, st,
                 (t0, t1, t4), calls)


def _draft(eng, cache, live, last, gen, st, pos):
    """k decode steps of the live rows from their last tokens, with the engine's budget and
    draft model -> drafts (B, k) and the distributions they were drawn from, q (B, k, V) (None:
    greedy). pos: the completion position each row's first draft makes (the page records')."""
    L = eng.model.config.num_hidden_layers
    pos = torch.tensor(pos, device="cpu")  # host: the page records' steps (Engine._pack_pages)
    sparse_layers = max(0, L - eng.dense_layers) if eng.budget is not None else 0
    toks, qs, cur = [], [], last
    for i in range(eng.speculative):
        cache.begin_decode(live)
        st["draft_steps"] += 1
        cache.step = st["draft_steps"]  # draft steps count from 1: rescore_every's clock
        st["pages_read"] += (sum(cache.n_read) * sparse_layers
                             + sum(cache.n_pages) * (L - sparse_layers))
        st["draft_pages"] += sum(cache.n_pages)  # what a dense layer of the draft reads
        mark = len(cache.record) if cache.record is not None else 0
        logits = eng.draft(cur[:, None], cache=cache)[:, -1]  # (B, V)
        if cache.record is not None:  # this step's selections, at each row's own position
            cache.record[mark:] = [(pos + i, *x[1:]) for x in cache.record[mark:]]
        cur, q = draft_sample(logits, eng.temperature, eng.top_p, gen)
        toks.append(cur)
        qs.append(q)
    if cur.is_cuda:  # draft_s counts the draft's kernels, not just their launches
        torch.cuda.synchronize()
    return torch.stack(toks, 1), (None if qs[0] is None else torch.stack(qs, 1))


def _verify(eng, cache, live, n0, last, drafts, st):
    """One dense forward of each live row's last token and its k drafts over its paged cache
    (PagedKVCache.begin_verify): the rows are cut back to where the draft began, n0, and the
    verify's K and V overwrite the draft's. -> logits (B, k + 1, V) fp32, the dense policy's
    next-token logits after each of them."""
    for r, n in zip(live, n0):
        cache.truncate(r, n)
    cache.begin_verify(live, drafts.shape[1] + 1)
    st["verify_pages"] += sum(cache.n_pages)  # every layer reads them once
    st["pages_read"] += sum(cache.n_pages) * eng.model.config.num_hidden_layers
    st["verifies"], st["verify_calls"] = st["verifies"] + len(live), st["verify_calls"] + 1
    return eng.model(torch.cat([last[:, None], drafts], 1), cache=cache)


def _take(eng, out, lps, finish, rows, toks, lp):
    """Row rows[j] takes toks[j] (with log-probs lp[j]) in order, as dense decoding takes one a
    step: it ends at EOS, at a stop string or at max_new_tokens, and drops what follows.
    -> (tokens taken per row, the j of the rows that ended)."""
    eos, taken, done, check = set(eng.eos.tolist()), [], set(), []
    for j, r in enumerate(rows):
        n0 = len(out[r])
        for t, x in zip(toks[j], lp[j]):
            out[r].append(t)  # EOS is sampled and trained on; it is not part of the text
            lps[r].append(x)
            if t in eos or len(out[r]) == eng.max_new_tokens:
                finish[r] = "eos" if t in eos else finish[r]
                done.add(j)
                break
        taken.append(len(out[r]) - n0)
        check.append(taken[-1] - (finish[r] == "eos"))  # tokens a stop string may end at
    for c in range(1, max(check) + 1 if eng.stop else 1):  # one token at a time, as dense
        at = {j: out[r][:len(out[r]) - taken[j] + c] for j, r in enumerate(rows)
              if check[j] >= c and finish[r] != "stop"}
        for j in eng._stopped(at, list(at)) if at else []:
            r, cut = rows[j], len(out[rows[j]]) - taken[j] + c
            del out[r][cut:], lps[r][cut:]
            finish[r], taken[j] = "stop", c
            done.add(j)
    return taken, done


def _record_topk(eng, topk, logits, rows, start, count):
    """The top-k of the dense distributions (B, T, V) at the positions rows[j] took: count[j]
    from completion position start[j]; kept as (rows, positions, values, ids)."""
    if not eng.topk:
        return
    vals, ids = topk_logprobs(logits, eng.temperature, eng.topk)  # (B, T, k)
    j = [j for j, c in enumerate(count) for _ in range(c)]
    i = [i for c in count for i in range(c)]
    r = [rows[a] for a in j]
    pos = [start[a] + b for a, b in zip(j, i)]
    dev = logits.device
    j, i = torch.tensor(j, device=dev), torch.tensor(i, device=dev)
    topk.append((torch.tensor(r, device=dev), torch.tensor(pos, device=dev), vals[j, i],
                 ids[j, i]))


def _pack(eng, prompt_ids, G, groups, cache, out, lps, finish, pages, topk, st,
                      times, calls):
    """Rollouts of a speculative call: ro.budget = ro.budget_dense (the dense policy's pages at
    every token), the timings of Engine._generate plus the draft's and the verify's."""
    t0, t1, t2 = times
    drafted, new = st["drafted"], sum(len(o) for o in out)
    # per layer, both passes: the draft's selections (counted in the cache, averaged over KV
    # heads) or every page in its dense layers, and every page once a verify
    L = eng.model.config.num_hidden_layers
    dense_l = L if eng.budget is None else min(L, eng.dense_layers)
    counted = (cache.read_layer.double() / cache.H).tolist()  # CPU-GPU sync point, once
    read_layer = [st["verify_pages"] + (st["draft_pages"] if l < dense_l else counted[l])
                  for l in range(L)]
    timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_calls": calls,
               "prefill_tokens": sum(len(p) for p, _ in groups),
               "prefill_tokens_naive": sum(len(p) * len(rows) for p, rows in groups),
               "pages_read": st["pages_read"], "pages_dense": st["pages_dense"],
               "pages_read_layer": read_layer,
               "pages_total": cache.num_pages, "pages_peak": cache.peak,
               "pages_free_end": cache.num_pages - cache.used,
               **{key: st[key] for key in ("draft_s", "verify_s", "drafted", "accepted",
                                            "verifies", "verify_calls")},
               "acceptance": st["accepted"] / drafted if drafted else 1.0,
               # the first token of a row comes from prefill, not from a verify
               "tokens_per_verify": (new - len(out)) / max(1, st["verifies"])}
    # per-draft acceptance (geometric: each rejection ends a round) and, with adapt_k, the next
    # call's k from this call's figures
    timings["k"] = eng.speculative
    fails = st["verifies"] - st["full_rounds"]
    timings["rejections"] = fails  # rounds that rejected a draft (the whole call's, when split)
    timings["accept_geom"] = st["accepted"] / max(1, st["accepted"] + fails)
    if eng.adapt_k and st["draft_steps"] and st["verify_calls"]:
        eng.speculative = best_k(timings["accept_geom"], st["draft_s"] / st["draft_steps"],
                                 st["verify_s"] / st["verify_calls"], eng.adapt_k)
    ro = eng._pack(prompt_ids, G, out, lps, finish, timings, pages, pages)
    if eng.record_pages:  # a token no draft made (a bonus token) replays dense: every page
        ro.read_pages = eng._pack_pages(cache, len(out), ro.tokens.shape[1])
        none = ~ro.read_pages.any(-1, keepdim=True)
        ro.read_pages |= none & ro.mask[:, :, None, None, None]
    if eng.topk:
        T, dev = ro.tokens.shape[1], topk[0][2].device
        vals = torch.full((len(out), T, eng.topk), float("-inf"), device=dev)
        ids = torch.zeros((len(out), T, eng.topk), dtype=torch.long, device=dev)
        for r, pos, v, i in topk:
            vals[r, pos], ids[r, pos] = v, i
        ro.topk_logp, ro.topk_ids = vals.cpu(), ids.cpu()
    return ro
