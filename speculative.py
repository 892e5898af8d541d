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
       draft steps, the engine's decode step (Engine.decode(draft=True): decode.decode_step, with
       the engine's budget, scorer and kernels, `sparse=`; without it the draft is dense and
       every draft is accepted), keeping each step's distribution q; then one verify forward of
       the row's last token and its k drafts with dense attention over the row's paged cache
       (PagedKVCache.begin_verify: a chunk of prefill on paged KV), which writes the dense K
       and V over the draft's. Drafts can also come from the group's own text (below).
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
    4. Random draws (`Noise`): a draft and the token after the drafts draw with the variates of
       their row and completion position, as dense decoding's step at that position does; the
       acceptance uniforms from a stream of their own. At full budget (p = q) every draft is
       accepted and the tokens are dense decoding's under the same seed.
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
    8. Drafts from text the group already has (Engine(spec_draft="suffix" | "mix"), config key
       spec_draft; drafts.py): a suffix index over the prompt, its earlier rollouts
       (Engine.history, kept across calls) and the group's rows proposes up to k tokens a row at
       no forward; with a one-hot q every token stays an exact sample. Each round drafts.choose
       picks, by expected tokens a second from the engine's running figures (each drafter's
       acceptance, a sparse draft step's and a lookup's seconds, a verify's), the round's k,
       whether the sparse draft steps run ("mix" only; after EXPLORE rounds without them they
       run anyway, so that their figures stay current) and, per row, which drafter's tokens the
       verify gets. Timings add, per drafter, {suffix,sparse}_drafted, _accepted, _rejections,
       _acceptance, _accept_geom and _s. An engine's first sparse draft round and first verify
       warm up (lazy builds): their seconds are not counted.
    9. Simplifications: k is fixed within a call (but for the suffix and mixed drafts, where
       each round picks it); a verify writes up to k positions past the last token a row can
       keep (the pool holds max_new_tokens + k a row); MoE routes are not recorded (ro.experts
       is None). The draft attends over the verify's K and V for the
       positions before its round, not over K and V of its own. With suffix drafts, a position
       that a sparse draft recorded (record_pages) and a suffix draft later filled keeps the
       sparse record.

Where a verify's time goes: on a CPU with lanes its attention (kvcache.PagedKVCache.begin_verify)
reads each row's cache in place, the k + 1 queries of a KV head joining its group as G * (k + 1)
queries of one decode step, so a verify reads the KV once, as a dense step does, and does k + 1
times its arithmetic; on a GPU (and with the free list) it gathers each row's cache and runs SDPA,
the reference. Every round also runs k + 1 forwards' fixed costs (k drafts and the verify): where
a step's weights and launches cost as much as its KV reads, the draft saves little.
"""

import math
import time

import torch
import torch.nn.functional as F

from drafts import Choice, DraftStats, GroupDrafter, choose, merge
from moe import record_routes
from zeros_kernels.layer_cpu import model_forward

EXPLORE = 16  # spec_draft=mix: rounds without the sparse draft before one runs it anyway
M32 = 0xFFFFFFFF  # the noise's hashes are 32-bit values held in int64 (no overflow below)


def _mix(x):
    """A 32-bit integer hash (lowbias32's first rounds; multipliers below 2^31, so that a product
    of 32-bit values stays below 2^63): x int64 tensor or int in [0, 2^32) -> the same range,
    its high bits well mixed (the noise takes bits 8..31)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    return (x * 0x2C1B3C6D) & M32


class Noise:
    """The engine's random draws, keyed by (seed, stream, row, completion position, token): a
    row's tokens depend on the seed, the row, its position and its logits, never on which rows
    share its step. So the decode step can run rows in fixed-size buckets with padding, let
    finished rows ride along until the host looks, and draw without a generator's state (a
    compiled or captured step holds none), and still give the tokens of one row at a time
    (generate_naive), of dense decoding and, at full budget, of speculative decoding under the
    same seed. A Generator's draws depend on how many rows each step has: that is what this
    replaces. `at(rows, pos)` binds the draws of a step; sample, draft_sample and
    speculative_sample take that (or a torch.Generator)."""

    def __init__(self, seed):
        self.base = _mix(_mix(seed & M32) ^ (seed >> 32 & M32))
        self.weyl = {}  # (V, device) -> (V,) the tokens' offsets: a Weyl sequence

    def at(self, rows, pos):
        """rows, pos (B,) int64 on the run's device -> Draws for those rows at those positions."""
        return Draws(self, rows, pos)

    def key(self, rows, pos, stream):  # (B,) -> (B,) int64 in [0, 2^32): one a row and position
        return _mix((rows * 0x27D4EB2F + pos * 0x165667B1 + (self.base ^ stream)) & M32)


class Draws:
    """A Noise bound to rows (B,) and their positions (B,): Exp(1) variates per token (the race
    that `sample` runs, torch.multinomial's own rule) and uniforms (the acceptance test)."""

    def __init__(self, noise, rows, pos):
        self.noise, self.rows, self.pos = noise, rows, pos

    def exp(self, V, at=0):
        """(B, V) fp32 Exp(1) variates of each row's tokens at position pos + at (int or (B,))."""
        k = self.noise.key(self.rows, self.pos + at, 0)  # (B,)
        w = self.noise.weyl.get((V, k.device))
        if w is None:
            w = self.noise.weyl[V, k.device] = (torch.arange(V, device=k.device)
                                                * 0x61C88647) & M32
        x = _mix((k[:, None] + w) & M32)  # (B, V)
        return ((x >> 8).float() + 0.5).log_().neg_().add_(24 * math.log(2))  # -log(u), 24 bits

    def uniform(self, k):
        """(B, k) fp32 uniforms in (0, 1) at positions pos .. pos + k - 1 (their own stream)."""
        at = self.pos[:, None] + torch.arange(k, device=self.pos.device)
        x = self.noise.key(self.rows[:, None], at, 0x5EC)
        return ((x >> 8).float() + 0.5) * 2.0 ** -24


def _race(probs, gen, at=0):
    """A draw from each row of probs (B, V), unnormalised, zeros allowed: the argmax of p / E over
    Exp(1) variates E, exact since min_v E_v / p_v is won by v with probability p_v / sum p.
    torch.multinomial draws one sample that way, so with a torch.Generator the token is its; the
    draws take no CPU-GPU sync (multinomial checks its input with two)."""
    if isinstance(gen, torch.Generator):
        e = torch.empty_like(probs).exponential_(generator=gen)
    else:
        e = gen.exp(probs.shape[-1], at)
    return (probs / e).argmax(-1)


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
    """logits (B, V) fp32 -> token (B,), log-prob of it under softmax(logits / T) (B,). gen: the
    step's Draws (Noise.at) or a torch.Generator."""
    if temperature <= 0:  # greedy; the log-prob is reported at temperature 1
        tok = logits.argmax(-1)
        return tok, F.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    logp = F.log_softmax(logits / temperature, -1)
    tok = _race(top_p_probs(logp.exp(), top_p), gen)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def draft_sample(logits, temperature, top_p, gen):
    """A draft step of speculative decoding: logits (B, V) fp32 -> token (B,) drawn with the same
    draws as `sample`, and q (B, V), the distribution it was drawn from (top-p-truncated,
    renormalised); q is None at temperature 0 (greedy: the argmax)."""
    if temperature <= 0:
        return logits.argmax(-1), None
    probs = top_p_probs(F.log_softmax(logits / temperature, -1).exp(), top_p)
    tok = _race(probs, gen)
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
        gen, gen_accept: the round's Draws at the first draft's positions (the same object for
    both: `next` draws at position n, the uniforms from a stream of their own), or two
    torch.Generators. Where p == q (the full budget), `next` draws as `sample` draws at its
    position: the tokens are dense decoding's under the same seed."""
    B, k = drafts.shape
    ar = torch.arange(B, device=drafts.device)
    if temperature <= 0:
        best = logits.argmax(-1)  # (B, k + 1)
        n = (drafts == best[:, :k]).long().cumprod(-1).sum(-1)
        return n, best[ar, n]
    p = top_p_probs(F.log_softmax(logits / temperature, -1).exp(), top_p)
    p = p / p.sum(-1, keepdim=True)  # (B, k + 1, V)
    px, qx = (d[:, :k].gather(-1, drafts[..., None])[..., 0] for d in (p, q))  # (B, k)
    if isinstance(gen_accept, torch.Generator):
        u = torch.rand(B, k, generator=gen_accept, device=logits.device)
    else:
        u = gen_accept.uniform(k)
    n = (u * qx < px).long().cumprod(-1).sum(-1)  # accepted while u < p(x) / q(x)
    # row b draws at position n[b] from the residual; past the last draft q is 0: p itself
    qn = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], 1)[ar, n]  # (B, V)
    res = (p[ar, n] - qn).clamp_(min=0)
    res = torch.where(res.sum(-1, keepdim=True) > 0, res, p[ar, n])  # p == q but for rounding
    return n, _race(res, gen, at=n)


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
    """The call's start (Engine.start: the dense prefill's first token), then rounds over the
    live rows: drafts (`_draft`: k steps of the engine's decode step on the draft model, sparse
    if `sparse=`; or text the group already has, drafts.py), one dense verify forward of k + 1
    tokens a row (`_verify`), speculative_sample, and the rows' bookkeeping (Engine.take). Every
    token is an exact sample of the dense policy; its log-prob and top-k are the dense ones."""
    call = eng.start(prompt_ids, group_size, seed)
    cache, ps, L = call.cache, eng.page_size, eng.model.config.num_hidden_layers
    cache.routes = record_routes(None, 0)  # MoE routes: not recorded in this mode
    st = dict(draft_s=0.0, verify_s=0.0, drafted=0, accepted=0, verifies=0, verify_calls=0,
              draft_steps=0, full_rounds=0, pages_dense=0, draft_pages=0, verify_pages=0)
    group = (GroupDrafter(prompt_ids, group_size, eng.history)  # the group's text (drafts.py)
             if eng.spec_draft != "sparse" else None)
    for r, o in enumerate(call.out if group is not None else ()):
        group.extend(r, o)
    stats = {name: DraftStats(name) for name in ("suffix", "sparse")}  # this call's, logged
    # pages cached at the step that made each token (the prompt's for the first): every
    # token is the dense policy's, so ro.budget and ro.budget_dense are both this
    pages = [[-(-len(prompt_ids[r // group_size]) // ps)] for r in range(len(call.out))]
    while call.live:
        t2 = time.perf_counter()
        ids, q, draws, n0, used = _draft(eng, call, group, stats, st)  # (B, k + 1): last, drafts
        live, k = call.live, ids.shape[1] - 1  # in the round's slot order
        if ids.is_cuda:  # draft_s counts the draft's kernels, not just their launches
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        logits = _verify(eng, cache, live, n0, ids, st)  # (B, k + 1, V)
        drafts = ids[:, 1:]
        n, nxt = speculative_sample(logits, drafts, q, eng.temperature, eng.top_p, draws, draws)
        ar = torch.arange(len(live), device=ids.device)
        toks = torch.cat([drafts, nxt[:, None]], 1)
        toks[ar, n] = nxt  # (B, k + 1): the accepted drafts, next, then what is dropped
        t = eng.temperature if eng.temperature > 0 else 1.0  # as `sample` reports it
        lp = F.log_softmax(logits / t, -1).gather(-1, toks[..., None])[..., 0]
        n_l, toks_l, lp_l = n.tolist(), toks.tolist(), lp.tolist()  # CPU-GPU sync point
        st["draft_s"], st["verify_s"] = (st["draft_s"] + t3 - t2,
                                         st["verify_s"] + time.perf_counter() - t3)
        if "verify" in eng.warm:  # the engine's first verify warms up (lazy builds): not timed
            eng.verify_time = [eng.verify_time[0] + time.perf_counter() - t3,
                               eng.verify_time[1] + 1]
        eng.warm.add("verify")
        _observe(eng, stats, st, used, n_l)
        taken, done = eng.take(call, live, [x[:a + 1] for x, a in zip(toks_l, n_l)], lp_l)
        _record_topk(eng, call, logits, live, taken)
        for j, (r, c) in enumerate(zip(live, taken)):
            pages[r] += [(n0[j] + i) // ps + 1 for i in range(c)]
            st["pages_dense"] += L * sum(pages[r][-c:])
            if group is not None:  # its siblings can draft from these now
                group.extend(r, call.out[r][len(call.out[r]) - c:])
            if j not in done:  # the accepted drafts' positions stay; the rest is cut
                cache.truncate(r, n0[j] + c)
            else:
                cache.release(r)
        call.live = [r for j, r in enumerate(live) if j not in done]
    if group is not None:
        group.finish(call.out)  # the prompt's earlier rollouts, for later calls
    return _finish(eng, call, pages, st, stats)


def _draft(eng, call, group, stats, st):
    """One round's drafts for the live rows. spec_draft "sparse": k draft steps (Engine.decode,
    draft=True). "suffix" and "mix": each row's proposal from the group's text (GroupDrafter),
    then drafts.choose picks the round's k, whether the sparse draft steps run (mix only) and,
    per row, which drafter's tokens the verify gets, by expected tokens a second (the engine's
    running figures); drafts.merge pads a short proposal (one-hot q: exact). -> ids (B, k + 1),
    each row's last token then its drafts; q (B, k, V) or None (temperature 0); the Draws at the
    first drafts' positions; n0, each row's cached tokens before the round; used, per row the
    drafter and its real drafts ("sparse" | "suffix", n). call.live takes the round's order."""
    K, cache, dev = eng.speculative, call.cache, eng.model.lm_head.weight.device
    if group is None:
        t0 = time.perf_counter()
        ids, q, draws = eng.decode(call, K, draft=True)
        stats["sparse"].seconds += time.perf_counter() - t0
        st["draft_steps"] += K
        n0 = [cache.lens[r] - K for r in call.live]
        st["draft_pages"] += sum((n + i) // eng.page_size + 1 for n in n0 for i in range(K))
        return ids, q, draws, n0, [("sparse", K)] * len(call.live)
    t0 = time.perf_counter()
    props = dict(zip(call.live, group.propose(call.live, K)))
    for s in (stats["suffix"], eng.draft_stats["suffix"]):  # the lookups' cost
        s.seconds, s.steps = s.seconds + time.perf_counter() - t0, s.steps + 1
    verify_s = eng.verify_time[0] / eng.verify_time[1] if eng.verify_time[1] else None
    sparse = eng.draft_stats["sparse"] if eng.spec_draft == "mix" else None
    if verify_s is None:  # nothing timed yet: a verify as two sparse draft steps
        verify_s = 2 * max(sparse.step_s() if sparse else 0.0, 1e-3)
    c = choose([len(props[r]) for r in call.live], eng.draft_stats["suffix"], sparse, verify_s, K)
    if sparse is not None and not c.sparse and eng.since_sparse >= EXPLORE:  # refresh figures
        c = Choice(best_k(sparse.accept(), sparse.step_s(), verify_s, K), True,
                   [False] * len(call.live), 0.0)
    eng.since_sparse = 0 if c.sparse else eng.since_sparse + 1
    use = dict(zip(call.live, c.suffix))
    drafts = q = None
    if c.sparse:
        t1 = time.perf_counter()
        ids, q, draws = eng.decode(call, c.k, draft=True)
        drafts, n0 = ids[:, 1:], [cache.lens[r] - c.k for r in call.live]
        st["draft_steps"] += c.k
        st["draft_pages"] += sum((n + i) // eng.page_size + 1 for n in n0 for i in range(c.k))
        for s in (stats["sparse"], eng.draft_stats["sparse"]):  # its first round: warm-up
            if s is stats["sparse"] or "sparse" in eng.warm:
                s.seconds, s.steps = s.seconds + time.perf_counter() - t1, s.steps + c.k
        eng.warm.add("sparse")
        last = ids[:, :1]
    else:  # no forward: the rows' last tokens, rows and positions to the device in one copy
        n0 = [cache.lens[r] for r in call.live]
        last, rows, pos = torch.tensor([[call.out[r][-1] for r in call.live], call.live,
                                        [len(call.out[r]) for r in call.live]],
                                       device="cpu").to(dev).unbind(0)
        draws, last = call.noise.at(rows, pos), last[:, None]
    live, V = call.live, eng.model.config.vocab_size
    drafts, q = merge([props[r] for r in live], [use[r] for r in live], V, c.k, drafts, q,
                      want_q=eng.temperature > 0, device=dev)
    used = [("sparse", c.k) if c.sparse and not use[r] else ("suffix", min(len(props[r]), c.k))
            for r in live]  # a row with no match in a round with no sparse draft: pads only
    return torch.cat([last, drafts], 1), q, draws, n0, used


def _observe(eng, stats, st, used, n):
    """A verify's outcome: each row's accepted drafts n[j] against its real ones (pads are not
    drafts) into the round's totals and each drafter's figures, the call's and the engine's."""
    real = [m for _, m in used]
    st["drafted"] += sum(real)
    st["accepted"] += sum(min(a, m) for a, m in zip(n, real))
    st["full_rounds"] += sum(a >= m for a, m in zip(n, real))  # no real draft rejected
    for name in ("suffix", "sparse"):
        rows = [j for j, (u, _) in enumerate(used) if u == name]
        for s in (stats[name], eng.draft_stats[name]):
            s.observe([n[j] for j in rows], [real[j] for j in rows])


def _verify(eng, cache, live, n0, ids, st):
    """One dense forward of each live row's last token and its k drafts, ids (B, k + 1), over its
    paged cache (PagedKVCache.begin_verify): the rows are cut back to where the draft began, n0,
    and the verify's K and V overwrite the draft's. -> logits (B, k + 1, V) fp32, the dense
    policy's next-token logits after each of them."""
    for r, n in zip(live, n0):
        cache.truncate(r, n)
    cache.begin_verify(live, ids.shape[1])
    st["verify_pages"] += sum(cache.n_pages)  # every layer reads them once
    st["verifies"], st["verify_calls"] = st["verifies"] + len(live), st["verify_calls"] + 1
    return model_forward(eng.run.mode, eng.model, ids, cache)  # fused on a CPU where it runs


def _record_topk(eng, call, logits, rows, taken):
    """The top-k of the dense distributions (B, k + 1, V) at the positions rows[j] took (taken[j]
    of them, the last ones of its tokens), into the call's buffers."""
    if not eng.topk:
        return
    vals, ids = topk_logprobs(logits, eng.temperature, eng.topk)  # (B, k + 1, topk)
    j = [j for j, c in enumerate(taken) for _ in range(c)]
    i = [i for c in taken for i in range(c)]
    pos = [len(call.out[rows[a]]) - taken[a] + b for a, b in zip(j, i)]
    r, pos, j, i = torch.tensor([[rows[a] for a in j], pos, j, i],  # one copy to the device
                                device="cpu").view(4, -1).to(logits.device).unbind(0)
    call.topv[r, pos], call.topi[r, pos] = vals[j, i], ids[j, i]


def _finish(eng, call, pages, st, stats):
    """Rollouts of a speculative call (Engine.finish): ro.budget = ro.budget_dense (the dense
    policy's pages at every token), the timings of dense decoding plus the draft's and the
    verify's."""
    cache, N, L = call.cache, len(call.out), eng.model.config.num_hidden_layers
    T = max(1, max(map(len, call.out)))
    pages_t = torch.zeros(N, T, device="cpu")  # host, as every Rollouts field
    for r, p in enumerate(pages):
        pages_t[r, :len(p)] = torch.tensor(p[:T], dtype=torch.float32, device="cpu")
    # per layer, both passes: the draft's selections (counted in the cache, averaged over KV
    # heads) or every page in its dense layers, and every page once a verify
    dense_l = L if eng.budget is None else min(L, eng.dense_layers)
    counted = (cache.read_layer.double() / cache.H).tolist()  # CPU-GPU sync point, once
    read_layer = [st["verify_pages"] + (st["draft_pages"] if l < dense_l else counted[l])
                  for l in range(L)]
    drafted, fails = st["drafted"], st["verifies"] - st["full_rounds"]
    new = sum(map(len, call.out))
    timings = {"pages_read": int(sum(read_layer)), "pages_dense": st["pages_dense"],
               "pages_read_layer": read_layer,
               **{key: st[key] for key in ("draft_s", "verify_s", "drafted", "accepted",
                                            "verifies", "verify_calls")},
               "acceptance": st["accepted"] / drafted if drafted else 1.0,
               # the first token of a row comes from prefill, not from a verify
               "tokens_per_verify": (new - N) / max(1, st["verifies"]),
               # per-draft acceptance (geometric: each rejection ends a round)
               "k": eng.speculative, "rejections": fails,
               "accept_geom": st["accepted"] / max(1, st["accepted"] + fails),
               **stats["suffix"].log(), **stats["sparse"].log()}  # acceptance per drafter
    if eng.adapt_k and st["draft_steps"] and st["verify_calls"]:  # the next call's k
        eng.speculative = best_k(timings["accept_geom"], st["draft_s"] / st["draft_steps"],
                                 st["verify_s"] / st["verify_calls"], eng.adapt_k)
    ro = eng.finish(call, timings, pages=pages_t)
    if eng.record_pages:  # a token no draft made (a bonus token) replays dense: every page
        none = ~ro.read_pages.any(-1, keepdim=True)
        ro.read_pages |= none & ro.mask[:, :, None, None, None]
    return ro
