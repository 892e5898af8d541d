"""
rollout.py: stage 2, the generation engine. Batched KV-cache sampling of G completions per prompt.

    engine = Engine(model, tokenizer, max_new_tokens=256, temperature=1.0, top_p=1.0, stop=["\\n\\n"])
    ro = engine.generate(prompt_ids, group_size=8, seed=0)    # prompt_ids: list of token-id lists
    ro.tokens, ro.mask, ro.logp                               # (N, T) completions, sampled-token mask, log-probs

What one call does:
    1. Each prompt is repeated G times, the batch is left-padded, and one prefill fills the KV cache.
    2. Decoding samples one token per live row per step (temperature, top-p, a seeded generator) and records
       the log-prob of the sampled token under softmax(logits / temperature): the trainer recomputes that
       same quantity, so the two can be compared token by token (and importance-weighted).
    3. A row stops at EOS, at a stop string, or at max_new_tokens. Finished rows are dropped from the batch
       and from the cache at once, so they cost nothing afterwards.

Simplifications (this is the first version; a later issue adds paged, shared-prefix and sparse decoding):
    1. The cache is one contiguous (layers, B, H_kv, T, D) tensor; the prompt is prefilled G times.
    2. The log-prob ignores top-p truncation (as verl and friends do); with top_p = 1 it is exact.
    3. Stop strings are checked on the decoded tail of each row, so a stop string must decode the same
       whether or not it is tokenised on its own.

`generate_naive` beside the engine recomputes the whole sequence at every step with no cache. It is the
slow reference that the tests compare the engine against.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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

    def __len__(self):
        return self.tokens.shape[0]


class KVCache:
    """Contiguous KV cache for left-padded batches. `valid[b, t]` marks real (non-pad) key slots."""

    def __init__(self, cfg, B, T_max, dtype, device):
        shape = (cfg.num_hidden_layers, B, cfg.num_key_value_heads, T_max, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(B, T_max, dtype=torch.bool, device=device)
        self.lens = torch.zeros(B, dtype=torch.long, device=device)  # real tokens per row (= next position)
        self.t = 0  # slots filled (the same for every row: left padding keeps rows aligned)

    def extend(self, new_valid):
        """Declare the next T slots before a forward: new_valid (B, T) bool."""
        T = new_valid.shape[1]
        self.valid[:, self.t:self.t + T] = new_valid
        self._pos = self.lens[:, None] + new_valid.long().cumsum(1) - 1  # (B, T) position of each new token
        self._pos.clamp_(min=0)

    def positions(self, T):
        return self._pos

    def attend(self, layer, q, k, v):  # q (B, Hq, T, D); k, v (B, Hkv, T, D)
        T, t0 = q.shape[2], self.t
        self.k[layer, :, :, t0:t0 + T] = k
        self.v[layer, :, :, t0:t0 + T] = v
        keys, vals = self.k[layer, :, :, :t0 + T], self.v[layer, :, :, :t0 + T]
        causal = torch.ones(T, t0 + T, dtype=torch.bool, device=q.device).tril(t0)
        mask = (causal[None] & self.valid[:, None, :t0 + T])[:, None]  # (B, 1, T, t0+T)
        mask = mask | ~mask.any(-1, keepdim=True)  # a pad query with nothing to see: avoid NaN, it is ignored
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True)

    def advance(self, T):
        self.lens += self.valid[:, self.t:self.t + T].sum(1)
        self.t += T

    def keep(self, rows):
        """Drop finished rows: rows is a (B',) index tensor of the rows that live on."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        self.valid, self.lens = self.valid[rows], self.lens[rows]


def sample(logits, temperature, top_p, gen):
    """logits (B, V) fp32 -> token (B,), log-prob of it under softmax(logits / T) (B,)."""
    if temperature <= 0:  # greedy; the log-prob is reported at temperature 1
        tok = logits.argmax(-1)
        return tok, F.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    logp = F.log_softmax(logits / temperature, -1)
    probs = logp.exp()
    if top_p < 1.0:  # keep the smallest prefix of sorted tokens whose mass reaches top_p
        sp, si = probs.sort(-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= top_p
        probs = probs.scatter(-1, si, sp.masked_fill(drop, 0.0))
    tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


class Engine:
    def __init__(self, model, tokenizer, max_new_tokens=256, temperature=1.0, top_p=1.0, stop=(), eos_ids=None):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stop = [s for s in stop if s]
        eos = eos_ids if eos_ids is not None else tokenizer.eos_token_id
        self.eos = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(self.eos[0])
        self.max_len = model.config.max_position_embeddings

    def _check_lengths(self, prompt_ids):
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + self.max_new_tokens > self.max_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={self.max_new_tokens} it "
                                 f"exceeds the model's context of {self.max_len}")

    def _stopped(self, out, rows):
        """Rows (indices into out) whose decoded tail contains a stop string."""
        tail = max(len(s) for s in self.stop) + 8  # tokens, generously: a token is at least one character
        texts = self.tok.batch_decode([out[r][-tail:] for r in rows], skip_special_tokens=True)
        return [r for r, t in zip(rows, texts) if any(s in t for s in self.stop)]

    @torch.no_grad()
    def generate(self, prompt_ids, group_size=1, seed=0):
        self._check_lengths(prompt_ids)
        model, dev = self.model, self.model.lm_head.weight.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        rows = [p for p in prompt_ids for _ in range(group_size)]
        N, P = len(rows), max(len(p) for p in prompt_ids)
        ids = torch.full((N, P), self.pad_id, dtype=torch.long)
        valid = torch.zeros(N, P, dtype=torch.bool)
        for i, p in enumerate(rows):  # left padding: every row's last prompt token sits in column P - 1
            ids[i, P - len(p):] = torch.tensor(p)
            valid[i, P - len(p):] = True
        cache = KVCache(model.config, N, P + self.max_new_tokens, model.lm_head.weight.dtype, dev)
        t0 = time.perf_counter()
        cache.extend(valid.to(dev))
        logits = model(ids.to(dev), cache=cache)[:, -1]
        t1 = time.perf_counter()
        out = [[] for _ in range(N)]
        lps = [[] for _ in range(N)]
        finish = ["length"] * N
        live = torch.arange(N)  # original row id of each row still in the batch
        eos_set = set(self.eos.tolist())
        for step in range(self.max_new_tokens):
            tok, lp = sample(logits, self.temperature, self.top_p, gen)
            tok_l, lp_l = tok.tolist(), lp.tolist()  # CPU-GPU sync point, once per step
            done = []
            for j, r in enumerate(live.tolist()):
                if tok_l[j] in eos_set:
                    finish[r] = "eos"
                    done.append(j)
                    out[r].append(tok_l[j])  # EOS is sampled and trained on; it is not part of the text
                    lps[r].append(lp_l[j])
                    continue
                out[r].append(tok_l[j])
                lps[r].append(lp_l[j])
            if self.stop:
                cand = [j for j, r in enumerate(live.tolist()) if finish[r] == "length"]
                hit = set(self._stopped(out, [live[j].item() for j in cand]))
                for j in cand:
                    if live[j].item() in hit:
                        finish[live[j].item()] = "stop"
                        done.append(j)
            if step == self.max_new_tokens - 1:
                break
            if done:
                keep = torch.tensor(sorted(set(range(len(live))) - set(done)), dtype=torch.long)
                if len(keep) == 0:
                    break
                live, tok = live[keep], tok[keep]
                cache.keep(keep.to(dev))
            cache.extend(torch.ones(len(live), 1, dtype=torch.bool, device=dev))
            logits = model(tok[:, None], cache=cache)[:, -1]
        t2 = time.perf_counter()
        return self._pack(prompt_ids, group_size, out, lps, finish, {"prefill_s": t1 - t0, "decode_s": t2 - t1})

    def _pack(self, prompt_ids, G, out, lps, finish, timings):
        N, T = len(out), max(1, max(len(o) for o in out))
        tokens = torch.full((N, T), self.pad_id, dtype=torch.long)
        mask = torch.zeros(N, T, dtype=torch.bool)
        logp = torch.zeros(N, T)
        for i, (o, l) in enumerate(zip(out, lps)):
            tokens[i, :len(o)], mask[i, :len(o)], logp[i, :len(l)] = torch.tensor(o, dtype=torch.long), True, torch.tensor(l)
        texts = self.tok.batch_decode(out, skip_special_tokens=True)
        pidx = torch.arange(len(prompt_ids)).repeat_interleave(G)
        timings["new_tokens"] = int(mask.sum())
        return Rollouts(pidx, tokens, mask, logp, finish, texts, G, timings)


@torch.no_grad()
def generate_naive(model, tokenizer, prompt_ids, group_size=1, seed=0, max_new_tokens=16, temperature=1.0,
                   top_p=1.0, eos_ids=None):
    """The slow reference: no cache, no batching tricks; every step recomputes each row from scratch.
    Returns (tokens per row, log-probs per row) as lists. Shares only `sample` with the engine."""
    dev = model.lm_head.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    eos = eos_ids if eos_ids is not None else [tokenizer.eos_token_id]
    rows = [list(p) for p in prompt_ids for _ in range(group_size)]
    out, lps, live = [[] for _ in rows], [[] for _ in rows], list(range(len(rows)))
    for _ in range(max_new_tokens):
        logits = torch.stack([model(torch.tensor([rows[r] + out[r]], device=dev))[0, -1] for r in live])
        tok, lp = sample(logits, temperature, top_p, gen)
        for j, r in enumerate(live):
            out[r].append(tok[j].item())
            lps[r].append(lp[j].item())
        live = [r for r in live if out[r][-1] not in eos]
        if not live:
            break
    return out, lps
