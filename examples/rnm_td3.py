"""
examples/rnm_td3.py: TD3 trained from scratch with row-wise N:M sparse networks (RNM-TD3). In the
actor, the twin critics and their three target networks, every layer keeps, in each output row, at
most n nonzero weights in each group of m consecutive inputs, from the first step to the last; the
masks are updated every --mask_every steps (prune and regrow inside each group), and only the
active weights are ever updated. Dense TD3 is the same code with no masks.

    python examples/rnm_td3.py --sparsity=2:4 --seed=0 --steps=30000   # one run, Pendulum-v1
    python examples/rnm_td3.py --sparsity=1:4 --mask_every=0           # a fixed mask
    python examples/rnm_td3.py --compare       # dense, 2:4, 1:4, 1:8 x seeds 0, 1, 2 on Pendulum
    python examples/rnm_td3.py --compare --env=Hopper-v5 --steps=60000 --start_steps=10000 \
        --eval_every=5000 --final_evals=3      # MuJoCo: `pip install "gymnasium[mujoco]"` first
    python -m pytest -q tests/test_rnm_td3.py  # the mask rule and invariants, in seconds

What a run does, top to bottom:
    1. Builds the six networks (actor, critic 1, critic 2 and a target copy of each), MLPs of two
       hidden layers. With --sparsity=n:m every Linear, the first included (Simplification 2),
       gets an N:M mask by magnitude and its pruned weights are zeroed; each target is copied
       from its online network after that, so it starts with the same zeros and shares its mask.
    2. Acts at random for --start_steps steps, then with the actor plus Gaussian noise, storing
       every transition in a replay buffer.
    3. Each step after that, one TD3 update on a batch from the buffer: both critics regress onto
       r + gamma * min(Q1', Q2')(s', clip(actor'(s') + clipped noise)); every --policy_delay
       steps the actor ascends Q1(s, actor(s)) and the targets move by Polyak averaging. On a
       multiple of --mask_every, that update also updates the masks (below).
    4. Every --eval_every steps, the mean return of --eval_episodes noise-free episodes on a
       separately seeded environment. The final return is the mean of the last --final_evals.

The mask rule: magnitude at initialisation (from scratch, a random N:M pattern), then every
--mask_every steps (default 5,000; 0 = a fixed mask) a RigL-style prune-and-regrow confined to each
group of m, so every row stays N:M. It runs in masked_step between the backward and the masking of
the gradient, so it sees the DENSE gradient of the batch's loss (TD loss for the critics, actor
loss for the actor). In each group: drop candidate = the active weight with the smallest |w|; grow
candidate = the inactive weight with the largest |gradient|; gain = that |gradient|. The fraction f
of a layer's groups with the largest gain swap the two (never a group with gain 0, e.g. only pad
columns inactive); f(t) = --drop_fraction * (1 + cos(pi t / --steps)) / 2, RigL's cosine, 0.3 to 0
by default. One swap per group: an update moves at most f / n of the active weights (logged).
    A dropped weight is set to 0, with its Adam moments and its TARGET entry (Polyak would keep a
stale value there, decaying by 1 - tau a step but never reaching 0). A regrown weight and its
target entry start at 0 (pruned until now, they were) with Adam moments 0; its gradient is kept in
the same step, so it trains at once, and its target follows it by Polyak.
    Why 5,000: the method found LESS frequent mask updates better in RL, where the targets move and
a connection that looks useless now may matter later; 5,000 is rare next to RigL's 100 and still
gives 200 updates in a 1M-step MuJoCo run (3 that move in the 20,000-step Pendulum run). SR-STE is
not used: its dense latent copy keeps pruned weights moving, not "only the active weights update".

How the pruned weights stay exactly 0: before each Adam step the gradient of every masked weight
is multiplied by its mask, so Adam's two moments on a pruned entry stay exactly 0 (zeroed when it
was dropped) and so does its update, lr * m / (sqrt(v) + eps); Polyak of two zeros is zero. Nothing
re-zeroes the weights after a step; the tests check weights, targets and moments directly.

Simplifications:
    1. Masked dense: the zeros are stored and multiplied, so on this CPU a sparse run takes a dense
       one's time (a little more); the FLOPs column counts what an N:M kernel would do.
    2. The input layer is N:M by default, as the method makes all six networks N:M: the input is
       zero-padded to a multiple of m. Pad columns start at 0 and get a zero gradient, so a pad
       slot is kept only where a group has fewer than n real inputs, drops first and never
       regrows. --input_layer=dense keeps that small layer dense: Pendulum's 3 (actor) and 4
       (critic) inputs leave each first-layer unit ONE input at 1:4 and 1:8, and with fixed masks
       those arms barely learned, while with a dense first layer they learned about as well as
       dense TD3 (bench/RESULTS.md). MuJoCo's inputs (Hopper 11, HalfCheetah 17) are wider.
    3. The output layer is N:M like the others: its inputs are the hidden width, which must be a
       multiple of m (--hidden=256 or 128 suit 2:4, 1:4 and 1:8). Biases stay dense.
    4. The parameter count is the mask's kept slots plus the biases (what an N:M format stores),
       pad slots included. FLOPs per update count only the matmuls: 2 per active weight per sample
       forward, twice that backward; elementwise ops, Adam, Polyak and mask updates are left out.
       The backward's input-gradient matmul uses W transposed, N:M along columns, not rows:
       hardware that accelerates only row-wise N:M would not speed it up (a best case).
    5. TD3 as published (Fujimoto et al.), with no tuning for sparsity: Adam 3e-4 for both,
       batch 256, gamma 0.99, tau 0.005, policy noise 0.2 clipped at 0.5, policy delay 2,
       exploration noise 0.1 (noise scales are in units of the action bound). Episodes cut by a
       time limit bootstrap; only true terminations do not. No observation normalisation.
    6. The default comparison is Pendulum-v1, 20,000 steps (12 runs fit one CPU thread); the claim
       is on MuJoCo over 1M steps (bench/RESULTS.md's Hopper-v5 runs: 60,000; --env takes any
       gymnasium Box task). --compare prints its table (final return mean ± std per arm, a line on
       the claim) and writes it with its plot under --out/<env>, or with --write-results into
       bench/RESULTS.md and assets/.
"""

import argparse
import copy
import importlib.util
import json
import math
import os
import sys
import time

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# run as a script from anywhere: the repo root holds sparsity.py and bench/
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import hardware, write_block  # noqa: E402
from sparsity import nm_mask  # noqa: E402

ARMS = ["dense", "2:4", "1:4", "1:8"]
NETS = ["actor", "critic1", "critic2"]  # each has a target copy, "<name>_t"
LAYER_TEXT = {"nm": "every layer N:M, inputs zero-padded to a multiple of m",
              "dense": "first layer dense, every other layer N:M"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="Pendulum-v1")
    p.add_argument("--sparsity", default="2:4", help="n:m, or dense")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=20000, help="environment steps")
    p.add_argument("--start_steps", type=int, default=1000, help="random actions first")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--input_layer", default="nm", choices=["nm", "dense"],
                   help="the first layer: N:M over inputs zero-padded to m, or dense")
    p.add_argument("--mask_every", type=int, default=5000,
                   help="steps between mask updates (prune and regrow); 0: a fixed mask")
    p.add_argument("--drop_fraction", type=float, default=0.3,
                   help="the fraction of groups that swap a weight, cosine-annealed to 0")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.005)
    p.add_argument("--policy_noise", type=float, default=0.2)
    p.add_argument("--noise_clip", type=float, default=0.5)
    p.add_argument("--expl_noise", type=float, default=0.1)
    p.add_argument("--policy_delay", type=int, default=2)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--eval_episodes", type=int, default=10)
    p.add_argument("--final_evals", type=int, default=5, help="the final return's evaluations")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compare", action="store_true", help="dense, 2:4, 1:4, 1:8 over --seeds")
    p.add_argument("--seeds", type=int, default=3, help="--compare: seeds 0 .. seeds-1")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "rnm_td3"), help="--compare's files")
    p.add_argument("--write-results", action="store_true", help="--compare: into bench/, assets/")
    cfg = p.parse_args(argv)
    if cfg.mask_every % cfg.policy_delay:  # the actor's mask update needs an actor step
        p.error(f"--mask_every={cfg.mask_every} is not a multiple of --policy_delay")
    return cfg


def parse_sparsity(text):
    """'2:4' -> (2, 4); 'dense' -> None."""
    if text == "dense":
        return None
    try:
        n, m = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--sparsity wants n:m (e.g. 2:4) or dense, got {text!r}") from None
    if not 0 < n <= m:
        raise SystemExit(f"--sparsity wants 0 < n <= m, got {text!r}")
    return n, m


def make_env(name):
    """A gymnasium environment; a MuJoCo one only when the mujoco package is there."""
    # mujoco is optional: gymnasium imports it (and imageio, for rendering) only when a MuJoCo
    # environment is made
    if "mujoco" in str(gym.spec(name).entry_point):
        missing = [m for m in ("mujoco", "imageio") if importlib.util.find_spec(m) is None]
        if missing:
            raise SystemExit(f"{name} needs MuJoCo: pip install {' '.join(missing)}")
    return gym.make(name)


# ------------------------------------------------------------------------ networks and N:M masks


class MLP(nn.Module):
    """in -> hidden -> hidden -> out, ReLU. The input is zero-padded to in_pad columns (a multiple
    of m for an N:M first layer, Simplification 2; n_in otherwise), so the first layer's weight
    is (hidden, in_pad)."""

    def __init__(self, n_in, hidden, n_out, in_pad):
        super().__init__()
        self.pad = in_pad - n_in
        self.layers = nn.ModuleList([nn.Linear(in_pad, hidden), nn.Linear(hidden, hidden),
                                     nn.Linear(hidden, n_out)])
        with torch.no_grad():
            self.layers[0].weight[:, n_in:] = 0  # pad columns: never preferred by magnitude

    def forward(self, x):
        x = F.pad(x, (0, self.pad))
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def mask_net(net, nm, dense_first):
    """The initial N:M magnitude mask on every Linear of net (the first one excepted when
    dense_first): zero the pruned weights and return the masks, one float (out, in) tensor per
    layer (1 = active; None for a dense first layer). Dense networks (nm None): None."""
    if nm is None:
        return None
    masks = [None] if dense_first else []
    with torch.no_grad():
        for layer in net.layers[len(masks):]:
            mask = nm_mask(layer.weight, *nm).float()
            layer.weight.mul_(mask)
            masks.append(mask)
    return masks


def build_agent(obs_dim, act_dim, max_action, hidden, nm, lr, input_layer="nm"):
    """The six networks, their masks ({online name: [mask per layer]}, shared by the target) and
    the two optimizers (one Adam for the actor, one over both critics)."""
    m = 1 if nm is None else nm[1]
    if hidden % m:
        raise SystemExit(f"--hidden={hidden} is not a multiple of m={m}")

    def padded(k):  # the next multiple of m, for an N:M first layer
        return k if input_layer == "dense" else -(-k // m) * m

    agent = {"actor": MLP(obs_dim, hidden, act_dim, padded(obs_dim)),
             "critic1": MLP(obs_dim + act_dim, hidden, 1, padded(obs_dim + act_dim)),
             "critic2": MLP(obs_dim + act_dim, hidden, 1, padded(obs_dim + act_dim)),
             "max_action": max_action, "nm": nm}
    agent["masks"] = {name: mask_net(agent[name], nm, input_layer == "dense") for name in NETS}
    for name in NETS:  # after masking: the targets start with the same zeros
        agent[f"{name}_t"] = copy.deepcopy(agent[name]).requires_grad_(False)
    agent["actor_opt"] = torch.optim.Adam(agent["actor"].parameters(), lr=lr)
    critic_params = [*agent["critic1"].parameters(), *agent["critic2"].parameters()]
    agent["critic_opt"] = torch.optim.Adam(critic_params, lr=lr)
    return agent


def masked_pairs(agent, names):
    """[(weight, mask)] of the named online networks: the weights whose gradients get masked."""
    if agent["nm"] is None:
        return []
    return [(layer.weight, mask) for name in names
            for layer, mask in zip(agent[name].layers, agent["masks"][name]) if mask is not None]


def masked_step(opt, loss, pairs, rewire=None):
    """One optimizer step on loss in which pruned weights get no gradient. Zeroing the gradient
    BEFORE the step keeps Adam's moments at exactly 0 on pruned entries, so its update there is
    exactly 0 (no momentum, no bias-corrected leftovers), now and at every later step. rewire, when
    given, runs between the backward and the masking (it sees the dense gradient and may change
    the masks in place); its result is returned."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    moved = rewire() if rewire is not None else None
    for weight, mask in pairs:
        weight.grad.mul_(mask)
    opt.step()
    return moved


def regrow_mask(weight, grad, mask, m, frac):
    """One layer's mask update (the mask rule): in each group of m inputs of each row, the drop
    candidate is the active weight with the smallest |w|, the grow candidate the inactive one with
    the largest |grad|; the round(frac * groups) groups whose grow candidate has the largest |grad|
    (if nonzero) swap the two. weight, grad, mask (out, in) -> the new float mask, N:M again."""
    active = mask.reshape(-1, m).bool()  # (groups, m)
    w, g = weight.abs().reshape(-1, m), grad.abs().reshape(-1, m)
    drop = w.masked_fill(~active, float("inf")).argmin(-1)  # (groups,)
    gain, grow = g.masked_fill(active, -1.0).max(-1)  # -1: nothing inactive (n == m)
    chosen = gain.topk(int(round(frac * len(gain)))).indices
    chosen = chosen[gain[chosen] > 0]
    new = active.clone()
    new[chosen, drop[chosen]] = False
    new[chosen, grow[chosen]] = True
    return new.reshape(mask.shape).float()


@torch.no_grad()
def update_masks(agent, names, opt, frac):
    """The mask update of the named online networks from the dense gradients in .grad. Every entry
    that changed, dropped or regrown, is set to 0 in the weight, in Adam's two moments and in the
    target network; the masks change in place, so the masked pairs and the targets follow. Returns
    (active slots that moved, active slots)."""
    moved = total = 0
    for name in names:
        target = agent[f"{name}_t"].layers
        for i, (layer, mask) in enumerate(zip(agent[name].layers, agent["masks"][name])):
            if mask is None:
                continue
            w = layer.weight
            new = regrow_mask(w, w.grad, mask, agent["nm"][1], frac)
            changed = new != mask
            w[changed] = 0
            target[i].weight[changed] = 0  # else Polyak keeps a stale value at a dropped entry
            for moment in (opt.state[w].get(k) for k in ("exp_avg", "exp_avg_sq")):
                if moment is not None:  # none before the first step
                    moment[changed] = 0
            moved, total = moved + int((new > mask).sum()), total + int(new.sum())
            mask.copy_(new)
    return moved, total


def swap_fraction(cfg, step):
    """The fraction of groups that swap a weight at this step's mask update, cosine-annealed from
    cfg.drop_fraction to 0 at the last step; None when no update is due."""
    if not cfg.mask_every or step % cfg.mask_every:
        return None
    return cfg.drop_fraction * (1 + math.cos(math.pi * step / cfg.steps)) / 2


# -------------------------------------------------------------------------------------- TD3


class Replay:
    """A fixed-size ring of transitions, stored as float32 tensors."""

    def __init__(self, obs_dim, act_dim, size):
        self.obs, self.next_obs = torch.zeros(size, obs_dim), torch.zeros(size, obs_dim)
        self.act, self.rew = torch.zeros(size, act_dim), torch.zeros(size, 1)
        self.done = torch.zeros(size, 1)  # 1: terminated, so no bootstrap from next_obs
        self.size, self.n, self.i = size, 0, 0

    def add(self, obs, act, rew, next_obs, terminated):
        j = self.i
        self.obs[j], self.act[j], self.next_obs[j] = (torch.as_tensor(x, dtype=torch.float32)
                                                      for x in (obs, act, next_obs))
        self.rew[j], self.done[j] = float(rew), float(terminated)
        self.i, self.n = (j + 1) % self.size, min(self.n + 1, self.size)

    def sample(self, batch, gen):
        idx = torch.randint(self.n, (batch,), generator=gen)
        return self.obs[idx], self.act[idx], self.rew[idx], self.next_obs[idx], self.done[idx]


def act(agent, obs):
    """The deterministic policy: tanh squashed to the action bound. obs (obs_dim,) -> (act_dim,)."""
    with torch.no_grad():
        x = torch.as_tensor(obs, dtype=torch.float32)[None]
        return (torch.tanh(agent["actor"](x)) * agent["max_action"])[0].numpy()


def td3_update(agent, batch, step, cfg, gen):
    """One TD3 update: both critics every step; the actor and the three targets every
    cfg.policy_delay steps; the masks every cfg.mask_every steps (a multiple of policy_delay, so
    the actor updates then too). Returns (active slots that moved, active slots) on a mask
    update, else None."""
    obs, action, rew, next_obs, done = batch  # (B, obs), (B, act), (B, 1), (B, obs), (B, 1)
    max_a = agent["max_action"]
    with torch.no_grad():
        # target policy smoothing: clipped noise on the target actor's action
        noise = torch.randn(action.shape, generator=gen) * cfg.policy_noise
        noise = noise.clamp(-cfg.noise_clip, cfg.noise_clip) * max_a
        next_a = (torch.tanh(agent["actor_t"](next_obs)) * max_a + noise).clamp(-max_a, max_a)
        sa = torch.cat([next_obs, next_a], 1)
        q_next = torch.min(agent["critic1_t"](sa), agent["critic2_t"](sa))  # clipped double Q
        target = rew + cfg.gamma * (1 - done) * q_next
    frac = swap_fraction(cfg, step) if agent["nm"] is not None else None

    def rewire(names, opt):  # the mask update, when one is due
        return None if frac is None else lambda: update_masks(agent, names, agent[opt], frac)

    sa = torch.cat([obs, action], 1)
    critic_loss = (F.mse_loss(agent["critic1"](sa), target)
                   + F.mse_loss(agent["critic2"](sa), target))
    critics = ["critic1", "critic2"]
    moved = masked_step(agent["critic_opt"], critic_loss, masked_pairs(agent, critics),
                        rewire(critics, "critic_opt"))
    if step % cfg.policy_delay == 0:
        pi = torch.tanh(agent["actor"](obs)) * max_a
        # also fills the critics' .grad, which the next critic step's zero_grad clears
        actor_loss = -agent["critic1"](torch.cat([obs, pi], 1)).mean()
        moved_a = masked_step(agent["actor_opt"], actor_loss, masked_pairs(agent, ["actor"]),
                              rewire(["actor"], "actor_opt"))
        polyak(agent, cfg.tau)
        if moved is not None:
            moved = (moved[0] + moved_a[0], moved[1] + moved_a[1])
    return moved


@torch.no_grad()
def polyak(agent, tau):
    """target <- (1 - tau) target + tau online. Where both are 0 (pruned), the target stays 0."""
    for name in NETS:
        for t, p in zip(agent[f"{name}_t"].parameters(), agent[name].parameters()):
            t.lerp_(p, tau)


def evaluate(agent, env, episodes, seed):
    """Mean return of `episodes` noise-free episodes; the same start states at every evaluation."""
    total = 0.0
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        done = False
        while not done:
            obs, rew, terminated, truncated, _ = env.step(act(agent, obs))
            total += rew
            done = terminated or truncated
    return total / episodes


def train(cfg, log=print):
    """One run. Returns (agent, history): history holds the evaluation steps and returns, the
    final return (mean of the last cfg.final_evals evaluations) and the wall time."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)  # replay sampling and target noise
    rng = np.random.default_rng(cfg.seed)  # exploration noise
    env, eval_env = make_env(cfg.env), make_env(cfg.env)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    max_action = float(env.action_space.high[0])  # TD3 assumes a symmetric box
    agent = build_agent(obs_dim, act_dim, max_action, cfg.hidden, parse_sparsity(cfg.sparsity),
                        cfg.lr, cfg.input_layer)
    buf = Replay(obs_dim, act_dim, cfg.steps)
    obs, _ = env.reset(seed=cfg.seed)
    env.action_space.seed(cfg.seed)
    hist = {"step": [], "return": [], "mask_moved": []}  # mask_moved: [step, fraction] per update
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        if step <= cfg.start_steps:
            action = env.action_space.sample()
        else:
            noise = rng.normal(0, cfg.expl_noise * max_action, act_dim)
            action = np.clip(act(agent, obs) + noise, -max_action, max_action).astype(np.float32)
        next_obs, rew, terminated, truncated, _ = env.step(action)
        buf.add(obs, action, rew, next_obs, terminated)  # a time-limit cut still bootstraps
        obs = env.reset()[0] if terminated or truncated else next_obs
        if step > cfg.start_steps:
            moved = td3_update(agent, buf.sample(cfg.batch, gen), step, cfg, gen)
            if moved is not None:
                hist["mask_moved"].append([step, moved[0] / moved[1]])
                log(f"{cfg.sparsity:>5} seed {cfg.seed} | step {step:6d} | mask update: "
                    f"{moved[0] / moved[1]:.1%} of the active weights moved")
        if step % cfg.eval_every == 0:
            ret = evaluate(agent, eval_env, cfg.eval_episodes, seed=10_000 + 100 * cfg.seed)
            hist["step"].append(step)
            hist["return"].append(ret)
            log(f"{cfg.sparsity:>5} seed {cfg.seed} | step {step:6d} | return {ret:8.1f} | "
                f"{time.perf_counter() - t0:6.1f} s")
    hist["final"] = float(np.mean(hist["return"][-cfg.final_evals:])) if hist["return"] else None
    hist["seconds"] = time.perf_counter() - t0
    return agent, hist


# ------------------------------------------------------------------------------ cost and compare


def cost(cfg, obs_dim, act_dim, nm):
    """Active parameters and matmul FLOPs per update, from the layer shapes (Simplification 4).
    One TD3 update (one per environment step) runs: the target actor and both target critics
    forward; both critics forward and backward; every policy_delay steps the actor forward and
    backward through critic 1. A forward is 2 FLOPs per active weight per sample, a backward 4."""
    n, m = nm or (1, 1)

    def active(n_in, n_out):  # (weights, biases) an N:M format stores; N:M inputs padded to m
        dense_first = cfg.input_layer == "dense"
        first = n_in * cfg.hidden if dense_first else -(-n_in // m) * m * cfg.hidden * n // m
        rest = (cfg.hidden * cfg.hidden + cfg.hidden * n_out) * n // m
        return first + rest, 2 * cfg.hidden + n_out

    wa, ba = active(obs_dim, act_dim)
    wc, bc = active(obs_dim + act_dim, 1)
    fwd_a, fwd_c = 2 * cfg.batch * wa, 2 * cfg.batch * wc  # one forward of a batch
    critic_step = fwd_a + 2 * fwd_c + 2 * 3 * fwd_c  # targets forward; critics forward + backward
    actor_step = 3 * fwd_a + 3 * fwd_c  # actor and critic 1, forward + backward
    return {"actor": wa + ba, "critic": wc + bc, "six": 2 * (wa + ba + 2 * (wc + bc)),
            "flops": critic_step + actor_step / cfg.policy_delay}


def run_or_load(cfg, log, run=True):
    """One comparison run, or its saved history when a run with the same settings is on disk (so
    a stopped --compare resumes); None when there is none and run is False. The history is saved
    with the settings that made it."""
    keys = {k: v for k, v in vars(cfg).items()
            if k not in ("compare", "seeds", "out", "threads", "write_results")}
    layer = "" if cfg.sparsity == "dense" else f"_{cfg.input_layer}"
    path = os.path.join(cfg.out, cfg.env,
                        f"{cfg.sparsity.replace(':', 'of')}{layer}_seed{cfg.seed}.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved["cfg"] == keys:
            log(f"{cfg.sparsity:>5} seed {cfg.seed} | loaded {path}")
            return saved["hist"]
    if not run:
        return None
    _, hist = train(cfg, log)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"cfg": keys, "hist": hist}, f)
    return hist


def plot(variants, path, env_name):
    """One panel per input-layer choice: evaluation return against environment steps, the mean
    over seeds and its +-1 std band."""
    # imported here: matplotlib draws only this picture, and Agg must be set before pyplot loads
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(variants), figsize=(6.5 * len(variants), 4.5), sharey=True,
                             squeeze=False)
    for ax, (layer, results) in zip(axes[0], variants.items()):
        for i, (arm, hists) in enumerate(results.items()):
            steps = hists[0]["step"]
            r = np.array([h["return"] for h in hists])  # (seeds, evaluations)
            mean, std = r.mean(0), r.std(0)
            ax.plot(steps, mean, color=f"C{i}", label=f"{arm} ({len(hists)} seeds)")
            ax.fill_between(steps, mean - std, mean + std, color=f"C{i}", alpha=0.15)
        ax.set_title(f"TD3 on {env_name}: {LAYER_TEXT[layer]}", fontsize=10)
        ax.set_xlabel("environment steps")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0][0].set_ylabel("evaluation return")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(cfg, results, obs_dim, act_dim, dense_finals):
    """The rows of one input-layer choice: return, cost and time per sparsity."""
    dense = cost(cfg, obs_dim, act_dim, None)
    lines = ["| sparsity | final return, mean ± std over seeds | per seed | vs dense (mean) "
             "| active parameters: actor / critic / all six | of dense | MFLOP per update "
             "| wall time per run |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, hists in results.items():
        c = cost(cfg, obs_dim, act_dim, parse_sparsity(arm))
        f = np.array([h["final"] for h in hists])
        per_seed = ", ".join(f"{x:.0f}" for x in f)
        delta = "" if arm == "dense" else f"{f.mean() - dense_finals.mean():+.0f}"
        secs = np.mean([h["seconds"] for h in hists])
        lines.append(f"| {arm} | {f.mean():.0f} ± {f.std():.0f} | {per_seed} | {delta} "
                     f"| {c['actor']:,} / {c['critic']:,} / {c['six']:,} "
                     f"| {c['six'] / dense['six']:.3f} | {c['flops'] / 1e6:.1f} "
                     f"| {secs:.0f} s |")
    return lines


def paper_check(results):
    """The line that holds one table (seeds alike in every arm) against the method's claim: 2:4 and
    1:4 beat dense, 1:8 stays competitive. A gap of means is beyond noise past two standard errors
    of the difference."""
    final = {arm: np.array([h["final"] for h in hists]) for arm, hists in results.items()}
    dense, parts = final["dense"], []
    for arm, claim in (("2:4", "beat"), ("1:4", "beat"), ("1:8", "competitive")):
        f = final[arm]
        gap = f.mean() - dense.mean()
        se = np.sqrt((f.var(ddof=1) + dense.var(ddof=1)) / len(f)) if len(f) > 1 else np.inf
        if claim == "beat":
            verdict = ("beats dense: agrees" if gap > 2 * se else
                       "above dense within noise: agrees in sign only" if gap > 0 else
                       "below dense within noise: does not agree" if gap >= -2 * se else
                       "below dense beyond noise: disagrees")
        else:
            verdict = ("not below dense beyond noise: agrees" if gap >= -2 * se else
                       "below dense beyond noise: disagrees")
        parts.append(f"{arm} {gap:+.0f} (2 se {2 * se:.0f}), {verdict}")
    return ("Against the claim (2:4 and 1:4 beat dense, 1:8 stays competitive), the mean final "
            "return minus dense's: " + "; ".join(parts) + ".")


def results_block(cfg, variants, obs_dim, act_dim, name="rnm_td3"):
    """The markdown that goes between the `name` markers of bench/RESULTS.md: the settings, then
    one table per input-layer choice that has all its runs, each with the line on the claim."""
    hists = [h for results in variants.values() for runs in results.values() for h in runs]
    dense_finals = np.array([h["final"] for h in variants[cfg.input_layer]["dense"]])
    last = hists[0]["step"][-cfg.final_evals]
    defaults = vars(parse_args([]))
    command = " ".join(["python examples/rnm_td3.py --compare"]
                       + [f"--{k}={v}" for k, v in vars(cfg).items()
                          if k not in ("compare", "sparsity", "seed", "input_layer",
                                       "write_results") and v != defaults[k]])
    before = ", before any update" if cfg.eval_every <= cfg.start_steps else ""
    moved = [f for h in hists for _, f in h.get("mask_moved", [])]
    masks = (f"updated every {cfg.mask_every:,} steps (in each group, drop the smallest |w|, grow "
             f"the largest |gradient|; swap fraction {cfg.drop_fraction} cosine-annealed to 0; "
             f"{np.mean(moved or [0]):.1%} of the active weights moved per update, mean over "
             f"{len(moved)} updates in all)" if cfg.mask_every else "fixed")
    other = "dense" if cfg.input_layer == "nm" else "nm"
    lines = [
        "## N:M sparse TD3 from scratch (RNM-TD3)" + (", " + cfg.env) * (name != "rnm_td3"), "",
        f"`{command}` (examples/rnm_td3.py; `--input_layer={other}` for a second table). "
        f"Hardware: {hardware()}. {cfg.env}, {cfg.steps:,} environment steps "
        f"({cfg.start_steps:,} random first), TD3 with 2 x {cfg.hidden} hidden units and batch "
        f"{cfg.batch}, seeds 0 to {cfg.seeds - 1}. Final return: the mean of the last "
        f"{cfg.final_evals} evaluations (steps {last:,} to {cfg.steps:,}, {cfg.eval_episodes} "
        f"noise-free episodes each); the first evaluation (step {cfg.eval_every:,}{before}) "
        f"averaged {np.mean([h['return'][0] for h in hists]):.0f}. Masks: N:M by magnitude at "
        f"initialisation on all six networks, {masks}. Parameters: kept weight slots plus biases; "
        f"FLOPs: the matmuls of one update (critics every step, actor every {cfg.policy_delay}), "
        f"as an N:M kernel would do them. Runs: {sum(h['seconds'] for h in hists) / 60:.0f} "
        f"minutes in all. Curves: [assets/{name}.png](../assets/{name}.png)."]
    for layer, results in variants.items():
        lines += ["", f"{LAYER_TEXT[layer][0].upper()}{LAYER_TEXT[layer][1:]} "
                      f"(`--input_layer={layer}`):", ""]
        layer_cfg = argparse.Namespace(**{**vars(cfg), "input_layer": layer})
        lines += table(layer_cfg, results, obs_dim, act_dim, dense_finals)
        lines += ["", paper_check(results)]
    return "\n".join(lines)


def write_results(text, name, path=os.path.join(ROOT, "bench", "RESULTS.md")):
    """Put text between the `name` markers of RESULTS.md, appending the markers at the end of the
    file the first time."""
    with open(path) as f:
        doc = f.read()
    if f"<!-- bench:{name} -->" not in doc:
        with open(path, "a") as f:
            f.write(("" if doc.endswith("\n") else "\n")
                    + f"\n<!-- bench:{name} -->\n<!-- /bench:{name} -->\n")
    write_block(name, text, path)


def compare(cfg, log=print):
    """dense, 2:4, 1:4 and 1:8 over seeds 0 .. cfg.seeds - 1, seed by seed (a stopped comparison
    has every arm on its first seeds), with cfg.input_layer; the other input-layer choice joins when
    all its runs are on disk (the dense runs are shared). The table and plot go under cfg.out/<env>,
    or into RESULTS.md and assets/ (their own block and plot for an env other than Pendulum)."""
    variants = {}
    other = "nm" if cfg.input_layer == "dense" else "dense"
    for layer in (cfg.input_layer, other):
        results = {arm: [] for arm in ARMS}
        for seed in range(cfg.seeds):
            for arm in ARMS:
                arm_layer = "dense" if arm == "dense" else layer  # no mask, no padding
                run_cfg = argparse.Namespace(**{**vars(cfg), "sparsity": arm, "seed": seed,
                                                "input_layer": arm_layer})
                results[arm].append(run_or_load(run_cfg, log, run=layer == cfg.input_layer))
        if all(h is not None for runs in results.values() for h in runs):
            variants[layer] = results
    env = make_env(cfg.env)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    name = "rnm_td3" + ("" if cfg.env == "Pendulum-v1" else "_" + cfg.env.lower().replace("-", "_"))
    text = results_block(cfg, variants, obs_dim, act_dim, name)
    print(text)
    if cfg.write_results:
        plot(variants, os.path.join(ROOT, "assets", f"{name}.png"), cfg.env)
        return write_results(text, name)
    plot(variants, os.path.join(cfg.out, cfg.env, f"{name}.png"), cfg.env)
    with open(os.path.join(cfg.out, cfg.env, f"{name}.md"), "w") as f:
        f.write(text + "\n")


def main():
    cfg = parse_args()
    torch.set_num_threads(cfg.threads)
    if cfg.compare:
        return compare(cfg)
    _, hist = train(cfg)
    env = make_env(cfg.env)
    c = cost(cfg, env.observation_space.shape[0], env.action_space.shape[0],
             parse_sparsity(cfg.sparsity))
    print(f"final return {hist['final']:.1f} (mean of the last {cfg.final_evals} evaluations) | "
          f"active parameters: actor {c['actor']:,}, critic {c['critic']:,}, all six "
          f"{c['six']:,} | {c['flops'] / 1e6:.1f} MFLOP per update | {hist['seconds']:.0f} s")


if __name__ == "__main__":
    main()
