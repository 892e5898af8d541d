"""
prompts.py: stage 1, sparse signal. Which prompts to train on.

A prompt the policy always solves, or never solves, gives a group of equal rewards: zero advantage,
no gradient, only cost. The growth zone is what lies between. This file holds:
  - PromptSampler: uniform, without replacement within an epoch (the baseline);
  - PassRates and GrowthZoneSampler: a decayed Beta posterior per prompt, and Thompson draws that
    fill most of the batch from the zone while the rest explores the prompts picked longest ago;
    with zone_prior="difficulty", a prompt's prior is its difficulty's pooled pass rate, so an
    unseen prompt of a difficulty the policy always solves is skipped without a rollout;
  - make_sampler: the one a config asks for;
  - group_has_signal: DAPO's test for a group worth training on;
  - refill_size: how many prompts a refill draws (the refill loop is train.collect's).

Simplifications:
  1. A pass is a reward >= threshold; the posterior ignores how far above or below it a reward is.
  2. Forgetting counts observations, not time: a prompt nobody picks keeps its estimate until the
     exploration (or a lucky draw) brings it back.
  3. The prior is Beta(1, 1) by default (zone_prior="flat"). With `bins` (zone_prior="difficulty":
     the prompts' meta["difficulty"]) a prompt's prior is instead Beta(k m, k (1 - m)), m the pooled
     pass rate of its bin (decayed counts over every group observed in it, from the Beta(1, 1)
     prior) and k = `strength` pseudo-observations: a large pool of which each prompt is seen once
     or never (the default's 20,000) then draws by its difficulty, not uniformly. Nothing finer
     than the bin is pooled.
  4. Exploitation is uniform within the zone; it does not prefer pass rates near 1/2.

    sampler = GrowthZoneSampler(problems, seed=0, zone=(0.1, 0.9), explore=0.1)
    batch = sampler.next_batch(32)                        # [(index, Problem)]
    sampler.observe([i for i, _ in batch], rewards)       # rewards: one list per group
    sampler.stats()                                       # {"zone": .., "unseen": .., ...}

`python -m pytest -q tests/test_sampler.py` runs it on a simulated pool with known pass rates.
"""
from __future__ import annotations

import math
import random
from typing import Sequence

import numpy as np
import torch

from tasks import Problem


# ---------------------------------------------------------------------------------------------
# Sampling.

class PromptSampler:
    """Uniform sampling without replacement within an epoch, reshuffled each epoch (the baseline).

    The order of epoch e is a pure function of (seed, e), so the state is just (epoch, position)
    and a resumed sampler continues with exactly the same sequence. A batch that runs past the end
    of an epoch continues into the next one.
    """

    def __init__(self, problems: Sequence[Problem], seed: int):
        if len(problems) == 0:
            raise ValueError("PromptSampler needs at least one problem")
        self.problems = list(problems)
        self.seed = int(seed)
        self.epoch = 0
        self.pos = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        """The visiting order of an epoch."""
        order = list(range(len(self.problems)))
        random.Random(f"zeros-sampler:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int, refill: bool = False) -> list[tuple[int, Problem]]:
        """The next n (index into problems, Problem) pairs; `refill` changes nothing here (within an
        epoch no prompt comes twice)."""
        out = []
        while len(out) < n:
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            i = self._order[self.pos]
            self.pos += 1
            out.append((i, self.problems[i]))
        return out

    def observe(self, indices: Sequence[int], rewards: Sequence[float]) -> None:
        """Hook for per-prompt outcomes after scoring; a no-op for uniform sampling."""

    def stats(self) -> dict:
        return {}  # nothing tracked; GrowthZoneSampler reports the zone here

    def state_dict(self) -> dict:
        return {"kind": "uniform", "seed": self.seed, "epoch": self.epoch, "pos": self.pos,
                "n_problems": len(self.problems)}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind", "uniform") != "uniform":
            raise ValueError(f"PromptSampler.load_state_dict: this state is from another sampler "
                             f"(kind={sd['kind']!r}); a run cannot switch samplers on resume")
        if sd["n_problems"] != len(self.problems):
            raise ValueError(f"sampler state is for {sd['n_problems']} problems, "
                             f"this pool has {len(self.problems)}")
        self.seed, self.epoch, self.pos = int(sd["seed"]), int(sd["epoch"]), int(sd["pos"])
        self._order = self._epoch_order(self.epoch)


# ---------------------------------------------------------------------------------------------
# Pass rates, the growth zone, and DAPO's dynamic-sampling test.

class PassRates:
    """A Beta posterior over each prompt's pass rate: Beta(a + s_i, b + f_i), in numpy arrays.

    s_i and f_i are decayed counts of passes and fails: each observation of prompt i first
    multiplies them by `decay` (a step back toward the prior), then adds the group's passes and
    fails. So they stay below G / (1 - decay), and a new group always moves the estimate by a fixed
    share: an estimate never freezes. A reward >= `threshold` is a pass (non-binary rewards too).
    """

    def __init__(self, n: int, prior: tuple = (1.0, 1.0), decay: float = 0.8,
                 threshold: float = 0.5, bins=None, strength: float = 8.0,
                 bin_decay: float = 0.9):
        if len(prior) != 2 or not (prior[0] > 0 and prior[1] > 0):
            raise ValueError(f"PassRates: prior must be (a, b) with a, b > 0, got {prior!r}")
        if not 0 < decay <= 1:
            raise ValueError(f"PassRates: decay must be in (0, 1], got {decay!r}")
        self.a, self.b, self.decay, self.threshold = (float(prior[0]), float(prior[1]),
                                                      float(decay), float(threshold))
        self.s, self.f = np.zeros(n), np.zeros(n)  # decayed pass and fail counts
        self.visits = np.zeros(n, dtype=np.int64)  # groups observed, never decayed
        # the pooled prior: each prompt's bin (0 .. B-1), each bin's decayed pass and fail counts
        self.bins = None if bins is None else np.asarray(bins, dtype=np.int64)
        if self.bins is not None and (self.bins.shape != (n,) or (self.bins < 0).any()):
            raise ValueError(f"PassRates: bins must be {n} labels >= 0")
        nb = 0 if self.bins is None else int(self.bins.max(initial=-1)) + 1
        self.bs, self.bf = np.zeros(nb), np.zeros(nb)
        self.strength, self.bin_decay = float(strength), float(bin_decay)

    def observe(self, indices: Sequence[int], groups: Sequence[np.ndarray]) -> None:
        for i, r in zip(indices, groups):  # one Python step per group, never per prompt of the pool
            if not np.isfinite(r).all():
                raise ValueError(f"PassRates: the rewards of prompt {i} are not all finite: "
                                 f"{r.tolist()}")
            passes = float((r >= self.threshold).sum())
            self.s[i] = self.decay * self.s[i] + passes
            self.f[i] = self.decay * self.f[i] + (r.size - passes)
            self.visits[i] += 1
            if self.bins is not None:  # the bin's counts forget by the group, like a prompt's
                d = self.bins[i]
                self.bs[d] = self.bin_decay * self.bs[d] + passes
                self.bf[d] = self.bin_decay * self.bf[d] + (r.size - passes)

    def prior(self):
        """Every prompt's prior (a, b): the fixed one, or Beta(k m, k (1 - m)) from its bin's pooled
        pass rate m (a bin not yet observed: m = 1/2)."""
        if self.bins is None:
            return self.a, self.b
        m = ((self.a + self.bs) / (self.a + self.b + self.bs + self.bf))[self.bins]
        return self.strength * m, self.strength * (1 - m)

    def mean(self) -> np.ndarray:
        a, b = self.prior()
        return (a + self.s) / (a + b + self.s + self.f)

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        """One Thompson draw of every prompt's pass rate."""
        a, b = self.prior()
        return rng.beta(a + self.s, b + self.f)


class GrowthZoneSampler:
    """Prompts in the growth zone: not always solved (no gain), not never solved (no reward).

    Each batch, vectorised over the whole pool:
      1. draw every prompt's pass rate from its posterior (Thompson sampling). An unseen prompt
         draws from the prior, so it is a candidate as often as the prior puts it in the zone; a
         prompt failed in its last groups still lands in the zone now and then, the more often the
         less evidence there is;
      2. exploit, about (1 - explore) of the batch: uniformly among the prompts whose draw lies in
         `zone` and that were not picked in the last `cooldown` steps. Known-easy and known-hard
         prompts are skipped; on a small pool the zone's prompts come back often;
      3. explore, the rest (and exploit slots with no candidate): the prompts picked longest ago,
         never-picked first, ties at random. Every prompt comes back within about
         pool / (batch * explore) steps, so a prompt too hard yesterday is tried again today.
    A batch has no repeats unless it is larger than the pool. Same interface as PromptSampler;
    state_dict() holds the counts and the random state, so a resumed run draws the same batches.
    stats() describes the last batch. Every rank must observe() the whole batch, or ranks diverge.
    """

    def __init__(self, problems: Sequence[Problem], seed: int, zone: tuple = (0.1, 0.9),
                 explore: float = 0.1, prior: tuple = (1.0, 1.0), decay: float = 0.8,
                 threshold: float = 0.5, cooldown: int = 0, bins=None):
        if len(problems) == 0:
            raise ValueError("GrowthZoneSampler needs at least one problem")
        if len(zone) != 2 or not 0 <= zone[0] < zone[1] <= 1:
            raise ValueError(f"GrowthZoneSampler: zone must be (lo, hi) with 0 <= lo < hi <= 1, "
                             f"got {zone!r}")
        if not 0 <= explore <= 1:
            raise ValueError(f"GrowthZoneSampler: explore must be in [0, 1], got {explore!r}")
        if not isinstance(cooldown, int) or cooldown < 0:
            raise ValueError(f"GrowthZoneSampler: cooldown must be an int >= 0, got {cooldown!r}")
        self.problems, self.seed = list(problems), int(seed)
        self.lo, self.hi, self.explore, self.cooldown = (float(zone[0]), float(zone[1]),
                                                         float(explore), cooldown)
        self.rates = PassRates(len(self.problems), prior, decay, threshold, bins)
        self.rng = np.random.default_rng(self.seed)
        self.step = 0
        self.last_pick = np.full(len(self.problems), -1, dtype=np.int64)  # -1: never picked
        self._stats: dict = {}

    def next_batch(self, n: int, refill: bool = False) -> list[tuple[int, Problem]]:
        """The next n (index into problems, Problem) pairs. A draw starts a new step; a `refill`
        draws more for the same step, and never a prompt that the step already drew (unless the pool
        has run out)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"next_batch: n must be an int >= 1, got {n!r}")
        mean, seen = self.rates.mean(), self.rates.visits > 0  # before this batch, for stats()
        # steps, not draws: the cooldown and the in-step exclusion count steps
        self.step += not refill
        picks, explored = [], 0
        while len(picks) < n:  # a batch larger than the pool takes it in rounds
            batch, k_explore = self._pick(min(n - len(picks), len(self.problems)))
            picks += batch.tolist()
            explored += k_explore
        self._stats.update(self._pool_stats(mean, seen),
                           zone=float(np.mean(self._in_zone(mean[picks]) & seen[picks])),
                           unseen=float(np.mean(~seen[picks])), explored=explored / n)
        return [(i, self.problems[i]) for i in picks]

    def _pick(self, k: int) -> tuple[np.ndarray, int]:
        """k distinct prompts (k <= pool size) and how many of them came from exploration."""
        rng, N = self.rng, len(self.problems)
        theta = self.rates.draw(rng)  # (N,)
        ok = self._in_zone(theta) & (self.step - self.last_pick > self.cooldown)
        cand = np.flatnonzero(ok)
        k_zone = min(k - int(rng.binomial(k, self.explore)), cand.size)
        zone = (rng.choice(cand, size=k_zone, replace=False) if k_zone
                else np.empty(0, dtype=np.int64))
        # the oldest pick first; the fraction breaks ties at random
        staleness = self.last_pick + rng.random(N)
        staleness[zone] = np.inf
        m = k - k_zone
        explore = np.argpartition(staleness, m - 1)[:m] if m else np.empty(0, dtype=np.int64)
        batch = rng.permutation(np.concatenate([zone, explore]))
        self.last_pick[batch] = self.step
        return batch, m

    def _in_zone(self, p: np.ndarray) -> np.ndarray:
        return (p >= self.lo) & (p <= self.hi)

    def _pool_stats(self, mean: np.ndarray, seen: np.ndarray) -> dict:
        n_seen = max(1, int(seen.sum()))
        return {"pool_seen": float(seen.mean()),
                "pool_zone": float((self._in_zone(mean) & seen).sum()) / n_seen,
                "pool_easy": float(((mean > self.hi) & seen).sum()) / n_seen,
                "pool_hard": float(((mean < self.lo) & seen).sum()) / n_seen}

    def observe(self, indices: Sequence[int], rewards: Sequence) -> None:
        """rewards[k]: the rewards of the group of prompt indices[k] (a list), or a single float."""
        if len(indices) != len(rewards):
            raise ValueError(f"observe: {len(indices)} indices but {len(rewards)} reward groups")
        idx = [int(i) for i in indices]
        bad = [i for i in idx if not 0 <= i < len(self.problems)]
        if bad:
            raise IndexError(f"observe: prompt indices {bad[:5]} outside the pool of "
                             f"{len(self.problems)}")
        groups = [np.atleast_1d(np.asarray(r, dtype=np.float64)).reshape(-1) for r in rewards]
        self.rates.observe(idx, groups)
        rates = np.array([float((g >= self.rates.threshold).mean()) if g.size else np.nan
                          for g in groups])
        self._stats["zone_obs"] = float(self._in_zone(rates).mean()) if len(rates) else 0.0

    def stats(self) -> dict:
        """The last batch: zone (share whose estimated pass rate was in the zone), unseen (never
        observed before), explored (picked by exploration), zone_obs (share of the observed groups
        whose pass rate fell in the zone); the pool: pool_seen, and among the seen prompts
        pool_zone, pool_easy (above the zone), pool_hard (below it)."""
        return dict(self._stats)

    def state_dict(self) -> dict:
        r = self.rates
        arrays = {k: torch.from_numpy(v.copy()) for k, v in
                  (("s", r.s), ("f", r.f), ("visits", r.visits), ("last_pick", self.last_pick),
                   ("bs", r.bs), ("bf", r.bf))}
        return {"kind": "growth_zone", "n_problems": len(self.problems), "seed": self.seed,
                "step": self.step, "rng": self.rng.bit_generator.state, "stats": dict(self._stats),
                **arrays}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "growth_zone":
            raise ValueError("GrowthZoneSampler.load_state_dict: this state is not from a "
                             f"GrowthZoneSampler (kind={sd.get('kind')!r}); a run cannot switch "
                             "samplers on resume")
        if sd["n_problems"] != len(self.problems):
            raise ValueError(f"sampler state is for {sd['n_problems']} problems, "
                             f"this pool has {len(self.problems)}")
        if self.rates.bs.shape != tuple(sd.get("bs", torch.zeros(0)).shape):  # bins' counts
            raise ValueError("sampler state has another number of difficulty bins than this run "
                             "(config key zone_prior changed?); a run cannot switch on resume")
        self.seed, self.step, self._stats = int(sd["seed"]), int(sd["step"]), dict(sd["stats"])
        self.rng.bit_generator.state = sd["rng"]
        self.rates.s, self.rates.f = (sd["s"].numpy().astype(np.float64),
                                      sd["f"].numpy().astype(np.float64))
        self.rates.visits = sd["visits"].numpy().astype(np.int64)
        none = torch.zeros(0)  # a state from before the pooled prior: no bins, as checked above
        self.rates.bs, self.rates.bf = (sd.get(k, none).numpy().astype(np.float64)
                                        for k in ("bs", "bf"))
        self.last_pick = sd["last_pick"].numpy().astype(np.int64)


def group_has_signal(rewards, min_spread: float = 0.0, spread: str = "range") -> bool:
    """DAPO's dynamic-sampling test: do a group's rewards differ enough to give a nonzero advantage?

    spread "range" is max - min, "std" the population standard deviation; the group has signal
    when it is > min_spread. A binary group has it when it mixes 0s and 1s; with non-binary
    rewards, min_spread drops groups that differ only by noise ([0.50, 0.52] has range 0.02).
    A group of fewer than two completions has none. Accepts a list, an array or a CPU tensor.
    """
    if spread not in ("range", "std"):
        raise ValueError(f"group_has_signal: spread must be 'range' or 'std', got {spread!r}")
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if not np.isfinite(r).all():
        raise ValueError(f"group_has_signal: rewards must be finite, got {r.tolist()}")
    if r.size < 2:
        return False
    # equal rewards become exact zeros, so their std is exactly 0, not a rounding error
    r = r - r[0]
    return bool((r.max() - r.min() if spread == "range" else r.std()) > min_spread)


def refill_size(n_local: int, n_kept: int, drawn: int, signals: int) -> int:
    """Prompts per rank for the next refill try: what is still missing, scaled up by the keep rate
    seen so far in this step (drawn groups over groups with signal), never more than a whole batch.

    16 wanted, 14 kept, 3 in 4 groups with signal so far: ceil(2 * 4 / 3) = 3 prompts, not 16."""
    return min(n_local, math.ceil((n_local - n_kept) * drawn / max(1, signals)))


def difficulty_bins(problems: Sequence[Problem]):
    """Each prompt's bin for the pooled prior: the rank of its meta["difficulty"] among the pool's
    values; None (a flat prior) when a prompt has none."""
    ds = [p.meta.get("difficulty") if p.meta else None for p in problems]
    if any(d is None for d in ds):
        return None
    rank = {d: i for i, d in enumerate(sorted(set(ds)))}
    return [rank[d] for d in ds]


def make_sampler(cfg, problems: Sequence[Problem]):
    """The sampler that config key `sampler` names: growth (the growth zone) or uniform (the
    baseline)."""
    if cfg.sampler == "growth":
        return GrowthZoneSampler(problems, cfg.seed, zone=cfg.zone, explore=cfg.explore,
                                 bins=difficulty_bins(problems) if cfg.zone_prior ==
                                 "difficulty" else None)
    if cfg.sampler == "uniform":
        return PromptSampler(problems, cfg.seed)
    raise ValueError(f"config key 'sampler' must be growth or uniform, got {cfg.sampler!r}")
