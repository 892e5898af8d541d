"""
sparse_rollout.py: stage 2's sparse machinery as the loop sees it, one object that train.py calls
at a few fixed points. It owns the KV budget (a fixed budget, or a Schedule and its Controller),
DistillSparse, the paired dense comparison and the rollout mode.

    sp = SparseRollout.for_run(cfg, policy, tok, train_ids, log, rank, world)  # the run's stage 2:
                                         # its KV budget (kv_budget), then the object
    sp.engine, sp.rollout_model          # what generates the training rollouts
    sp.pool                              # the run's KV pool (kvcache.KVPool, kv_pool_tokens,
                                         # kv_dtype): its engines and held-out evaluation share it
    rec.update(sp.after_rollout(...))    # each try: alpha on every row; every kv_compare_every
                                         # steps, the dense comparison
    rec.update(sp.observe(n, group))     # the step: alpha and rollout TV figures, the Controller
    rec.update(sp.after_update(...))     # DistillSparse's adapter step
    sp.refresh(policy)                   # the policy's new weights under the adapter
    sp.extra                             # what a checkpoint keeps (schedule, controller, adapter)

Every run generates through this object, the dense default too. Two rollout modes (config key
rollout_mode):
    sparse       Sparrow's lossy path: rollouts are sampled from the sparse-KV policy; the
                 mismatch with the dense policy is measured on every row (alpha, p5 per bin, each
                 rollout's summed TV), held by the Controller, and corrected by IS (update.py).
                 With kv_budget=dense (the default) every page is read: plain dense decoding,
                 with nothing to measure unless the rollout copy differs from the policy.
    speculative  lossless: the sparse-KV policy drafts spec_k tokens, the dense policy verifies
                 them in one forward (rollout.Engine(speculative=k)), and speculative rejection
                 sampling makes every rollout an exact dense sample. No mismatch to measure (the
                 log reads "exact"), no threshold; the log shows the acceptance rate and tokens a
                 verify.

Simplifications:
    1. The dense comparison runs on try 0 of a step only, on the rollout model (a copy or the
       adapter's model: what a dense rollout of the same run would use).
    2. In speculative mode the verify runs on the rollout copy, so with a cheaper copy the samples
       are exact samples of the copy, and alpha is measured against the policy as in sparse mode.
       The draft is the same model, or with distill_r DistillSparse's adapter copy: the adapter
       trains on the draft's recorded pages toward the dense distribution, which raises the
       acceptance (spec_accept) and cannot change what is sampled.
"""

import dataclasses
import os
import time

import torch

import copies
import parallel
from calibrate import Controller, Schedule, kv_budget, observe, read_figures
from distill import DistillSparse
from kvcache import KVPool
from rollout import Engine, pool_pages
from sparsity import alpha_k, dense_alpha


class SparseRollout:
    def __init__(self, cfg, full, tok, train_ids, log, rank, world, budget, eval_ids=()):
        """full: the policy's full weights (what the engines read); budget: calibrate.kv_budget's
        (False: dense); eval_ids: the held-out prompts, which the KV pool must fit too."""
        self.cfg = cfg
        self.distill = DistillSparse.for_run(cfg, full, budget, world) if cfg.distill_r else None
        self.spec = cfg.spec_k if cfg.rollout_mode == "speculative" else 0
        # the adapter's copy generates (sparse mode) or drafts for the policy (speculative mode)
        draft = self.distill.model if self.distill is not None and self.spec else None
        self.rollout_model = (self.distill.model if self.distill is not None and not self.spec
                              else copies.rollout_model_for(cfg, full, train_ids))
        log(f"rollout copy: {copies.describe_copy(self.rollout_model)}"
            + (f", plus a DistillSparse adapter of rank {cfg.distill_r}"
               + (" that drafts" if self.spec else "") if self.distill else ""))
        copy = self.rollout_model is not full
        # a rollout that can differ from the policy: alpha every step
        self.measure = copy or (bool(budget) and not self.spec)
        topk = alpha_k(full.config.vocab_size, cfg.alpha_topk) if self.measure else 0
        gen = dict(tokenizer=tok, max_new_tokens=cfg.max_new_tokens,
                   stop=[cfg.stop] if cfg.stop else [])
        # the run's one KV pool (kv_pool_tokens; 0: one rollout batch at the longest training
        # prompt, or one sampled held-out group), made once: the rollout engine, the dense
        # comparison and held-out evaluation share it
        longest_eval = max(map(len, eval_ids), default=0)
        self.pool = KVPool(pool_pages(cfg, max(map(len, train_ids)), longest_eval=longest_eval)
                           * cfg.page_size)
        kv = dict(temperature=cfg.temperature, top_p=cfg.top_p, page_size=cfg.page_size,
                  scorer=cfg.kv_scorer, dense_layers=cfg.dense_layers,
                  rescore_every=cfg.kv_rescore_every, keep_first=cfg.kv_keep_first,
                  keep_recent=cfg.kv_keep_recent, kv_dtype=cfg.kv_dtype, pool=self.pool,
                  step=cfg.decode_step)
        self.engine = Engine(self.rollout_model, sparse=budget, speculative=self.spec, draft=draft,
                             spec_draft=cfg.spec_draft,
                             adapt_k=cfg.spec_k_max if self.spec else 0,
                             record_pages=self.distill is not None, topk_logprobs=topk, **gen, **kv)
        self.dense_engine = (Engine(self.rollout_model, **gen, **kv)
                             if cfg.kv_compare_every and budget else None)
        self.schedule = budget if isinstance(budget, Schedule) else None
        target = cfg.kv_target if cfg.kv_hold == "position" else cfg.kv_tv_target
        self.controller = (Controller(self.schedule, target=target, hold=cfg.kv_hold)
                           if cfg.kv_controller else None)
        self.extra = {"schedule": self.schedule, "controller": self.controller,
                      "distill": self.distill}
        self.alphas = []

    @classmethod
    def for_run(cls, cfg, full, tok, train_ids, log, rank, world, eval_ids=()):
        """The run's budget (a calibrated table is calibrated once: a resumed run reads it back),
        then the object."""
        table = os.path.join(cfg.out_dir, "kv_schedule.json")
        if cfg.resume and cfg.kv_budget == "calibrate" and os.path.exists(table):
            budget = kv_budget(dataclasses.replace(cfg, kv_budget=f"schedule:{table}"), log=log)
        else:
            budget = kv_budget(cfg, full, tok, train_ids, log, rank)
        return cls(cfg, full, tok, train_ids, log, rank, world, budget, eval_ids)

    # ---- the step

    def after_rollout(self, step, t, ro, batch, prompt_ids, seed, rewards, cascade, ref, me, n):
        """One try's rollouts: alpha on every row (against `ref`, the dense policy), the read
        fraction per layer and bin, the speculative figures and, on try 0 of every
        kv_compare_every-th step, the paired dense comparison. -> figures for the record."""
        cfg, rec = self.cfg, {}
        if self.measure:  # every row, before dynamic sampling drops any: a collapse shows here
            t0 = time.perf_counter()
            a = dense_alpha(ref, prompt_ids, ro, cfg.temperature, cfg.micro_batch)
            # host, as ro.mask is: gathered and binned there (calibrate.observe)
            rows = torch.arange(len(ro), device="cpu")[:, None].expand(ro.mask.shape)[ro.mask]
            self.alphas.append((a[ro.mask], ro.budget_dense[ro.mask].long(),
                                rows + (t * n + me) * 2**20))  # a label per rollout, all ranks
            rec["alpha_s"] = time.perf_counter() - t0
        if t == 0 and self.engine.budget is not None and not self.spec:
            L = self.engine.model.config.num_hidden_layers
            rec.update(read_figures(ro, cfg.kv_bin_pages, L, cfg.dense_layers))
        if self.spec:
            tm = ro.timings
            rec.update(spec_k=tm["k"], spec_accept=tm["acceptance"],
                       spec_per_verify=tm["tokens_per_verify"],
                       spec_draft_s=tm["draft_s"], spec_verify_s=tm["verify_s"])
            for d in ("suffix", "sparse"):  # per drafter (spec_draft): drafts sent, accepted
                rec.update({f"spec_drafted_{d}": tm[f"{d}_drafted"],
                            f"spec_accept_{d}": tm[f"{d}_acceptance"]})
        if t == 0 and self.dense_engine is not None and step % cfg.kv_compare_every == 0:
            rec.update(self.compare_dense(ro, batch, prompt_ids, seed, rewards, cascade))
        return rec

    def compare_dense(self, ro, batch, prompt_ids, seed, rewards, cascade):
        """Paired fidelity on the dense engine (same weights):
        - the same prompts with the same seed, scored by the same cascade: dense_reward, and
          reward_gap = sparse - dense, the training signal the sparse rollout lost;
        - the sparse rollout's own tokens decoded densely (Engine.generate(force=...)): the same
          rows at the same lengths, so rollout_speedup (dense time / sparse time) times the same
          work, and neither side is timed at a length the other does not reach."""
        G = self.cfg.group_size
        dense = self.dense_engine.generate(prompt_ids, G, seed=seed)
        scored = cascade.score_batch([p for _, p in batch for _ in range(G)], dense.texts,
                                     group_size=G, finish=dense.finish)
        lens = ro.mask.sum(1).tolist()
        forced = self.dense_engine.generate(prompt_ids, G, seed=seed, force=[
            ro.tokens[i, :k].tolist() for i, k in enumerate(lens)])
        secs = {k: x.timings["prefill_s"] + x.timings["decode_s"]
                for k, x in (("dense", forced), ("sparse", ro))}
        sparse_r, dense_r = sum(rewards) / len(rewards), sum(scored.rewards) / len(scored.rewards)
        return {"dense_reward": dense_r, "reward_gap": sparse_r - dense_r,
                "dense_len_mean": dense.mask.sum(1).float().mean().item(),
                "dense_tok_s": forced.timings["new_tokens"] / max(1e-9, secs["dense"]),
                "sparse_tok_s": ro.timings["new_tokens"] / max(1e-9, secs["sparse"]),
                "rollout_speedup": secs["dense"] / max(1e-9, secs["sparse"])}

    def observe(self, n, group):
        """The step's mismatch over every rank's tokens (alpha, p5 per bin, rollout TV); the
        controller moves the table. Speculative without a copy: "exact", nothing to hold."""
        if not self.measure:
            return {"mismatch": "exact"} if self.spec else {}
        mine = [torch.cat(x) for x in zip(*self.alphas)]
        self.alphas = []
        a, pages, rows = (torch.cat(x) for x in zip(*parallel.gather(mine, n, group)))
        cfg = self.cfg
        return observe(a, pages, cfg.kv_bin_pages, self.schedule, self.controller,
                       cfg.kv_quantile, rows)

    def after_update(self, kept, prompt_lens, ids, tmask, dense_full, pg):
        """DistillSparse's adapter step, toward the dense distribution the trainer computed."""
        if self.distill is None or not kept or dense_full is None:
            return {}
        return self.distill.step_on(kept, prompt_lens, self.cfg.group_size, ids, tmask,
                                    dense_full, pg)

    def refresh(self, full):
        """After the policy's update: DistillSparse's base follows it -> True, or False when the
        rollout copy is the loop's to refresh (copies.py, stage 5)."""
        if self.distill is None:
            return False
        self.distill.refresh(full)
        return True
