"""
distill.py: DistillSparse (Sparrow), stage 2 meets stage 4. A LoRA adapter that is active only in
the sparse rollout, trained to pull the sparse policy back toward the dense one, so a smaller KV
budget keeps its tail.

    python train.py configs/longcot.py --distill_r=8  # the loop: rollouts record their pages
    ds = DistillSparse(policy, r=8, lr=1e-3, coef=1.0)  # ds.model: the policy's copy + the adapter
    engine = Engine(ds.model, tok, sparse=schedule, record_pages=True)
    ro = engine.generate(prompts, G)    # sparse rollouts, adapter on
    ds.update(ids, tmask, ro.read_pages, prompt_lens, dense_full)  # after the policy's update
    ds.refresh(policy)                  # the copy's base follows the policy's new weights

How it fits together:
    1. The adapter lives on a copy of the policy (`ds.model`), which generates the rollouts. The
       policy's own forwards (the dense log-probs, the policy update, held-out evaluation) never see
       it: dense log-probs and the policy update are adapter-free by construction. After every
       policy update `refresh` copies the new base weights in; the adapter is kept (and is what
       ships to a rollout worker: a few KiB).
    2. Training needs the sparse policy's log-probs with gradients. `ReplayCache` gives them in one
       parallel forward: the engine records which pages every sparse layer and KV head read at every
       decode step (`Engine(record_pages=True)` -> ro.read_pages), and the replay masks attention to
       exactly those pages for that query. Every key and value the engine cached was computed under
       the same masks, so the replay reproduces the rollout's log-probs (tests/test_distill.py:
       <= 1e-5 in fp32) without a decode loop.
    3. The loss on rollout tokens: coef * KL(dense || sparse) per position, summed over the
       vocabulary, with the dense distribution the trainer already computed for its old log-probs
       (update.token_logprobs(full=True)) and, with `pg`, plus the policy-gradient loss on the
       sparse replay (so the adapter also follows the reward, as Sparrow's optional term). Without
       `pg`, coef only scales the gradient (AdamW undoes most of it).
    4. The effect shows in the mismatch statistic: p5 of alpha per bin, which train.py logs every
       step.

Simplifications:
    1. One adapter pass per step, over the whole kept batch, after the policy's update; full-weight
       policies only (lora_r = 0), one process, and the plain rollout copy (rollout_copy = same).
    2. The full dense distribution is kept at every scored position: (tokens, vocab) floats. Fine
       for the synthetic task's 40 tokens; a 150k vocabulary would want the top-k
       (sparsity.alpha_topk's lists).
    3. Replay masks are dense (B, H_kv, T, T) booleans, made for each sparse layer as it attends
       (and repeated to the query heads): a reference, sized for micro-batches.
    4. Under autocast (the run's `autocast` key) each replay forward enters its own context; the
       adapter's optimizer step runs outside it, as the policy's does (update.train_on).

Tests: `python -m pytest tests/test_distill.py`.
"""

import contextlib
import copy
import time

import torch
import torch.nn.functional as F

from lora import add_lora, lora_modules
from model import repeat_kv


class ReplayCache:
    """A cache object for Transformer.forward (the model calls positions, attend per layer, advance)
    that replays recorded sparse selections over right-padded prompt + completion rows.

    read_pages   (B, Tc, L_sparse, H_kv, P) bool, ro.read_pages of these rows: the pages read to
                 produce each completion token (position 0 came from the dense prefill)
    prompt_lens  (B,) prompt length of each row; completion token c is scored at position
                 prompt_len - 1 + c
    Layers below `dense_layers`, prompt positions and the first completion token attend causally
    and densely, as the engine's prefill did."""

    def __init__(self, read_pages, prompt_lens, page_size, dense_layers):
        self.read, self.plen = read_pages, torch.as_tensor(prompt_lens, device=read_pages.device)
        self.ps, self.dl = page_size, dense_layers

    def positions(self, T):
        return torch.arange(T, device=self.read.device).expand(len(self.plen), T)

    def advance(self, T):
        pass

    def mask(self, layer, T, device):
        """(B, H_kv, T, T) bool: query t may attend key j. Made when the layer attends and not kept
        (one layer's dense mask at a time; autograd keeps what the backward needs)."""
        read, plen = self.read.to(device), self.plen.to(device)
        B, Tc, _, H, P = read.shape
        t = torch.arange(T, device=device)
        c = t[None] - plen[:, None] + 1  # (B, T) the completion token each query produces
        replay = (c >= 1) & (c < Tc)  # token 0 came from the dense prefill: nothing to replay
        # (B, T, H, P): the pages read for that token (clamped rows are masked out by `replay`)
        sel = read[torch.arange(B, device=device)[:, None], c.clamp(0, Tc - 1), layer - self.dl]
        # (B, H, Tq, Tk): key j is allowed when its logical page j // page_size was read
        allowed = sel[..., (t // self.ps).clamp(max=P - 1)].permute(0, 2, 1, 3)
        causal = t[None, :] <= t[:, None]  # (Tq, Tk)
        m = torch.where(replay[:, None, :, None], allowed & causal, causal)  # prompt: causal
        # a query that read no page (a record padded to a longer try's) may see itself: an
        # all-masked row is NaN on some attention backends and 0 on others; its output is unused
        return m | (~m.any(-1, keepdim=True) & (t[None, :] == t[:, None]))

    def attend(self, layer, q, k, v):  # q (B, Hq, T, D); k, v (B, Hkv, T, D)
        if layer < self.dl:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        m = self.mask(layer, q.shape[2], q.device)
        # query head h reads KV head h // (Hq / Hkv); with a mask, SDPA's GQA is the math kernel's
        # alone, so the KV heads are repeated instead
        m = m.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, *repeat_kv(k, v, q.shape[1]), attn_mask=m)


def replay_logprobs(model, ids, tmask, read_pages, prompt_lens, page_size, dense_layers,
                    temperature=1.0):
    """The sparse rollout's log-probs, recomputed in one forward (with gradients if enabled): (B, T)
    at the tmask positions (train.build_batch's layout), 0 elsewhere, and the (M, V) log-softmax at
    those positions."""
    cache = ReplayCache(read_pages, prompt_lens, page_size, dense_layers)
    h = model(ids, cache=cache, hidden=True)[tmask]
    full = F.log_softmax(model.lm_head(h).float() / temperature, -1)
    out = torch.zeros(ids.shape, device=ids.device, dtype=full.dtype)
    out[tmask] = full.gather(-1, torch.roll(ids, -1, 1)[tmask][:, None])[:, 0]
    return out, full


class DistillSparse:
    """The sparse-rollout adapter, its copy of the policy and its optimizer (see the module
    docstring)."""

    def __init__(self, policy, r=8, alpha=16.0, lr=1e-3, coef=1.0, pg=False, page_size=16,
                 dense_layers=2, temperature=1.0, micro_batch=16, amp=None):
        if lora_modules(policy):
            raise ValueError("DistillSparse needs a full-weight policy (lora_r = 0): its adapter "
                             "sits on a copy")
        self.model = add_lora(copy.deepcopy(policy), r, alpha)  # freezes the copy's base weights
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr,
                                     weight_decay=0.0)
        self.coef, self.pg, self.ps, self.dl = coef, pg, page_size, dense_layers
        self.temperature, self.mbs = temperature, micro_batch
        # entered around each replay forward, never around the step (see update.train_on)
        self.amp = contextlib.nullcontext() if amp is None else amp

    @classmethod
    def for_run(cls, cfg, model, budget, world):
        """The adapter for a train.py run (distill_r > 0), after checking that the run is one it
        supports."""
        bad = [why for why, hit in (("a sparse kv_budget", not budget), ("lora_r = 0", cfg.lora_r),
                                    ("rollout_copy = same", cfg.rollout_copy != "same"),
                                    ("one process", world > 1))
               if hit]
        if bad:
            raise ValueError(f"config key 'distill_r' needs {', '.join(bad)}")
        amp = torch.autocast(model.lm_head.weight.device.type, torch.bfloat16,
                             enabled=cfg.autocast == "bfloat16")  # as train.py's run.amp
        return cls(model, cfg.distill_r, lr=cfg.distill_lr, coef=cfg.distill_coef,
                   pg=cfg.distill_pg, page_size=cfg.page_size, dense_layers=cfg.dense_layers,
                   temperature=cfg.temperature, micro_batch=cfg.micro_batch, amp=amp)

    def step_on(self, kept, prompt_lens, group_size, ids, tmask, dense_full, pg_term=None):
        """`update` on train.py's kept groups (their 6th field: the rows' ro.read_pages), whose page
        records are padded to one shape here (refill tries differ in length). prompt_lens: one per
        kept group."""
        sel = [k.pages for k in kept]
        # a try's record spans its longest row, which may be a
        # dropped group's: longer than any kept completion
        rows, steps, pages = (sum(len(x) for x in sel), max(x.shape[1] for x in sel),
                              max(x.shape[4] for x in sel))
        shape = (rows, steps, *sel[0].shape[2:4], pages)
        # on the host on purpose, as the records are: assembled here, copied to the device once
        pages, i = torch.zeros(shape, dtype=torch.bool, device="cpu"), 0
        for x in sel:
            pages[i:i + len(x), :x.shape[1], :, :, :x.shape[4]] = x
            i += len(x)
        plen = torch.tensor(prompt_lens, device=ids.device).repeat_interleave(group_size)
        return self.update(ids, tmask, pages.to(ids.device), plen, dense_full, pg_term)

    @torch.no_grad()
    def refresh(self, policy):
        """Copy the policy's weights into the copy's base layers; the adapter is left as it is."""
        src = dict(policy.named_parameters())
        for name, p in self.model.named_parameters():
            if ".lora_" not in name:
                p.copy_(src[name.replace(".base_layer.", ".")])

    def update(self, ids, tmask, read_pages, prompt_lens, dense_full, pg_term=None):
        """One optimizer step over the batch. dense_full (M, V): the dense log-softmax at the tmask
        positions, in the order of ids[tmask]. pg_term(logp, rows) -> summed policy loss of those
        rows (train.py passes its clipped surrogate), when the policy term is on. Returns
        {"distill_kl": mean KL(dense || sparse) per token, before the step; "distill_s":
        seconds}."""
        t0 = time.perf_counter()
        self.model.train()
        ntok = max(1, int(tmask.sum()))
        # where each row's tokens start in dense_full
        offsets = F.pad(tmask.sum(1).cumsum(0), (1, 0))
        self.opt.zero_grad(set_to_none=True)
        kl_sum = 0.0
        for rows in torch.arange(ids.shape[0], device=ids.device).split(self.mbs):
            a, b = int(offsets[rows[0]]), int(offsets[rows[-1] + 1])
            with self.amp:  # the forward only: the backward and the step run outside it
                lp, full = replay_logprobs(self.model, ids[rows], tmask[rows], read_pages[rows],
                                           prompt_lens[rows], self.ps, self.dl, self.temperature)
            pd = dense_full[a:b]
            kl = (pd.exp() * (pd - full)).sum(-1)  # KL(dense || sparse) per token
            loss = self.coef * kl.sum()
            if self.pg and pg_term is not None:
                loss = loss + pg_term(lp, rows)
            (loss / ntok).backward()
            kl_sum += kl.sum().item()
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], 1.0)
        self.opt.step()
        self.model.eval()
        return {"distill_kl": kl_sum / ntok, "distill_s": time.perf_counter() - t0}

    def state_dict(self):
        return {"adapter": {k: v for k, v in self.model.state_dict().items() if "lora_" in k},
                "opt": self.opt.state_dict()}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["adapter"], strict=False)
        self.opt.load_state_dict(sd["opt"])
