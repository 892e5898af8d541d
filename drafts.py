"""
drafts.py: stage 2, drafts from text the group already has. Lossless speculative rollout needs a
draft of k tokens a row before each verify; speculative.py's draft is the sparse-KV policy, which
costs k decode steps. This file is the second source, which costs no forward: a suffix index over
the group's sibling rows (growing as they decode), the prompt itself and the prompt's earlier
rollouts (kept across calls). Rows of one prompt share much of their text on exact-chain tasks,
so the longest suffix of a row's context that also occurs in that text often continues the same
way. Three systems for RL rollout do this: DAS (a suffix tree over recent rollouts), Seer (drafts
from the sibling responses of the same prompt) and SPEC-RL (the previous epoch's rollout of the
prompt); prompt-lookup decoding does it with the prompt alone.

    from drafts import GroupDrafter, RolloutHistory, DraftStats, choose, merge
    history = RolloutHistory(max_rollouts=8, max_tokens=1 << 20)   # lives across calls
    drafter = GroupDrafter(prompt_ids, group_size, history)        # one per generate call
    drafter.extend(row, new_tokens)                                # as rows take tokens
    proposals = drafter.propose(live_rows, k_max)                  # lists of 0..k_max tokens
    c = choose([len(p) for p in proposals], suffix_stats, sparse_stats, verify_s, k_max)
    drafts, q = merge(proposals, c.suffix, vocab, c.k, sparse_drafts, sparse_q)
    drafter.finish(completions)                                    # into the history

    replay_acceptance(rows, k)       # offline: what acceptance a group's finished rows would get
    python -m pytest tests/test_drafts.py

How it works:
    1. The index (SuffixIndex) is a hashed n-gram table, not a suffix tree: every n-gram of
       length min_match..max_match (2..8) in the indexed text maps to the positions that follow
       it. A token appended to a sequence adds max_match - min_match + 1 entries (O(1) a token),
       and a lookup hashes the context's last n tokens for n = max_match down to min_match and
       stops at the first n with a continuation: the longest match, in O(max_match^2) work, then
       O(max_hits * k) to walk its occurrences. A suffix tree or automaton finds matches of any
       length in O(match length); capping the match at max_match loses little, since a draft
       rarely needs more context than that to be right, and a dict of tuples reads in a few
       lines. In Python a lookup costs tens of microseconds a row: small beside a draft step.
    2. The draft: among the most recent max_hits (16) occurrences of the longest match, the
       token that follows most of them, then among those that agree, the token after it that
       most of them continue with, and so on for up to k tokens: the single path that a suffix
       tree's counts favour (SuffixDecoding grows a tree of such paths and verifies the tree).
       Ties go to the most recent occurrence. Frequency, since text that several siblings wrote
       is the policy's likely text; recency for ties and for the window, since the earlier
       rollouts come from an older policy.
    3. What is indexed: the prompt (prompt lookup), each row's text so far and the prompt's last
       R earlier rollouts. A row and an earlier rollout start with the prompt's last max_match
       tokens as context, so their first tokens are found after the prompt's end; n-grams that
       lie inside that context are not indexed again (the prompt already holds them). A row's
       own earlier text counts (repetition inside a row is legitimate); its own last n-gram has
       no continuation yet, so a row never matches itself.
    4. Exactness: the drafter proposes d deterministically given everything sampled so far, so
       q is one-hot at d. Speculative rejection sampling then accepts d with probability
       min(1, p(d) / q(d)) = p(d), and on rejection draws from norm(max(0, p - q)): p with d
       removed, renormalised. So every token is an exact sample of p, as with any draft; a wrong
       draft costs acceptance, never exactness. `one_hot_q` builds that q for
       speculative.speculative_sample. A row with fewer proposals than the round's k is padded
       (one-hot at the pad token too: still exact; the verify computes k + 1 positions a row
       anyway); DraftStats counts only the real proposals.
    5. The chooser (`choose`): as speculative.best_k picks k from the acceptance and the costs,
       choose picks per round whether the sparse draft runs at all, and per row which drafter's
       tokens go to the verify, by expected tokens per second. A round without the sparse draft
       costs a verify and the lookups; with it, k draft steps more, and then every row takes the
       drafter with the larger expected yield (a row with no match takes the sparse draft).

Simplifications:
    1. Matches are capped at max_match tokens and shorter than min_match are ignored (a single
       shared token predicts little).
    2. One index per prompt per call, rebuilt from the history at the start of the call: the
       earlier rollouts are re-indexed each call (R rollouts of the prompt, a few dict inserts a
       token); a persistent per-prompt index would skip that, at the cost of deleting entries.
    3. One acceptance per drafter (geometric, as speculative.py's accept_geom), not per match
       length or per row; the drafts are a single path, not a tree of alternatives.
    4. The history is keyed by the prompt's tokens; it keeps the last max_rollouts completions
       of a prompt and drops the least recently used prompt's oldest completions beyond
       max_tokens in all.
    5. q is dense (B, k, V), as the sparse draft's is: one_hot_q costs B * k * V floats.
"""

from collections import OrderedDict, deque
from dataclasses import dataclass

import torch


# ----------------------------------------------------------------------------- the index


class SuffixIndex:
    """A hashed n-gram table over a few token sequences that grow at their ends. docs[d] is
    sequence d (its context first); table maps an n-gram (a tuple) to the (doc, position) pairs
    that follow its occurrences, oldest first."""

    def __init__(self, min_match=2, max_match=8, max_hits=16):
        assert 1 <= min_match <= max_match, (min_match, max_match)
        self.min_match, self.max_match, self.max_hits = min_match, max_match, max_hits
        self.docs, self.table = [], {}

    def add_doc(self, tokens=(), context=()):
        """A new sequence: context (e.g. the prompt's last tokens) then tokens -> its id. Only
        n-grams followed by tokens of its own are indexed: those that end at the context's end
        or later. The ones inside the context are the prompt's, which the prompt's doc holds."""
        d = len(self.docs)
        self.docs.append(list(context))
        self._index_end(d)  # the context's last n-grams: what follows them is this doc's own
        self.extend(d, tokens)
        return d

    def extend(self, d, tokens):
        """Append tokens to sequence d: each adds the n-grams that end at it (O(1) a token)."""
        for t in tokens:
            self.docs[d].append(t)
            self._index_end(d)

    def _index_end(self, d):
        """Index the n-grams that end at sequence d's end, at the position that follows them
        (empty until the next token comes)."""
        doc = self.docs[d]
        end = len(doc)
        for n in range(self.min_match, min(self.max_match, end) + 1):
            self.table.setdefault(tuple(doc[end - n:]), []).append((d, end))

    def hits(self, context):
        """The longest suffix of context (min_match..max_match tokens) that occurs with a
        continuation -> (its length, the latest max_hits (doc, position) pairs that follow it),
        or (0, []). A sequence's own last n-gram has nothing after it yet: skipped."""
        for n in range(min(self.max_match, len(context)), self.min_match - 1, -1):
            found = self.table.get(tuple(context[-n:]))
            if not found:
                continue
            live = []
            for d, pos in reversed(found):  # newest first; at most one dead entry a sequence
                if pos < len(self.docs[d]):
                    live.append((d, pos))
                    if len(live) == self.max_hits:
                        break
            if live:
                return n, live[::-1]
        return 0, []

    def draft(self, context, k):
        """Up to k tokens that followed the longest match of context's suffix: at each step the
        token most of the remaining occurrences continue with (ties: the latest), then only the
        occurrences that agree go on. -> (tokens, match length)."""
        n, cands = self.hits(context)
        out = []
        for i in range(k):
            if len(cands) == 1:  # one occurrence left: the rest of its text is the draft
                d, pos = cands[0]
                out += self.docs[d][pos + i:pos + k]
                break
            best = {}  # token -> (count, order of its latest occurrence)
            for j, (d, pos) in enumerate(cands):
                if pos + i < len(self.docs[d]):
                    t = self.docs[d][pos + i]
                    best[t] = (best.get(t, (0, 0))[0] + 1, j)
            if not best:
                break  # every occurrence ran out of text
            tok = max(best, key=best.get)
            out.append(tok)
            cands = [(d, pos) for d, pos in cands
                     if pos + i < len(self.docs[d]) and self.docs[d][pos + i] == tok]
        return out, n


# ----------------------------------------------------------------------------- across calls


class RolloutHistory:
    """The earlier completions of each prompt, kept across calls: the last max_rollouts of a
    prompt, at most max_tokens in all (the least recently used prompt loses its oldest first)."""

    def __init__(self, max_rollouts=8, max_tokens=1 << 20):
        self.max_rollouts, self.max_tokens = max_rollouts, max_tokens
        self.by_prompt, self.tokens = OrderedDict(), 0  # key -> deque of completions

    def get(self, prompt):
        key = tuple(prompt)
        if key in self.by_prompt:
            self.by_prompt.move_to_end(key)  # recently used: evicted last
        return list(self.by_prompt.get(key, ()))

    def add(self, prompt, completion):
        key = tuple(prompt)
        kept = self.by_prompt.setdefault(key, deque())
        self.by_prompt.move_to_end(key)
        kept.append(tuple(completion))
        self.tokens += len(completion)
        if len(kept) > self.max_rollouts:
            self.tokens -= len(kept.popleft())
        while self.tokens > self.max_tokens and self.by_prompt:
            old_key, old = next(iter(self.by_prompt.items()))
            self.tokens -= len(old.popleft())
            if not old:
                del self.by_prompt[old_key]


# ----------------------------------------------------------------------------- one call


class GroupDrafter:
    """The suffix drafts of one generate call: one SuffixIndex per prompt, holding the prompt,
    its earlier rollouts (from history) and its G rows (row r belongs to prompt r // G)."""

    def __init__(self, prompts, group_size, history=None, min_match=2, max_match=8,
                 max_hits=16):
        self.prompts, self.G, self.history = [list(p) for p in prompts], group_size, history
        self.index, self.doc = [], []
        for p in self.prompts:
            idx = SuffixIndex(min_match, max_match, max_hits)
            tail = p[-max_match:]  # a row's first tokens are found after the prompt's end
            idx.add_doc(p)
            for old in (history.get(p) if history is not None else ()):
                idx.add_doc(old, context=tail)
            self.index.append(idx)
            self.doc += [idx.add_doc((), context=tail) for _ in range(group_size)]

    def extend(self, row, tokens):
        """Row `row` took these tokens (host ints): its siblings can draft from them now."""
        self.index[row // self.G].extend(self.doc[row], tokens)

    def propose(self, rows, k):
        """-> for each row, up to k draft tokens (a list of ints; [] where nothing matched)."""
        out = []
        for r in rows:
            idx = self.index[r // self.G]
            out.append(idx.draft(idx.docs[self.doc[r]], k)[0])
        return out

    def finish(self, completions):
        """The call's completions (one token list a row) join the history for later calls."""
        if self.history is not None:
            for r, c in enumerate(completions):
                self.history.add(self.prompts[r // self.G], c)


# ----------------------------------------------------------------------------- q


def one_hot_q(drafts, vocab, dtype=torch.float32):
    """drafts (B, k) token ids -> q (B, k, V): the drafter's distribution, all mass on the
    draft. With it speculative.speculative_sample accepts d with probability p(d) and, on a
    rejection, draws from p with d removed: exact samples of p."""
    q = torch.zeros(*drafts.shape, vocab, dtype=dtype, device=drafts.device)
    return q.scatter_(-1, drafts[..., None], 1.0)


def pad_drafts(proposals, k, device="cpu", pad=0):
    """Lists of 0..k tokens -> drafts (B, k) long, each list cut to k and padded with `pad`,
    and the real lengths. A pad is a draft like any other (one-hot q: still exact)."""
    lens = [min(len(p), k) for p in proposals]
    rows = [list(p[:k]) + [pad] * (k - n) for p, n in zip(proposals, lens)]
    return torch.tensor(rows, dtype=torch.long, device=device).view(len(rows), k), lens


def merge(proposals, use_suffix, vocab, k, drafts=None, q=None, want_q=True, device="cpu"):
    """One round's drafts for speculative_sample: rows with use_suffix[j] take their suffix
    proposals (padded, one-hot q), the others keep the sparse draft's tokens and q (drafts
    (B, k), q (B, k, V) from speculative._draft); drafts=None: no sparse draft ran, every row
    takes its proposal, on `device` (the run's). want_q=False (temperature 0, where q is not
    read) -> q None. -> drafts (B, k), q (B, k, V) or None."""
    dev = drafts.device if drafts is not None else device
    sd, _ = pad_drafts(proposals, k, device=dev)  # host lists -> device: a small copy a round
    if drafts is None:
        return sd, (one_hot_q(sd, vocab) if want_q else None)
    use = torch.tensor(use_suffix, dtype=torch.bool, device=dev)
    out = torch.where(use[:, None], sd, drafts)
    if not want_q:
        return out, None
    return out, torch.where(use[:, None, None], one_hot_q(sd, vocab, q.dtype), q)


# ----------------------------------------------------------------------------- the chooser


@dataclass
class DraftStats:
    """One drafter's running figures, for the chooser and the step's log line."""
    name: str
    drafted: int = 0       # real draft tokens sent to a verify (pads not counted)
    accepted: int = 0      # of those, accepted
    rejections: int = 0    # row-rounds that rejected one of their real drafts
    rows: int = 0          # row-rounds drafted
    seconds: float = 0.0   # drafting time: draft steps (sparse) or lookups (suffix)
    steps: int = 0         # drafting calls: a draft step of all rows, or a round's lookups
    prior: tuple = (0.5, 2.0)  # the acceptance and its weight before any figures

    def observe(self, accepted, lengths):
        """A verify's outcome for the rows this drafter drafted: accepted[j] drafts accepted
        (speculative_sample's n), lengths[j] real drafts (the rest were pads)."""
        for n, length in zip(accepted, lengths):
            if length:
                self.drafted, self.rows = self.drafted + length, self.rows + 1
                self.accepted += min(n, length)
                self.rejections += n < length

    def accept(self):
        """The chance a draft is accepted given the ones before it were (geometric, as
        speculative.py's accept_geom), pulled toward the prior while figures are few."""
        a0, w = self.prior
        return (self.accepted + a0 * w) / (self.accepted + self.rejections + w)

    def step_s(self):
        return self.seconds / self.steps if self.steps else 0.0

    def log(self):
        """Figures for the step's metrics record, keyed by the drafter's name."""
        return {f"{self.name}_drafted": self.drafted, f"{self.name}_accepted": self.accepted,
                f"{self.name}_rejections": self.rejections,
                f"{self.name}_acceptance": self.accepted / max(1, self.drafted),
                f"{self.name}_accept_geom": self.accepted / max(1, self.accepted
                                                                + self.rejections),
                f"{self.name}_s": self.seconds}


def expected_tokens(a, n):
    """Tokens a row takes from a round of n drafts, each accepted with probability a given the
    ones before it were: 1 + a + ... + a^n (the verify always yields one)."""
    a = min(max(a, 0.0), 1 - 1e-9)
    return (1 - a ** (n + 1)) / (1 - a)


@dataclass
class Choice:
    k: int          # the round's draft length (every row's drafts are padded to it)
    sparse: bool    # whether the sparse draft steps run this round
    suffix: list    # per row: True takes its suffix proposal, False the sparse draft
    rate: float     # the expected tokens a second that won


def choose(lengths, suffix, sparse, verify_s, k_max):
    """Per round: which drafts the verify gets, by expected tokens a second (speculative.best_k's
    model, over both drafters). lengths: each live row's suffix proposal length (0: no match);
    suffix, sparse: DraftStats (sparse None: no sparse draft available); verify_s: seconds a
    verify (taken as fixed in k, as best_k does). Two kinds of round, each k in 1..k_max:
      without the sparse draft: a verify and the lookups; a row yields
          expected_tokens(a_suffix, min(length, k)) (1 with no match);
      with it: k draft steps more, and each row takes the drafter with the larger yield.
    -> Choice."""
    a_s, best = suffix.accept(), None
    for k in range(1, k_max + 1):
        e_s = [expected_tokens(a_s, min(n, k)) if n else 0.0 for n in lengths]
        t = verify_s + suffix.step_s()
        # no sparse draft: a row with no match still takes the verify's token
        cands = [(sum(max(e, 1.0) for e in e_s) / max(t, 1e-12), False,
                  [n > 0 for n in lengths])]
        if sparse is not None:
            e_p = expected_tokens(sparse.accept(), k)
            t_p = t + k * sparse.step_s()
            cands.append((sum(max(e, e_p) for e in e_s) / max(t_p, 1e-12), True,
                          [e > e_p for e in e_s]))
        for rate, use_sparse, rows in cands:
            if best is None or rate > best.rate:
                best = Choice(k, use_sparse, rows, rate)
    return best


# ----------------------------------------------------------------------------- offline replay


def replay_acceptance(rows, k, prompt=(), history=(), min_match=2, max_match=8, max_hits=16):
    """What the suffix drafter would have got on a group's finished rows (lists of ints):
    rounds go over the rows in turn, as the engine's do; each live row drafts k tokens from
    the prompt, the earlier rollouts (history), its siblings' text so far and its own, and
    takes the drafts that equal its actual next tokens plus one (the verify's token). That is
    greedy-match acceptance: exact at temperature 0, an upper bound at temperature > 0, where a
    draft equal to the sampled token is accepted only with probability p(d).
    -> dict: drafted, accepted, rounds (row-verifies), matched (rounds with a proposal),
    tokens, acceptance = accepted / drafted, tokens_per_verify = tokens / rounds."""
    hist = RolloutHistory(max_rollouts=max(1, len(history)), max_tokens=float("inf"))
    for old in history:
        hist.add(prompt, old)
    group = GroupDrafter([prompt], len(rows), hist, min_match, max_match, max_hits)
    at = [0] * len(rows)  # tokens each row has taken
    st = dict(drafted=0, accepted=0, rounds=0, matched=0, tokens=0)
    while any(a < len(r) for a, r in zip(at, rows)):
        for j, row in enumerate(rows):
            if at[j] >= len(row):
                continue
            draft = group.propose([j], k)[0]
            truth = row[at[j]:at[j] + len(draft)]
            n = next((i for i, (d, t) in enumerate(zip(draft, truth)) if d != t), len(truth))
            take = row[at[j]:at[j] + n + 1]
            group.extend(j, take)
            at[j] += len(take)
            st["drafted"], st["accepted"] = st["drafted"] + len(draft), st["accepted"] + n
            st["rounds"], st["matched"] = st["rounds"] + 1, st["matched"] + bool(draft)
            st["tokens"] += len(take)
    st["acceptance"] = st["accepted"] / max(1, st["drafted"])
    st["tokens_per_verify"] = st["tokens"] / max(1, st["rounds"])
    return st
