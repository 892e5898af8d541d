"""Drafts from text the group already has (drafts.py): the suffix index finds the longest match and
drafts its most frequent continuation; the history keeps its bounds; a one-hot q keeps speculative
rejection sampling exact (chi-square against a toy Markov chain as the dense model, suffix drafts
alone and mixed with a perturbed sparse draft); the chooser's decisions on hand-made figures; and
the offline replay's counts on hand-made rows."""
import pytest
import torch

from drafts import (DraftStats, GroupDrafter, RolloutHistory, SuffixIndex, choose,
                    expected_tokens, merge, one_hot_q, pad_drafts, replay_acceptance)
from speculative import best_k, speculative_sample, top_p_probs

# ----------------------------------------------------------------------------- the index


def test_longest_match_wins_and_its_most_frequent_continuation_is_drafted():
    idx = SuffixIndex(min_match=2, max_match=4)
    idx.add_doc([5, 1, 2, 7, 7])        # "1 2" -> 7
    idx.add_doc([1, 2, 8, 8])           # "1 2" -> 8
    idx.add_doc([9, 1, 2, 8, 6])        # "1 2" -> 8, "9 1 2" -> 8 6
    idx.add_doc([3, 1, 2, 7, 4])        # "3 1 2" -> 7 4: the longest match for [.., 3, 1, 2]
    assert idx.draft([0, 3, 1, 2], 3) == ([7, 4], 3)  # longest match, then its text runs out
    # "1 2": 7 twice and 8 twice -> the latest occurrence's 7
    assert idx.draft([0, 1, 2], 1) == ([7], 2)
    idx.add_doc([1, 2, 8])              # 8 now three times: frequency beats recency
    # then among the occurrences that drafted 8: 8 once, 6 once (the latest), one at its end
    assert idx.draft([0, 1, 2], 3) == ([8, 6], 2)
    assert idx.draft([4, 4], 3) == ([], 0)          # no match
    assert idx.draft([6, 1], 3) == ([], 0)          # "6 1" never occurs; 1 token is too short


def test_a_row_drafts_from_its_own_earlier_text_but_never_matches_itself():
    idx = SuffixIndex(min_match=2, max_match=8)
    d = idx.add_doc([1, 2, 3, 4, 1, 2])
    assert idx.draft(idx.docs[d], 5) == ([3, 4, 1, 2], 2)  # repetition inside a row; the
    # continuation stops at the row's end: there is no future to draft from
    e = idx.add_doc([6, 7, 8])
    assert idx.draft(idx.docs[e], 3) == ([], 0)  # its last n-grams are only its own


def test_context_ngrams_are_indexed_once_and_a_token_costs_a_fixed_number_of_entries():
    idx = SuffixIndex(min_match=2, max_match=4)
    prompt = [1, 2, 3, 4, 5]
    idx.add_doc(prompt)
    before = sum(map(len, idx.table.values()))
    r = idx.add_doc((), context=prompt[-4:])
    # only the n-grams that end at the context's end (what follows them is the row's)
    assert sum(map(len, idx.table.values())) - before == 3
    before = sum(map(len, idx.table.values()))
    idx.extend(r, [9, 9, 9])
    assert sum(map(len, idx.table.values())) - before == 3 * 3  # max - min + 1 a token
    s = idx.add_doc((), context=prompt[-4:])  # a sibling at the start drafts the row's text
    assert idx.draft(idx.docs[s], 4) == ([9, 9, 9], 4)


def test_history_keeps_the_last_rollouts_of_a_prompt_and_a_token_cap():
    h = RolloutHistory(max_rollouts=2, max_tokens=10)
    for c in ([1], [2, 2], [3, 3, 3]):
        h.add([7], c)
    assert h.get([7]) == [(2, 2), (3, 3, 3)] and h.tokens == 5
    h.add([8], [4] * 4)
    h.get([7])  # prompt 7 used last: prompt 8 is evicted first
    h.add([9], [5] * 3)  # 12 tokens: prompt 8's oldest completion goes
    assert h.get([8]) == [] and h.get([7]) == [(2, 2), (3, 3, 3)] and h.tokens == 8


def test_group_drafter_sees_siblings_and_history_but_not_other_prompts():
    hist = RolloutHistory()
    g = GroupDrafter([[1, 2, 3], [4, 5, 6]], group_size=2, history=hist)
    g.extend(0, [7, 8, 9])
    assert g.propose([1, 2, 3], 3) == [[7, 8, 9], [], []]  # row 1 is row 0's sibling only
    g.extend(2, [10, 11])
    g.finish([[7, 8, 9], [7, 8], [10, 11], [10]])
    nxt = GroupDrafter([[4, 5, 6]], group_size=1, history=hist)  # a later call
    assert nxt.propose([0], 4) == [[10, 11]]  # prompt [4, 5, 6]'s earlier rollouts: 10 11 most


# ----------------------------------------------------------------------------- q and merge


def test_one_hot_q_and_merge_keep_the_sparse_rows_and_pad_the_suffix_rows():
    d = torch.tensor([[2, 0], [1, 3]])
    q = one_hot_q(d, 4)
    assert q.shape == (2, 2, 4) and torch.equal(q.argmax(-1), d) and torch.equal(q.sum(-1),
                                                                               torch.ones(2, 2))
    sd, lens = pad_drafts([[3, 3, 3], []], 2)
    assert sd.tolist() == [[3, 3], [0, 0]] and lens == [2, 0]
    sparse_q = torch.full((2, 2, 4), 0.25)
    drafts, mq = merge([[3], [2, 2]], [True, False], 4, 2, torch.tensor([[1, 1], [1, 1]]),
                       sparse_q)
    assert drafts.tolist() == [[3, 0], [1, 1]]
    assert torch.equal(mq[0], one_hot_q(torch.tensor([3, 0]), 4)) and torch.equal(mq[1],
                                                                                  sparse_q[1])
    d0, q0 = merge([[3]], [True], 4, 2, want_q=False)  # temperature 0: no q; no sparse draft
    assert d0.tolist() == [[3, 0]] and q0 is None


# ----------------------------------------------------------------------------- exactness

V, K, T_NEW, G = 5, 3, 6, 4
PROMPT = [0, 1, 2, 3]


def chain(seed, scale=2.5):
    """A toy dense model: a Markov chain over V tokens, log P (V, V), peaked so that rows share
    text and suffix drafts are often (not always) right."""
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(scale * torch.randn(V, V, generator=g, dtype=torch.float64), -1)


def p_value(counts, probs):
    """Pearson's chi-square of counts against probs (cells expected under 5 pooled) -> the
    p-value, from the regularised upper incomplete gamma function."""
    exp = probs * counts.sum()
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    stat, df = ((obs - exp)[keep] ** 2 / exp[keep]).sum(), int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2).item()


def sparse_draft(logq, last, k, gen):
    """The stand-in sparse self-draft: k tokens from a perturbed chain Q, with their q (B, k, V)."""
    toks, qs, cur = [], [], last
    for _ in range(k):
        q = logq[cur].exp()
        cur = torch.multinomial(q, 1, generator=gen)[:, 0]
        toks.append(cur)
        qs.append(q)
    return torch.stack(toks, 1), torch.stack(qs, 1)


def run_rounds(logp, groups, seed, mixed=False, sample=speculative_sample, temperature=1.0,
               top_p=1.0):
    """Speculative rounds over groups * G rows of the chain: drafts from the suffix index (and,
    mixed: odd rows and rows with no match from a perturbed sparse draft), one verify by
    `sample`. -> tokens (rows, T_NEW) and the drafters' stats."""
    hist = RolloutHistory()
    old = torch.Generator().manual_seed(seed + 1)  # the prompt's earlier rollouts: another chain
    for _ in range(3):
        row = sparse_draft(chain(seed + 2), torch.tensor([PROMPT[-1]]), T_NEW, old)[0]
        hist.add(PROMPT, row[0].tolist())
    B = groups * G
    drafter = GroupDrafter([PROMPT] * groups, G, hist)
    gen, gen_accept = (torch.Generator().manual_seed(seed + i) for i in (3, 4))
    logq = torch.log_softmax(logp + 0.8 * torch.randn(V, V, generator=gen, dtype=logp.dtype), -1)
    stats = {"suffix": DraftStats("suffix"), "sparse": DraftStats("sparse")}
    out, live = [[] for _ in range(B)], list(range(B))
    last = torch.full((B,), PROMPT[-1])
    while live:
        props = drafter.propose(live, K)
        use = [bool(p) and (not mixed or r % 2 == 0) for r, p in zip(live, props)]
        sd, sq = sparse_draft(logq, last[live], K, gen) if mixed else (None, None)
        drafts, q = merge(props, use, V, K, sd, sq, want_q=temperature > 0)
        logits = logp[torch.cat([last[live][:, None], drafts], 1)].float()  # (B, K + 1, V)
        n, nxt = sample(logits, drafts, q, temperature, top_p, gen, gen_accept)
        n_l = n.tolist()
        stats["suffix"].observe([a for a, u in zip(n_l, use) if u],
                                [min(len(p), K) for p, u in zip(props, use) if u])
        stats["sparse"].observe([a for a, u in zip(n_l, use) if not u and mixed],
                                [K for u in use if not u and mixed])
        for j, r in enumerate(live):
            took = (drafts[j, :n_l[j]].tolist() + [nxt[j].item()])[:T_NEW - len(out[r])]
            out[r] += took
            drafter.extend(r, took)
            last[r] = took[-1]
        live = [r for r in live if len(out[r]) < T_NEW]
    return torch.tensor(out), stats


def exactness_p(logp, toks, top_p=1.0):
    """The p-values of the rows' first three tokens (joint, V^3 cells) and of the transitions
    after them (per state) against the chain (top-p-truncated as `sample` draws) -> the
    smallest, times their number (one threshold for the family)."""
    P = top_p_probs(logp.exp(), top_p)
    P = P / P.sum(-1, keepdim=True)
    joint = P[PROMPT[-1]][:, None, None] * P[:, :, None] * P[None]  # (V, V, V)
    counts = torch.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3)
    ps = [p_value(counts, joint.flatten())]
    a, b = toks[:, 2:-1].flatten(), toks[:, 3:].flatten()
    for s in range(V):
        if (a == s).sum() > 20:
            ps.append(p_value(torch.bincount(b[a == s], minlength=V), P[s]))
    return min(1.0, min(ps) * len(ps))


@pytest.mark.parametrize("mixed,top_p", [(False, 1.0), (True, 1.0), (False, 0.8)],
                         ids=["suffix", "mixed", "suffix-top-p"])
def test_drafts_verified_with_one_hot_q_are_exact_samples_of_the_dense_chain(mixed, top_p):
    # broken by hand, each fails with a p-value under 1e-30: accepting every draft, a rejection
    # drawing from p instead of p with the draft removed, a uniform q for the suffix rows
    logp = chain(0)
    toks, stats = run_rounds(logp, groups=500, seed=10, mixed=mixed, top_p=top_p)
    assert exactness_p(logp, toks, top_p) > 1e-3
    # the drafts were used, and both right and wrong: the accept and the residual paths ran
    s = stats["suffix"]
    assert s.drafted > 2000 and 0.1 < s.accepted / s.drafted < 0.9, s
    if mixed:
        p = stats["sparse"]
        assert p.drafted > 2000 and 0.1 < p.accepted / p.drafted < 0.95, p


def test_greedy_rounds_take_the_chain_argmax_whatever_the_drafts():
    logp = chain(0)
    toks, stats = run_rounds(logp, groups=4, seed=1, temperature=0.0)
    want, cur = [], PROMPT[-1]
    for _ in range(T_NEW):
        cur = logp[cur].argmax().item()
        want.append(cur)
    assert toks.tolist() == [want] * (4 * G) and stats["suffix"].accepted > 0


# ----------------------------------------------------------------------------- the chooser


def stats(name, accepted, rejections, seconds=0.0, steps=0):
    return DraftStats(name, drafted=accepted + rejections, accepted=accepted,
                      rejections=rejections, rows=accepted + rejections, seconds=seconds,
                      steps=steps)


def test_chooser_skips_the_sparse_draft_when_every_row_has_a_good_suffix_match():
    suffix = stats("suffix", 900, 100, seconds=1e-4, steps=100)  # a = 0.9, lookups ~free
    sparse = stats("sparse", 700, 300, seconds=0.6, steps=100)   # a = 0.7, 6 ms a draft step
    c = choose([8] * 8, suffix, sparse, verify_s=0.01, k_max=8)
    assert (c.k, c.sparse, c.suffix) == (8, False, [True] * 8)
    c = choose([3] * 8, suffix, sparse, verify_s=0.01, k_max=8)  # proposals of 3: k beyond 3
    assert not c.sparse and c.suffix == [True] * 8 and c.k >= 3  # gains nothing, costs nothing


def test_chooser_with_no_match_is_best_k_on_the_sparse_draft():
    suffix = stats("suffix", 0, 0)
    sparse = stats("sparse", 700, 300, seconds=0.3, steps=100)
    c = choose([0] * 8, suffix, sparse, verify_s=0.01, k_max=8)
    assert c.sparse and c.suffix == [False] * 8
    assert c.k == best_k(0.7, 0.003, 0.01, 8)
    # a sparse draft too slow for its acceptance: plain verify rounds (one token a row) win
    slow = stats("sparse", 100, 900, seconds=1.0, steps=100)
    assert not choose([0] * 8, suffix, slow, verify_s=0.01, k_max=8).sparse


def test_chooser_mixes_per_row_when_some_rows_have_no_match():
    suffix = stats("suffix", 950, 50, seconds=1e-4, steps=100)   # a = 0.95
    sparse = stats("sparse", 800, 200, seconds=0.02, steps=100)  # a = 0.8, 0.2 ms a step
    lengths = [8, 8, 0, 0, 8, 0, 1, 0]
    c = choose(lengths, suffix, sparse, verify_s=0.01, k_max=8)
    assert c.sparse  # half the rows have nothing to draft: a cheap sparse draft pays for them
    assert c.suffix == [True, True, False, False, True, False, False, False]  # a 1-token match
    # yields less than a sparse draft of k; a bad suffix drafter loses every row
    bad = stats("suffix", 50, 950, seconds=1e-4, steps=100)
    c = choose(lengths, bad, sparse, verify_s=0.01, k_max=8)
    assert c.sparse and c.suffix == [False] * 8
    # no sparse drafter at all (sparse None): suffix rounds, rows without a match take one token
    c = choose(lengths, suffix, None, verify_s=0.01, k_max=8)
    assert not c.sparse and c.suffix == [n > 0 for n in lengths] and c.k == 8


def test_stats_count_only_real_drafts_and_the_prior_fades():
    s = DraftStats("suffix")
    assert s.accept() == 0.5
    s.observe([3, 0, 2, 5], [3, 0, 4, 2])  # row 2 rejected its 3rd; row 4 accepted pads too
    assert (s.drafted, s.accepted, s.rejections, s.rows) == (9, 7, 1, 3)
    assert s.accept() == pytest.approx((7 + 1) / (8 + 2))
    assert s.log()["suffix_acceptance"] == pytest.approx(7 / 9)
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == pytest.approx(5)


# ----------------------------------------------------------------------------- offline replay


def test_replay_of_a_row_that_repeats_an_earlier_rollout_accepts_every_draft():
    row = list(range(10, 20))
    st = replay_acceptance([row], 4, prompt=[1, 2, 3], history=[row])
    # rounds of k + 1 = 5 tokens: 4 drafts accepted and the verify's token, twice
    assert (st["rounds"], st["drafted"], st["accepted"], st["tokens"]) == (2, 8, 8, 10)
    assert st["tokens_per_verify"] == 5.0


def test_replay_counts_a_rows_own_repetition_and_nothing_for_unrelated_rows():
    # [1 2 3] * 4 alone: one token a round until "1 2" recurs (at 5 tokens), then 3-token drafts
    st = replay_acceptance([[1, 2, 3] * 4], 3)
    assert (st["rounds"], st["matched"], st["drafted"], st["accepted"]) == (7, 2, 6, 6)
    st = replay_acceptance([[1, 2, 3, 4], [5, 6, 7, 8]], 4)
    assert (st["drafted"], st["rounds"], st["tokens_per_verify"]) == (0, 8, 1.0)


def test_replay_of_siblings_that_part_counts_the_rejected_draft():
    # row 1 follows row 0 until its 5th token: drafts past that point are rejected
    rows = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9, 9]]
    st = replay_acceptance(rows, 3, prompt=[0, 0])
    assert st["accepted"] < st["drafted"] and st["tokens"] == 14
    assert 0 < st["acceptance"] < 1
