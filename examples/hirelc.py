"""
examples/hirelc.py: a HiReLC-style search for the rollout copy's compression, block by block. Each
decoder block of the policy gets an N:M pattern (or dense) and a precision (bf16, fp8, int8); the
search looks for the copy that the cost model says is fastest while the per-position mismatch
against the policy keeps its tail: p5 of alpha = 1 - TV, per bin of cached length, at or above the
threshold (0.86). The result is a plan file that train.py loads as a rollout copy.

    python examples/hirelc.py --out_dir=out/hirelc --threads=1     # the search and the uniform
        # baseline at each budget; writes out/hirelc/plan.json (the searched copy at the first
        # budget), out/hirelc/uniform.json (the best uniform setting there) and the table
    python examples/hirelc.py --out_dir=out/hirelc --threads=1 --write-results   # and the table
        # into bench/RESULTS.md's hirelc block
    python train.py configs/sharpen.py --rollout_copy=out/hirelc/plan.json --is_correction=tis --threads=1 \\
        --out_dir=out/hirelc/rl-plan                               # RL with the searched copy
    python -m pytest -q tests/test_hirelc.py                       # a two-block smoke search

What one search does, top to bottom:
    1. The policy: configs/sharpen.py's warm start (warmstart.build_policy; cached under
       out/warmstart-cache), or any config's policy (a config file as the first argument).
    2. Sensitivity: the empirical Fisher information, the squared gradients of the trainer's
       policy-gradient loss (group advantages, as update.py) on RL batches that the policy samples
       and reward.score scores, summed per block and normalised to mean 1.
    3. The cost model (`copy_seconds`): per decoded token at a batch of rollout rows, each Linear
       takes max(bytes / bandwidth, FLOPs / FLOP rate) (a roofline with an H200's datasheet rates);
       N:M stores n/m of the values plus ceil(log2 m) index bits each, fp8 and int8 one byte plus
       an fp32 scale per row; only 2:4 doubles the FLOP rate (sparse tensor cores). Speed = the
       dense bf16 copy's seconds over the copy's. The budget is a share of the dense bf16 copy's
       seconds.
    4. Each episode: a high-level ensemble (three bandits over how strongly the sensitivities tilt
       the split: epsilon-greedy, UCB, softmax) votes on the split of the budget across blocks
       (a sensitive block gets more of it); then one low-level agent per block (a softmax policy
       over a multi-discrete action: pattern x precision, REINFORCE with a baseline) picks its
       block's setting within the block's share, least sensitive block first; what a block leaves
       of its share passes on to the next.
    5. The setting's p5 is predicted: by the logit-MSE proxy during the cold start (the mean
       squared logit gap to the policy on fixed policy samples, mapped to p5 by a one-parameter fit
       p5 ~ 1 - a * sqrt(mse) through the real evaluations so far), then by a small MLP surrogate
       (setting one-hots -> p5 per bin) refitted after every real evaluation. Reward = speed if
       the predicted p5 meets the threshold (else 0) - penalty * max(0, threshold - predicted p5):
       the surrogate shapes the reward.
    6. A setting is evaluated for real (rollouts from the copy, Sparrow's per-position alpha against
       the policy's dense forward, p5 per bin) when it is predicted to meet the threshold and would
       beat the fastest setting measured to meet it, and during the cold start every --cold_every
       episodes (the surrogate's first data; the two anchors, all-dense bf16 and the cheapest
       setting, come first), up to --max_real evaluations; its real p5 then replaces the
       prediction in the reward.
    7. After the episodes, what is left of --max_real goes to the fastest settings seen whose
       last prediction met the threshold, fastest first (the surrogate as a screen).
    8. The choice: the fastest setting whose real p5 met the threshold, within the budget, is
       measured again on fresh prompts (the number reported), and so is the uniform baseline: every
       uniform setting (one pattern and precision for all blocks) is evaluated for real, and the
       best one within the budget is the fastest that meets the threshold (else the one with the
       highest p5).

Simplifications:
    1. A block is a decoder layer: all its Linears share one setting. The head, the embeddings and
       the MoE router stay bf16 and dense (copies.COPY_SKIP). The high level splits the budget by
       a tilt exponent (share ~ dense seconds * sensitivity^tilt), not by free-form shares.
    2. The low-level agents are per-block softmax policies trained by REINFORCE (a contextual
       bandit per block, one step per episode), not HiReLC's deep RL agents; the high-level agents
       are bandits.
    3. HiReLC's bit widths (2 to 8) and keep ratios are replaced by the three precisions that the
       copies implement and a few N:M patterns; int8 is simulated (copies.Int8Linear).
    4. The cost model counts weight traffic and matmul FLOPs of one decode step; the KV cache,
       attention and per-op overheads are the same for every copy and left out. N:M other than 2:4
       assumes a kernel that reads compressed values; 2:4 is the one with tensor-core support.
    5. Fisher uses whole-batch squared gradients (a few RL batches), the usual empirical stand-in.
    6. One seed; the mismatch is measured on a few dozen rollouts (--eval_prompts x --eval_group),
       bins of --bin_tokens tokens of cached length; a bin with fewer than --min_count tokens is
       ignored.
"""

import argparse
import json
import math
import os
import random
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
VALUE_BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0}
# an H200's datasheet: HBM3e 4.8 TB/s; dense tensor-core bf16 989 TFLOP/s, fp8 and int8 1,979
BANDWIDTH = 4.8e12
FLOP_RATE = {"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12}
TILTS = (0.0, 0.1, 0.25, 0.5, 1.0)  # the high level's arms: share ~ dense s * sensitivity^tilt


# ------------------------------------------------------------------------------- the cost model


def nm_of(pattern):
    return (0, 0) if pattern == "dense" else tuple(int(x) for x in pattern.split(":"))


def linear_seconds(out_f, in_f, pattern, precision, rows):
    """One Linear's time per decode step of `rows` tokens: max(bytes / BW, FLOPs / rate)."""
    n, m = nm_of(pattern)
    keep, index_bits = (n / m, math.ceil(math.log2(m))) if n else (1.0, 0)
    nbytes = out_f * in_f * keep * (VALUE_BYTES[precision] + index_bits / 8)
    nbytes += 4 * out_f if precision != "bf16" else 0  # per-row scales
    flops = 2 * rows * out_f * in_f / (2 if (n, m) == (2, 4) else 1)
    return max(nbytes / BANDWIDTH, flops / FLOP_RATE[precision])


def copy_seconds(shapes, setting, rows, fixed):
    """shapes: per block, the (out, in) of its Linears; setting: per block (pattern, precision);
    fixed: the seconds of what stays bf16 and dense (the head)."""
    return fixed + sum(linear_seconds(o, i, *s, rows) for blk, s in zip(shapes, setting)
                       for o, i in blk)


# ------------------------------------------------------------------------- the model's pieces


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


# ------------------------------------------------------------------ measuring a copy for real


class Evaluator:
    """Builds a setting's copy and measures it: `real` (rollouts from the copy, p5 of alpha per
    bin against the policy) and `proxy` (the logit MSE on fixed policy samples). Counts both."""

    def __init__(self, policy, tok, prompts, cfg, args, prefixes):
        self.policy, self.tok, self.cfg, self.args, self.prefixes = policy, tok, cfg, args, prefixes
        self.prompts, self.n_real, self.n_proxy, self.cache = prompts, 0, 0, {}
        self.path = os.path.join(args.out_dir, "candidate.json")
        eng = Engine(policy, tok, max_new_tokens=cfg.max_new_tokens, temperature=1.0,
                     stop=[cfg.stop] if cfg.stop else [])
        with torch.no_grad():  # the proxy's fixed sequences: the policy's own samples
            ro = eng.generate(prompts[:args.proxy_prompts], 2, seed=args.seed + 7)
        self.ids, self.tmask = build_batch([prompts[int(i)] for i in ro.prompt_index], ro.tokens,
                                           ro.mask, tok.pad_token_id)
        with torch.no_grad():
            self.ref = policy(self.ids)[self.tmask].float()

    def copy(self, setting):
        return make_rollout_copy(self.policy, write_plan(self.path, self.prefixes, setting))

    @torch.no_grad()
    def proxy(self, setting):
        self.n_proxy += 1
        got = self.copy(setting)(self.ids)[self.tmask].float()
        return (got - self.ref).pow(2).mean().item()

    @torch.no_grad()
    def measure(self, copy, prompts, seed):
        """-> {"p5_bins": [...], "p5": min over counted bins, "mean": mean alpha}."""
        a, cfg = self.args, self.cfg
        eng = Engine(copy, self.tok, max_new_tokens=cfg.max_new_tokens, temperature=1.0,
                     stop=[cfg.stop] if cfg.stop else [],
                     topk_logprobs=alpha_k(self.policy.config.vocab_size, cfg.alpha_topk))
        ro = eng.generate(prompts, a.eval_group, seed=seed)
        alpha = dense_alpha(self.policy, prompts, ro)
        plen = torch.tensor([len(prompts[int(i)]) for i in ro.prompt_index])
        st = bin_stats(alpha, ro.mask, plen, a.bin_tokens, n_bins=a.n_bins)
        ok = st["count"] >= a.min_count
        p5 = st["p5"].where(ok, torch.full_like(st["p5"], float("nan")))
        overall = alpha[ro.mask].quantile(0.05).item()
        bins = [overall if math.isnan(x) else x for x in p5.tolist()]  # an empty bin: the overall
        return dict(p5_bins=bins, p5=min(bins), mean=alpha[ro.mask].mean().item())

    def real(self, setting):
        key = tuple(setting)
        if key not in self.cache:
            self.n_real += 1
            self.cache[key] = self.measure(self.copy(setting), self.prompts, self.args.seed)
        return self.cache[key]


# ------------------------------------------------------------- the surrogate and the agents


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
    """One block's low-level agent: two softmax heads (pattern, precision), a multi-discrete action,
    trained by REINFORCE against a running baseline (advantages scaled by a running std), with
    20% uniform exploration. Settings whose seconds exceed the block's share of the budget are
    masked out; if none fits, the cheapest is taken."""

    def __init__(self, lr=0.1, explore=0.2):
        self.logits = [torch.zeros(len(PATTERNS)), torch.zeros(len(PRECISIONS))]
        self.lr, self.explore, self.baseline, self.var, self.last = lr, explore, None, 1.0, None

    def act(self, cost_of, share, rng):
        """cost_of(pattern, precision) -> seconds; share: this block's seconds."""
        fits = torch.tensor([[cost_of(p, q) <= share for q in PRECISIONS] for p in PATTERNS])
        if not fits.any():
            flat = min(((p, q) for p in PATTERNS for q in PRECISIONS), key=lambda s: cost_of(*s))
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
    proposes an arm, the majority wins (ties: the highest mean reward). All learn from the
    episode's reward."""

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


# ---------------------------------------------------------------------------------- the search


class CostModel:
    """Seconds per decode step of the whole copy and of one block, at --rows rollout rows."""

    def __init__(self, shapes, head, rows):
        self.shapes, self.rows = shapes, rows
        self.head = linear_seconds(*head, "dense", "bf16", rows)
        self.dense_blocks = [self.block(b, "dense", "bf16") for b in range(len(shapes))]
        self.dense = self.head + sum(self.dense_blocks)

    def block(self, b, pattern, precision):
        return sum(linear_seconds(o, i, pattern, precision, self.rows) for o, i in self.shapes[b])

    def speed(self, setting):
        return self.dense / copy_seconds(self.shapes, setting, self.rows, self.head)

    def within(self, setting, budget):
        return 1 / self.speed(setting) <= budget * (1 + 1e-9)


def cheapest(cost):
    """The setting with the fewest seconds for every block (the far end of the search space)."""
    return min(((p, q) for p in PATTERNS for q in PRECISIONS), key=lambda s: cost.block(0, *s))


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
        # the surrogate's data: every --cold_every episodes in the cold start, every --real_every
        # after it
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
    return (None if best is None else best[1]), counts


def fmt(setting):
    return " ".join(f"{p}/{q}" for p, q in setting)


def uniform_baseline(ev, cost, B, log):
    """Every uniform setting, evaluated for real -> [(setting, speed, p5)]."""
    out = []
    for p in PATTERNS:
        for q in PRECISIONS:
            s = [(p, q)] * B
            out.append((s, cost.speed(s), ev.real(s)["p5"]))
            log(f"  uniform {p}/{q}: speed {out[-1][1]:.2f}x, p5 {out[-1][2]:.3f}")
    return out


def best_uniform(uniform, cost, budget, thr):
    """The fastest uniform setting within the budget that meets the threshold; else, within the
    budget, the one with the highest p5; None if no uniform setting fits the budget."""
    fits = [u for u in uniform if cost.within(u[0], budget)]
    ok = [u for u in fits if u[2] >= thr]
    if ok:
        return max(ok, key=lambda u: u[1])[0]
    return max(fits, key=lambda u: u[2])[0] if fits else None


# ------------------------------------------------------------------------------- the command


def final_row(ev, cost, name, setting, counts, prompts, args):
    """Measure `setting` again on fresh prompts (the figure reported) -> a table row."""
    r = ev.measure(ev.copy(setting), prompts, args.seed + 1000)
    ok = "yes" if r["p5"] >= args.threshold else "no"
    return (f"| {name} | {fmt(setting)} | {cost.speed(setting):.2f}x | {r['p5']:.3f} | "
            f"{r['mean']:.3f} | {ok} | {counts['real']} | {counts['surrogate']} | "
            f"{counts['proxy']} |"), r


def run(policy, tok, cfg, problems, prompts, args, log=print):
    """The search at every budget and the uniform baseline -> the table's lines; the plans are
    written to args.out_dir (plan-<budget>.json, uniform-<budget>.json; plan.json and uniform.json
    for the first budget)."""
    os.makedirs(args.out_dir, exist_ok=True)
    for f in os.listdir(args.out_dir):  # a plan from an earlier run must not pass for this one's
        if f.startswith(("plan", "uniform")) and f.endswith(".json"):
            os.remove(os.path.join(args.out_dir, f))
    t0 = time.time()
    prefixes, shapes, head = block_shapes(policy)
    cost = CostModel(shapes, head, args.rows)
    search_p, fresh = prompts[:args.eval_prompts], prompts[args.eval_prompts:][:args.final_prompts]
    sens = fisher_sensitivity(policy, tok, prompts, problems, cfg, args, log)
    log(f"Fisher sensitivity per block (mean 1): {' '.join(f'{s:.2f}' for s in sens)}")
    ev = Evaluator(policy, tok, search_p, cfg, args, prefixes)
    uniform = uniform_baseline(ev, cost, len(shapes), log)
    n_uniform = ev.n_real
    lines = [f"Hardware: {hardware()}. Threshold: p5 alpha >= {args.threshold} in every bin of "
             f"{args.bin_tokens} tokens; mismatch measured on {len(fresh)} fresh prompts x "
             f"{args.eval_group} rollouts. Speed: the roofline cost model at {args.rows} rows "
             f"(H200 datasheet rates), over the dense bf16 copy.", "",
             "| budget | copy | setting per block (pattern/precision) | cost-model speed | "
             "p5 alpha | mean alpha | meets | real evals | surrogate preds | proxy preds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    dense_row, _ = final_row(ev, cost, "dense bf16", [("dense", "bf16")] * len(shapes),
                             dict(real=0, surrogate=0, proxy=0), fresh, args)
    lines.append("| - " + dense_row)
    for i, budget in enumerate(args.budgets):
        log(f"search at budget {budget} of the dense bf16 copy's seconds")
        best, counts = search(ev, sens, cost, budget, args, log)
        uni = best_uniform(uniform, cost, budget, args.threshold)
        tag = f"{budget:g}"
        for name, setting, cnt in (("searched", best, counts),
                                   ("best uniform", uni, dict(real=n_uniform, surrogate=0,
                                                              proxy=0))):
            if setting is None:
                lines.append(f"| {tag} | {name} | none met the threshold within the budget | | | "
                             f"| | no | {cnt['real']} | {cnt['surrogate']} | {cnt['proxy']} |")
                continue
            row, r = final_row(ev, cost, name, setting, cnt, fresh, args)
            lines.append(f"| {tag} " + row)
            stem = "plan" if name == "searched" else "uniform"
            meta = dict(search=dict(budget=budget, speed=cost.speed(setting), p5=r["p5"],
                                    mean_alpha=r["mean"], threshold=args.threshold, **cnt))
            write_plan(os.path.join(args.out_dir, f"{stem}-{tag}.json"), prefixes, setting, meta)
            if i == 0:
                write_plan(os.path.join(args.out_dir, f"{stem}.json"), prefixes, setting, meta)
    log(f"search done in {time.time() - t0:.0f} s")
    return lines


def parse_args(argv):
    p = argparse.ArgumentParser(prog="examples/hirelc.py", description=__doc__.split("\n")[1])
    p.add_argument("--out_dir", default="out/hirelc")
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.55, 0.45], help="shares of the dense bf16 copy's seconds")
    p.add_argument("--threshold", type=float, default=0.86)
    p.add_argument("--episodes", type=int, default=300)
    p.add_argument("--max_real", type=int, default=16, help="real evaluations per search")
    p.add_argument("--cold_start", type=int, default=6,
                   help="real points before the surrogate takes over from the proxy")
    p.add_argument("--cold_every", type=int, default=3,
                   help="during the cold start, every this many episodes is evaluated for real")
    p.add_argument("--real_every", type=int, default=15,
                   help="after the cold start, every this many episodes is evaluated for real")
    p.add_argument("--penalty", type=float, default=10.0, help="reward per unit of p5 shortfall")
    p.add_argument("--agent_lr", type=float, default=0.1)
    p.add_argument("--rows", type=int, default=128, help="decode rows for the cost model")
    p.add_argument("--eval_prompts", type=int, default=32)
    p.add_argument("--eval_group", type=int, default=4)
    p.add_argument("--final_prompts", type=int, default=64)
    p.add_argument("--proxy_prompts", type=int, default=16)
    p.add_argument("--bin_tokens", type=int, default=64)
    p.add_argument("--n_bins", type=int, default=2)
    p.add_argument("--min_count", type=int, default=100)
    p.add_argument("--fisher_batches", type=int, default=3)
    p.add_argument("--fisher_prompts", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write-results", action="store_true",
                   help="rewrite bench/RESULTS.md's hirelc block")
    args, rest = p.parse_known_args(argv)
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
    cmd = "python examples/hirelc.py " + " ".join(argv)
    lines[0] += f" Command: `{cmd}`."
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
