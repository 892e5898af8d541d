"""
examples/hirelc.py: a HiReLC-style search for the rollout copy's compression, block by block. Each
decoder block of the policy gets an N:M pattern (or dense) and a precision (bf16, fp8, int8); the
search looks for the copy that the cost model says is fastest while the per-position mismatch
against the policy keeps its tail: p5 of alpha = 1 - TV, per bin of cached length, at or above the
threshold (0.86). A random search and a uniform sweep run beside it, once per seed. The result is
a plan file that train.py loads as a rollout copy.

    python examples/hirelc.py --out_dir=out/hirelc --threads=1 --write-results  # seeds 0,1,2;
        # out/hirelc/hirelc.md (and bench/RESULTS.md's hirelc block); plans as
        # {plan,random,uniform}-<budget>-s<seed>.json, and plan.json etc. (first seed and budget)
    python train.py configs/sharpen.py --rollout_copy=out/hirelc/plan.json --is_correction=tis \\
        --threads=1 --out_dir=out/hirelc/rl-plan                   # RL with the searched copy

One seed, top to bottom:
    1. The policy: configs/sharpen.py's warm start, or a config's (a .py as the first argument).
       The first --final_prompts prompts are held out: no search sees them (not Fisher, not the
       proxy, no real evaluation). The seed draws --eval_prompts search prompts from the rest.
    2. Sensitivity: the empirical Fisher, the squared gradients of the trainer's policy-gradient
       loss (group advantages, as update.py) on RL batches of the search pool's prompts that the
       policy samples and reward.score scores, summed per block, mean 1.
    3. The cost model (`CostModel`; no speed is measured): per decoded token at --rows rows, each
       Linear takes max(bytes / bandwidth, FLOPs / FLOP rate) (a roofline, an H200's datasheet
       rates); N:M stores n/m of the values plus ceil(log2 m) index bits each, fp8 and int8 one
       byte plus an fp32 scale per row; only 2:4 doubles the FLOP rate (sparse tensor cores).
       Speed and budget: the dense bf16 copy's seconds over the copy's, and a share of them.
    4. The search, each episode: a high-level ensemble (three bandits over how strongly the
       sensitivities tilt the split: epsilon-greedy, UCB, softmax) votes on the budget's split
       across blocks (a sensitive block gets more); one low-level agent per block (a softmax policy
       over pattern x precision, REINFORCE with a baseline) picks its setting within its share,
       least sensitive block first; what a block leaves passes on to the next.
    5. The setting's p5 is predicted: by the logit-MSE proxy during the cold start (the mean
       squared logit gap to the policy on fixed policy samples, mapped by p5 ~ 1 - a * sqrt(mse)
       fitted through the real evaluations so far), then by a small MLP surrogate (setting one-hots
       -> p5 per bin) refitted after every real evaluation. Reward = speed if the predicted p5
       meets the threshold (else 0) - penalty * max(0, threshold - predicted p5).
    6. A setting is evaluated for real (rollouts from the copy, Sparrow's per-position alpha against
       the policy's dense forward, p5 per bin) when it is predicted to meet the threshold and would
       beat the fastest one measured to meet it, and every --cold_every episodes in the cold start
       (the anchors, all-dense bf16 and the cheapest setting, first), up to --max_real (what is
       left goes to the fastest settings seen predicted to meet it); the real p5 then counts.
    7. The random baseline: as many real evaluations as the search made at that budget, of distinct
       random settings within the budget (blocks in a random order, each uniform over the settings
       that leave the rest room for their cheapest). The uniform baseline: every uniform setting
       (one pattern and precision for all blocks), for real, once for all budgets.
    8. The choice, the same for every method: of the settings it measured for real, the fastest
       within the budget whose p5 met the threshold (none if none did). Each method has its own
       cache of real evaluations (the search and the random baseline one per budget), so no method
       reads another's. Each chosen plan is measured again on the held-out prompts.

Simplifications of HiReLC (built: per-block low-level agents, a high-level ensemble voting on the
budget's split, Fisher sensitivity, an MLP surrogate in the reward, a logit-MSE cold-start proxy):
    1. A block is a decoder layer: all its Linears share one setting. The head, the embeddings and
       the MoE router stay bf16 and dense (copies.COPY_SKIP). The high level splits the budget by
       a tilt exponent (share ~ dense seconds * sensitivity^tilt), not by free-form shares.
    2. The low-level agents are per-block softmax policies trained by REINFORCE (a contextual
       bandit per block, one step per episode), not deep RL agents; the high-level ones, bandits.
    3. HiReLC's bit widths (2 to 8) and keep ratios are replaced by the three precisions that the
       copies implement and a few N:M patterns; int8 is simulated (copies.Int8Linear).
    4. Quality is the rollout mismatch's tail (p5 alpha), not a task metric; speed is the cost
       model's: weight traffic and matmul FLOPs of one decode step (the KV cache, attention and
       per-op overheads are left out). N:M other than 2:4 assumes a kernel that reads compressed
       values; 2:4 is the one with tensor-core support.
    5. Fisher uses whole-batch squared gradients (a few RL batches), the usual empirical stand-in.
       A few seeds; the mismatch is measured on a few dozen rollouts, in bins of --bin_tokens
       tokens of cached length; a bin with fewer than --min_count tokens is ignored.
"""

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from copies import COPY_SKIP, PRECISIONS, make_rollout_copy  # noqa: E402
from config import parse_config  # noqa: E402
from report import hardware  # noqa: E402
from reward import score  # noqa: E402
from rollout import Engine  # noqa: E402
from sparsity import alpha_k, bin_stats, dense_alpha, nm_linears  # noqa: E402
from tasks import encode_pool, load_problems  # noqa: E402
from update import build_batch, group_advantages, token_logprobs  # noqa: E402
from warmstart import build_policy  # noqa: E402

PATTERNS = ("dense", "6:8", "4:8", "2:4", "1:4")
OPTIONS = [(p, q) for p in PATTERNS for q in PRECISIONS]  # one block's settings
VALUE_BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0}
# an H200's datasheet: HBM3e 4.8 TB/s; dense tensor-core bf16 989 TFLOP/s, fp8 and int8 1,979
BANDWIDTH = 4.8e12
FLOP_RATE = {"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12}
TILTS = (0.0, 0.1, 0.25, 0.5, 1.0)  # the high level's arms: share ~ dense s * sensitivity^tilt


def linear_seconds(out_f, in_f, pattern, precision, rows):
    """One Linear's time per decode step of `rows` tokens: max(bytes / BW, FLOPs / rate)."""
    n, m = (0, 0) if pattern == "dense" else (int(x) for x in pattern.split(":"))
    keep, index_bits = (n / m, math.ceil(math.log2(m))) if n else (1.0, 0)
    nbytes = out_f * in_f * keep * (VALUE_BYTES[precision] + index_bits / 8)
    nbytes += 4 * out_f if precision != "bf16" else 0  # per-row scales
    flops = 2 * rows * out_f * in_f / (2 if (n, m) == (2, 4) else 1)
    return max(nbytes / BANDWIDTH, flops / FLOP_RATE[precision])


class CostModel:
    """shapes: per block, the (out, in) of its Linears; head: the (out, in) of what stays bf16 and
    dense. Seconds per decode step of one block's setting, and the copy's speed over dense bf16."""

    def __init__(self, shapes, head, rows):
        self.shapes, self.rows = shapes, rows
        self.head = linear_seconds(*head, "dense", "bf16", rows)
        self.dense_blocks = [self.block(b, "dense", "bf16") for b in range(len(shapes))]
        self.dense = self.head + sum(self.dense_blocks)

    def block(self, b, pattern, precision):
        return sum(linear_seconds(o, i, pattern, precision, self.rows) for o, i in self.shapes[b])

    def speed(self, setting):
        return self.dense / (self.head + sum(self.block(b, *s) for b, s in enumerate(setting)))

    def within(self, setting, budget):
        return 1 / self.speed(setting) <= budget * (1 + 1e-9)


def block_shapes(model):
    """-> (block prefixes, per block the (out, in) of its prunable Linears, the head's shape)."""
    layers = nm_linears(model, COPY_SKIP)
    prefixes = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    shapes = [[tuple(mod.weight.shape) for k, mod in layers.items() if k.startswith(p + ".")]
              for p in prefixes]
    return prefixes, shapes, tuple(model.lm_head.weight.shape)


def write_plan(path, prefixes, setting, extra=None):
    blocks = {p: {"nm": s[0], "precision": s[1]} for p, s in zip(prefixes, setting)}
    with open(path, "w") as f:
        json.dump(dict(blocks=blocks, **(extra or {})), f, indent=1)
    return path


def fisher_sensitivity(policy, tok, prompts, problems, cfg, args, log):
    """Empirical Fisher per block: squared gradients of the policy-gradient loss (group-normalised
    advantages, token-level mean) on --fisher_batches RL batches -> (blocks,) normalised to mean
    1. Groups whose rewards are all equal carry no gradient, as in the loop."""
    layers = nm_linears(policy, COPY_SKIP)
    fisher = {k: torch.zeros_like(mod.weight, dtype=torch.float32) for k, mod in layers.items()}
    eng = Engine(policy, tok, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                 stop=[cfg.stop] if cfg.stop else [])
    rng, G = random.Random(args.seed), cfg.group_size
    policy.requires_grad_(True)
    for b in range(args.fisher_batches):
        pick = rng.sample(range(len(prompts)), args.fisher_prompts)
        with torch.no_grad():
            ro = eng.generate([prompts[i] for i in pick], G, seed=args.seed + b)
        rewards = score([problems[pick[int(i)]] for i in ro.prompt_index], ro.texts)
        adv, _ = group_advantages(torch.tensor(rewards, dtype=torch.float32), G)
        ids, tmask = build_batch([prompts[pick[int(i)]] for i in ro.prompt_index], ro.tokens,
                                 ro.mask, tok.pad_token_id)
        logp = token_logprobs(policy, ids, tmask)
        loss = -(adv[:, None] * logp * tmask).sum() / tmask.sum().clamp(min=1)
        policy.zero_grad(set_to_none=True)
        loss.backward()
        for k, mod in layers.items():
            fisher[k] += mod.weight.grad.float() ** 2 / args.fisher_batches
        log(f"fisher batch {b}: mean reward {sum(rewards) / len(rewards):.3f}")
    policy.zero_grad(set_to_none=True)
    policy.requires_grad_(False)
    prefixes = block_shapes(policy)[0]
    s = torch.tensor([sum(v.sum().item() for k, v in fisher.items() if k.startswith(p + "."))
                      for p in prefixes])
    if not s.sum() > 0:  # every group's rewards were equal: no signal, no tilt
        log("fisher: no gradient (every group's rewards were equal); sensitivities set to 1")
        return [1.0] * len(prefixes)
    return (s / s.mean()).clamp(min=1e-6).tolist()


class Evaluator:
    """Builds a setting's copy and measures it on its own prompts: `real` (rollouts from the copy,
    p5 of alpha per bin against the policy; cached, and counted in n_real) and `proxy` (the logit
    MSE on fixed policy samples, drawn at the first call). Each method gets its own Evaluator, so
    its count is its own and it never reads another method's measurements."""

    def __init__(self, policy, tok, prompts, cfg, args, prefixes, seed, name=""):
        self.policy, self.tok, self.cfg, self.args, self.prefixes = policy, tok, cfg, args, prefixes
        self.prompts, self.seed, self.name, self.n_real, self.n_proxy = prompts, seed, name, 0, 0
        self.cache, self.ref, self.path = {}, None, os.path.join(args.out_dir, "candidate.json")

    def engine(self, model, **kw):
        return Engine(model, self.tok, max_new_tokens=self.cfg.max_new_tokens, temperature=1.0,
                      stop=[self.cfg.stop] if self.cfg.stop else [], **kw)

    def copy(self, setting):
        return make_rollout_copy(self.policy, write_plan(self.path, self.prefixes, setting))

    @torch.no_grad()
    def proxy(self, setting):
        if self.ref is None:  # the proxy's fixed sequences: the policy's own samples
            prompts = self.prompts[:self.args.proxy_prompts]
            ro = self.engine(self.policy).generate(prompts, 2, seed=self.seed + 7)
            self.ids, self.tmask = build_batch([prompts[int(i)] for i in ro.prompt_index],
                                               ro.tokens, ro.mask, self.tok.pad_token_id)
            self.ref = self.policy(self.ids)[self.tmask].float()
        self.n_proxy += 1
        got = self.copy(setting)(self.ids)[self.tmask].float()
        return (got - self.ref).pow(2).mean().item()

    @torch.no_grad()
    def real(self, setting):
        """-> {"p5_bins": [...], "p5": min over counted bins, "mean": mean alpha}, cached."""
        key, a, prompts = tuple(setting), self.args, self.prompts
        if key not in self.cache:
            self.n_real += 1
            k = alpha_k(self.policy.config.vocab_size, self.cfg.alpha_topk)
            ro = self.engine(self.copy(setting), topk_logprobs=k).generate(prompts, a.eval_group,
                                                                            seed=self.seed)
            alpha = dense_alpha(self.policy, prompts, ro)
            plen = torch.tensor([len(prompts[int(i)]) for i in ro.prompt_index])
            st = bin_stats(alpha, ro.mask, plen, a.bin_tokens, n_bins=a.n_bins)
            p5 = st["p5"].where(st["count"] >= a.min_count, torch.full_like(st["p5"], math.nan))
            overall = alpha[ro.mask].quantile(0.05).item()  # an empty bin's p5: the overall
            bins = [overall if math.isnan(x) else x for x in p5.tolist()]
            self.cache[key] = dict(p5_bins=bins, p5=min(bins), mean=alpha[ro.mask].mean().item())
        return self.cache[key]


class Surrogate:
    """A small MLP: setting one-hots (blocks x (patterns + precisions)) -> p5 per bin, refitted
    from scratch on every real evaluation so far (the data set is a few dozen points)."""

    def __init__(self, n_blocks, n_bins, hidden=32, seed=0):
        self.n_blocks, self.n_bins, self.hidden, self.seed = n_blocks, n_bins, hidden, seed
        self.net, self.x, self.y = None, [], []

    def features(self, setting):
        v = torch.zeros(self.n_blocks, len(PATTERNS) + len(PRECISIONS))
        for b, (pat, prec) in enumerate(setting):
            v[b, PATTERNS.index(pat)] = v[b, len(PATTERNS) + PRECISIONS.index(prec)] = 1
        return v.flatten()

    def add(self, setting, p5_bins):
        self.x.append(self.features(setting))
        self.y.append(torch.tensor(p5_bins[:self.n_bins]))
        torch.manual_seed(self.seed + len(self.x))
        d = self.x[0].numel()
        self.net = nn.Sequential(nn.Linear(d, self.hidden), nn.Tanh(),
                                 nn.Linear(self.hidden, self.n_bins))
        opt = torch.optim.Adam(self.net.parameters(), lr=1e-2, weight_decay=1e-4)
        x, y = torch.stack(self.x), torch.stack(self.y)
        with torch.enable_grad():
            for _ in range(300):
                loss = (self.net(x) - y).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        return loss.item()

    @torch.no_grad()
    def predict(self, setting):
        return min(1.0, self.net(self.features(setting)).min().item())  # alpha <= 1


class BlockAgent:
    """One block's low-level agent: two softmax heads (pattern, precision), REINFORCE against a
    running baseline (advantages scaled by a running std), 20% uniform exploration. Settings over
    the block's share of the budget are masked out; if none fits, the cheapest is taken."""

    def __init__(self, lr=0.1, explore=0.2):
        self.logits = [torch.zeros(len(PATTERNS)), torch.zeros(len(PRECISIONS))]
        self.lr, self.explore, self.baseline, self.var, self.last = lr, explore, None, 1.0, None

    def act(self, cost_of, share, rng):
        """cost_of(pattern, precision) -> seconds; share: this block's seconds."""
        fits = torch.tensor([[cost_of(p, q) <= share for q in PRECISIONS] for p in PATTERNS])
        if not fits.any():
            flat = min(OPTIONS, key=lambda s: cost_of(*s))
            self.last = (PATTERNS.index(flat[0]), PRECISIONS.index(flat[1]))
            return flat
        flat = torch.rand(1, generator=rng).item() < self.explore  # uniform over what fits
        lp = (self.logits[0] * (not flat)).masked_fill(~fits.any(1), -1e9)
        i = int(torch.multinomial(lp.softmax(0), 1, generator=rng))
        lq = (self.logits[1] * (not flat)).masked_fill(~fits[i], -1e9)
        j = int(torch.multinomial(lq.softmax(0), 1, generator=rng))
        self.last = (i, j)
        return PATTERNS[i], PRECISIONS[j]

    def learn(self, reward):
        if self.baseline is None:
            self.baseline = reward
        adv = reward - self.baseline  # normalised by a running scale of the rewards
        self.baseline += 0.1 * adv
        self.var = 0.9 * self.var + 0.1 * adv * adv
        adv /= math.sqrt(self.var) + 1e-6
        for head, k in zip(self.logits, self.last):
            grad = -head.softmax(0)
            grad[k] += 1  # d log softmax_k / d logits
            head += self.lr * adv * grad


class Ensemble:
    """The high level: three bandits over the tilt arms (epsilon-greedy, UCB1, softmax); each
    proposes an arm, the majority wins (ties: the highest mean reward); all learn every reward."""

    def __init__(self, seed):
        self.rng, k = random.Random(seed), len(TILTS)
        self.n, self.mean, self.t = [[0] * k for _ in range(3)], [[0.0] * k for _ in range(3)], 0

    def vote(self):
        self.t += 1
        k, props = len(TILTS), []
        for a, (n, mean) in enumerate(zip(self.n, self.mean)):
            if 0 in n:
                props.append(n.index(0))
            elif a == 0:
                props.append(self.rng.randrange(k) if self.rng.random() < 0.2
                             else max(range(k), key=mean.__getitem__))
            elif a == 1:
                props.append(max(range(k), key=lambda i: mean[i]
                                 + 0.5 * math.sqrt(2 * math.log(self.t) / n[i])))
            else:
                w = [math.exp(mean[i] / 0.3) for i in range(k)]
                props.append(self.rng.choices(range(k), weights=w)[0])
        score_of = lambda i: (props.count(i), sum(m[i] for m in self.mean))
        return max(set(props), key=score_of), props

    def learn(self, arm, reward):
        for n, mean in zip(self.n, self.mean):
            n[arm] += 1
            mean[arm] += (reward - mean[arm]) / n[arm]


def split_budget(total, dense, sens, tilt):
    """The budget's seconds across blocks: share_b ~ dense_b * sens_b^tilt, then capped at the
    block's dense bf16 seconds with the excess handed to the uncapped blocks."""
    w = [d * s ** tilt for d, s in zip(dense, sens)]
    share, free = [0.0] * len(dense), list(range(len(dense)))
    left = total
    while free:
        tot = sum(w[b] for b in free)
        over = [b for b in free if left * w[b] / tot > dense[b]]
        if not over:
            for b in free:
                share[b] = left * w[b] / tot
            break
        for b in over:
            share[b], left = dense[b], left - dense[b]
            free.remove(b)
    return share


def cheapest(cost):
    """The setting with the fewest seconds for every block (the far end of the search space)."""
    return min(OPTIONS, key=lambda s: cost.block(0, *s))


def search(ev, sens, cost, budget, args, log):
    """One hierarchical search at `budget` (a share of the dense bf16 copy's seconds) -> (the
    fastest setting measured to meet the threshold within the budget, or None; counts)."""
    B, thr = len(cost.shapes), args.threshold
    agents, high = [BlockAgent(args.agent_lr) for _ in range(B)], Ensemble(args.seed)
    sur, rng = Surrogate(B, args.n_bins, seed=args.seed), torch.Generator().manual_seed(args.seed)
    fit, counts, best, seen = [], dict(real=0, surrogate=0, proxy=0), None, {}

    def real(setting):
        r = ev.real(setting)
        counts["real"] += 1
        fit.append((math.sqrt(ev.proxy(setting)), r["p5"]))
        sur.add(setting, r["p5_bins"])
        return r

    for anchor in ([("dense", "bf16")] * B, [cheapest(cost)] * B):  # the cold start's two anchors
        real(anchor)
    for ep in range(args.episodes):
        arm, props = high.vote()
        share = split_budget(budget * cost.dense - cost.head, cost.dense_blocks, sens, TILTS[arm])
        setting, carry = [None] * B, 0.0
        for b in sorted(range(B), key=sens.__getitem__):  # least sensitive first: what a block
            setting[b] = agents[b].act(lambda p, q, b=b: cost.block(b, p, q), share[b] + carry,
                                       rng)  # leaves unspent goes to the more sensitive ones
            carry += share[b] - cost.block(b, *setting[b])
        key, speed = tuple(setting), cost.speed(setting)
        if key in ev.cache:
            p5, src = ev.cache[key]["p5"], "real"
        elif len(sur.x) >= args.cold_start:
            p5, src = sur.predict(setting), "surrogate"
        else:  # the logit-MSE proxy, through p5 ~ 1 - a * sqrt(mse) fitted on the real points
            a = sum(x * (1 - y) for x, y in fit) / max(sum(x * x for x, _ in fit), 1e-12)
            p5, src = 1 - a * math.sqrt(ev.proxy(setting)), "proxy"
        counts[src] += src != "real"
        within = cost.within(setting, budget)
        promising = p5 >= thr and within and (best is None or speed > best[0])
        # the surrogate's data: every --cold_every episodes in the cold start, then --real_every
        due = ep % (args.cold_every if len(sur.x) < args.cold_start else args.real_every) == 0
        if src != "real" and (promising or due) and counts["real"] < args.max_real:
            p5, src = real(setting)["p5"], "real"
        if src == "real" and p5 >= thr and within and (best is None or speed > best[0]):
            best = (speed, setting)
        # a setting predicted to miss the threshold earns no speed, and loses with its shortfall
        reward = (speed if p5 >= thr else 0.0) - args.penalty * max(0.0, thr - p5)
        for agent in agents:
            agent.learn(reward)
        high.learn(arm, reward)
        if src != "real":
            seen[key] = p5
        if ep % 10 == 0 or src == "real":
            log(f"  ep {ep:3d} tilt {TILTS[arm]} (votes {props}) {fmt(setting)}: speed "
                f"{speed:.2f}x, p5 {p5:.3f} ({src}), best "
                f"{'none' if best is None else f'{best[0]:.2f}x'}")
    # what is left of the real budget: the fastest settings seen whose last prediction met the
    # threshold (the surrogate's screen), fastest first
    for key in sorted(seen, key=lambda k: -cost.speed(list(k))):
        speed = cost.speed(list(key))
        if counts["real"] >= args.max_real or (best is not None and speed <= best[0]):
            break
        if key not in ev.cache and seen[key] >= thr and cost.within(list(key), budget):
            p5 = real(list(key))["p5"]
            log(f"  screen {fmt(key)}: speed {speed:.2f}x, p5 {p5:.3f} (real)")
            if p5 >= thr:
                best = (speed, list(key))
    return choose(ev.cache, cost, budget, thr), counts


def fmt(setting):
    return " ".join(f"{p}/{q}" for p, q in setting)


def choose(cache, cost, budget, thr):
    """The choice rule every method shares: of the settings the method measured for real (its own
    cache), the fastest within the budget whose p5 met the threshold; None if none did."""
    ok = [list(k) for k, r in cache.items() if r["p5"] >= thr and cost.within(list(k), budget)]
    return max(ok, key=cost.speed, default=None)


def uniform_sweep(ev, cost, log):
    """Every uniform setting (one pattern and precision for every block), evaluated for real."""
    for s in ([o] * len(cost.shapes) for o in OPTIONS):
        log(f"  uniform {fmt(s[:1])}: speed {cost.speed(s):.2f}x, p5 {ev.real(s)['p5']:.3f}")


def random_setting(cost, budget, rng):
    """Blocks in a random order, each uniform over its settings that leave the blocks still to come
    room for their cheapest: a setting within the budget (if the all-cheapest one is)."""
    B = len(cost.shapes)
    floor = [min(cost.block(b, *o) for o in OPTIONS) for b in range(B)]
    left, order, setting = budget * cost.dense - cost.head, rng.sample(range(B), B), [None] * B
    for k, b in enumerate(order):
        room = (left - sum(floor[c] for c in order[k + 1:])) * (1 + 1e-9)
        setting[b] = rng.choice([o for o in OPTIONS if cost.block(b, *o) <= room] or
                                [min(OPTIONS, key=lambda o: cost.block(b, *o))])
        left -= cost.block(b, *setting[b])
    return setting


def random_baseline(ev, cost, budget, n, args, log):
    """The random-search baseline: n distinct random settings within the budget, each evaluated for
    real (ev: this method's own Evaluator) -> the shared choice rule's pick, or None."""
    rng = random.Random(args.seed + 99)
    tries = 100 * n + 100  # distinct settings; a tight budget may hold fewer than n
    while len(ev.cache) < n and tries:
        s, tries = random_setting(cost, budget, rng), tries - 1
        if tuple(s) not in ev.cache:
            log(f"  random {fmt(s)}: speed {cost.speed(s):.2f}x, p5 {ev.real(s)['p5']:.3f}")
    return choose(ev.cache, cost, budget, args.threshold)


def compare(make_ev, sens, cost, args, log):
    """One seed. make_ev(name) -> a fresh Evaluator: one per budget for the search and the random
    baseline, one for the uniform sweep -> {(budget, method): dict(setting, p5, evaluator, ...)}."""
    uni, out = make_ev("uniform"), {}
    uniform_sweep(uni, cost, log)
    for budget in args.budgets:
        log(f"seed {args.seed}, budget {budget} of the dense bf16 copy's seconds")
        ev, rnd = make_ev("search"), make_ev("random")
        best, counts = search(ev, sens, cost, budget, args, log)
        picks = (("searched", best, ev, counts),  # random: as many real evaluations as the search
                 ("random", random_baseline(rnd, cost, budget, ev.n_real, args, log), rnd, {}),
                 ("best uniform", choose(uni.cache, cost, budget, args.threshold), uni, {}))
        for name, setting, e, cnt in picks:
            out[budget, name] = dict(setting=setting, real=e.n_real, surrogate=cnt.get(
                "surrogate", 0), proxy=cnt.get("proxy", 0), evaluator=e,
                p5=None if setting is None else e.cache[tuple(setting)]["p5"])
    return out


def run(policy, tok, cfg, problems, prompts, args, log=print):
    """Every method at every budget, per seed; each plan measured again on the held-out prompts (the
    first --final_prompts; the search pool is the rest) -> the table's lines."""
    os.makedirs(args.out_dir, exist_ok=True)
    for f in os.listdir(args.out_dir):  # a plan from an earlier run must not pass for this one's
        if f.startswith(("plan", "uniform", "random")) and f.endswith(".json"):
            os.remove(os.path.join(args.out_dir, f))
    t0, (prefixes, shapes, head) = time.time(), block_shapes(policy)
    cost, B = CostModel(shapes, head, args.rows), len(shapes)
    if min(args.budgets) < 1 / cost.speed([cheapest(cost)] * B):
        raise ValueError(f"--budgets: {min(args.budgets)} is below the cheapest copy's seconds")
    if len(prompts) < args.final_prompts + args.eval_prompts:
        raise ValueError(f"{len(prompts)} prompts: --final_prompts + --eval_prompts need more")
    held, pool, seeds = prompts[:args.final_prompts], range(args.final_prompts, len(prompts)), []
    for seed in args.seeds:
        a = argparse.Namespace(**{**vars(args), "seed": seed})
        search_p = [prompts[i] for i in random.Random(seed).sample(pool, args.eval_prompts)]
        sens = fisher_sensitivity(policy, tok, [prompts[i] for i in pool],
                                  [problems[i] for i in pool], cfg, a, log)
        log(f"seed {seed}: Fisher sensitivity per block (mean 1): "
            f"{' '.join(f'{s:.2f}' for s in sens)}")
        res = {("-", "dense bf16"): dict(setting=[("dense", "bf16")] * B, p5=None, real=0,
                                         surrogate=0, proxy=0)}
        res.update(compare(lambda name: Evaluator(policy, tok, search_p, cfg, a, prefixes, seed,
                                                  name), sens, cost, a, log))
        ho = Evaluator(policy, tok, held, cfg, a, prefixes, seed + 1000, "held-out")
        for (budget, name), r in res.items():
            if r["setting"] is not None:
                r["held"] = ho.real(r["setting"])
                r["speed"] = cost.speed(r["setting"])
                if budget != "-":
                    write_plans(args, prefixes, budget, name, seed, r)
        seeds.append(res)
    log(f"search done in {time.time() - t0:.0f} s")
    return table(seeds, args, len(held))


def write_plans(args, prefixes, budget, name, seed, r):
    """{plan,random,uniform}-<budget>-s<seed>.json; {plan,random,uniform}.json: the first ones."""
    stem = dict(searched="plan", random="random").get(name, "uniform")
    meta = dict(search=dict(budget=budget, seed=seed, speed=r["speed"], p5_search=r["p5"],
                            p5_heldout=r["held"]["p5"], mean_alpha_heldout=r["held"]["mean"],
                            threshold=args.threshold, **{k: r[k] for k in COUNTS}))
    first = seed == args.seeds[0] and budget == args.budgets[0]
    for n in [f"{stem}-{budget:g}-s{seed}"] + [stem] * first:
        write_plan(os.path.join(args.out_dir, n + ".json"), prefixes, r["setting"], meta)


def mean_sd(xs, spec, unit=""):
    m = sum(xs) / max(len(xs), 1)
    sd = f" ± {statistics.stdev(xs):{spec}}{unit}" if len(xs) > 1 else ""
    return f"{m:{spec}}{unit}{sd}" if xs else "-"


def md(*rows):
    return ["| " + " | ".join(map(str, r)) + " |" for r in rows]


COUNTS = ("real", "surrogate", "proxy")
SPEED = "speed (cost model, H200 datasheet rates)"
COLS = ("budget", "copy", "plans (seeds)", SPEED, "p5 alpha, search prompts", "p5 alpha, held-out",
        "mean alpha, held-out", "meets on held-out (seeds)", "real evals", "surrogate preds",
        "proxy preds")
SEED_COLS = ("budget", "copy", "seed", "setting per block (pattern/precision)", SPEED,
             "p5 alpha, search prompts", "p5 alpha, held-out", "real evals")


def table(seeds, args, n_held):
    """The summary (mean ± sd over the seeds that found a plan), then each seed's plan."""
    lines = [f"Hardware: {hardware()}. Threshold: p5 alpha >= {args.threshold} in every bin of "
             f"{args.bin_tokens} tokens. Seeds {','.join(map(str, args.seeds))}: mean ± sd over "
             f"the seeds that found a plan. Prompts: {args.eval_prompts} per seed for the search, "
             f"{n_held} held out (no method's search saw them), x {args.eval_group} rollouts. Real "
             "evals: each method's own (one uniform sweep serves every budget). Every speed is the "
             f"roofline cost model's at {args.rows} rows (H200 datasheet rates), over dense bf16; "
             "none is measured.", ""] + md(
                 COLS, ["---"] * len(COLS))
    per = md(SEED_COLS, ["---"] * len(SEED_COLS))
    for key in seeds[0]:
        rs = [s[key] for s in seeds]
        got = [r for r in rs if r["setting"] is not None]
        tag = key[0] if key[0] == "-" else f"{key[0]:g}"
        p5s = [r["p5"] for r in got if r["p5"] is not None]
        lines += md([tag, key[1], f"{len(got)}/{len(rs)}",
                     mean_sd([r["speed"] for r in got], ".2f", "x"), mean_sd(p5s, ".3f"),
                     mean_sd([r["held"]["p5"] for r in got], ".3f"),
                     mean_sd([r["held"]["mean"] for r in got], ".3f"),
                     f"{sum(r['held']['p5'] >= args.threshold for r in got)}/{len(rs)}"]
                    + [mean_sd([r[k] for r in rs], ".1f") for k in COUNTS])
        per += md(*[[tag, key[1], seed, "none met the threshold within the budget", "", "", "",
                     r["real"]] if r["setting"] is None else
                    [tag, key[1], seed, fmt(r["setting"]), f"{r['speed']:.2f}x",
                     "-" if r["p5"] is None else f"{r['p5']:.3f}", f"{r['held']['p5']:.3f}",
                     r["real"]] for seed, r in zip(args.seeds, rs) if key[0] != "-"])
    return lines + [""] + per


def seed_list(s):
    seeds = [int(x) for x in s.split(",") if x.strip()]
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds {s!r}: distinct integers, comma-separated")
    return seeds


def parse_args(argv):
    p = argparse.ArgumentParser(prog="examples/hirelc.py", description=__doc__.split("\n")[1])
    p.add_argument("--out_dir", default="out/hirelc")
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.55, 0.45], help="shares of the dense bf16 copy's seconds")
    p.add_argument("--threshold", type=float, default=0.86)
    p.add_argument("--episodes", type=int, default=300)
    p.add_argument("--max_real", type=int, default=16, help="real evaluations per search")
    p.add_argument("--cold_start", type=int, default=6, help="real points before the surrogate")
    p.add_argument("--cold_every", type=int, default=3, help="cold start: real every k episodes")
    p.add_argument("--real_every", type=int, default=15, help="then: real every k episodes")
    p.add_argument("--penalty", type=float, default=10.0, help="reward per unit of p5 shortfall")
    p.add_argument("--agent_lr", type=float, default=0.1)
    p.add_argument("--rows", type=int, default=128, help="decode rows for the cost model")
    for k, v in dict(eval_prompts=32, eval_group=4, final_prompts=64, proxy_prompts=16,
                     bin_tokens=64, n_bins=2, min_count=100, fisher_batches=3,
                     fisher_prompts=16, threads=1).items():
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--seeds", type=seed_list, default=[0, 1, 2],
                   help="every method runs once per seed; the table gives mean ± sd")
    p.add_argument("--write-results", action="store_true",
                   help="rewrite bench/RESULTS.md's hirelc block")
    args, rest = p.parse_known_args(argv)
    if min(args.budgets) <= 0 or min(args.final_prompts, args.eval_prompts, args.max_real) < 1:
        p.error("--budgets must be positive; --final_prompts, --eval_prompts, --max_real >= 1")
    args.seed = args.seeds[0]  # the seed in use; run() sets each in turn
    return args, rest  # the rest: a config file and --key=value overrides, as train.py takes


def main(argv):
    args, rest = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (rest and rest[0].endswith(".py")):  # the workload its published figures are on
        rest = ["configs/sharpen.py"] + rest
    cfg = parse_config(rest + [f"--out_dir={args.out_dir}"])
    policy, tok = build_policy(cfg, "cpu", print)
    policy.eval().requires_grad_(False)
    problems, _ = load_problems(cfg)
    problems, prompts = encode_pool(tok, problems[:2000], cfg,
                                    policy.config.max_position_embeddings)
    lines = run(policy, tok, cfg, problems, prompts, args)
    lines[0] += f" Command: `python examples/hirelc.py {' '.join(argv)}`."
    table = "\n".join(lines)
    print("\n" + table)
    with open(os.path.join(args.out_dir, "hirelc.md"), "w") as f:
        f.write(table + "\n")
    if args.write_results:
        from bench.common import write_block
        print("bench/RESULTS.md: " + ("rewrote the hirelc block" if write_block("hirelc", table)
                                      else "no hirelc block: printed only"))


if __name__ == "__main__":
    main(sys.argv[1:])
