"""
examples/rnm_td3.py: TD3 trained from scratch with row-wise N:M sparse networks (RNM-TD3). In the
actor, the twin critics and their three target networks, every layer past the first (every layer,
with --input_layer=nm) keeps, in each output row, at most n nonzero weights in each group of m
consecutive inputs, from the first step to the last, and only the active weights are ever updated.
Dense TD3 is the same code with no masks.

    python examples/rnm_td3.py --sparsity=2:4 --seed=0 --steps=30000   # one run, Pendulum-v1
    python examples/rnm_td3.py --sparsity=dense                        # the dense baseline
    python examples/rnm_td3.py --compare       # dense, 2:4, 1:4, 1:8 x seeds 0, 1, 2: 12 runs of
                                               # 20,000 steps, about 3 minutes each on a free core
    python examples/rnm_td3.py --env=HalfCheetah-v5 --steps=1000000 --start_steps=25000
                                               # MuJoCo: `pip install mujoco imageio` first
    python -m pytest -q tests/test_rnm_td3.py  # the mask invariants on a few hundred steps

What a run does, top to bottom:
    1. Builds the six networks (actor, critic 1, critic 2 and a target copy of each), MLPs of two
       hidden layers. With --sparsity=n:m each Linear but the first (Simplification 2) gets a
       fixed N:M mask (below) and its pruned weights are zeroed; each target network is copied
       from its online network after that, so it starts with the same zeros and takes its mask.
    2. Acts at random for --start_steps steps, then with the actor plus Gaussian noise, storing
       every transition in a replay buffer.
    3. Each step after that, one TD3 update on a batch from the buffer: both critics regress onto
       r + gamma * min(Q1', Q2')(s', clip(actor'(s') + clipped noise)); every --policy_delay
       steps the actor ascends Q1(s, actor(s)) and the targets move by Polyak averaging.
    4. Every --eval_every steps, the mean return of --eval_episodes noise-free episodes on a
       separately seeded environment. The final return is the mean of the last --final_evals.

The mask rule: a FIXED magnitude mask, chosen once at initialisation and never updated. From
scratch, the largest |w| of each group at init is a random N:M pattern, and that is the point: the
network learns to use the connections it was given. Why not periodic prune-and-regrow: the method
this follows found that less frequent mask updates did better in RL, where the targets move and a
connection that looks unimportant now may matter later; never updating is the limit of that, costs
nothing, and keeps the rule "only active weights update" exact, with no regrown weight restarting
from zero under a stale Adam state. Why not SR-STE: it keeps a dense latent copy whose pruned
weights keep moving, which is not "only the active weights update".

How the pruned weights stay exactly 0: after each backward and before each Adam step, the gradient
of every masked weight is multiplied by its mask (`masked_step`). A pruned entry then has a zero
gradient from the first step on, so Adam's first and second moments there stay exactly 0 and its
update, lr * m / (sqrt(v) + eps), is exactly 0: momentum cannot move it. Polyak averaging of two
zeros is zero, so the targets keep the zeros too. Nothing re-zeroes the weights after a step; the
test checks the weights, the targets and Adam's moments directly.

Simplifications:
    1. Masked dense: the zeros are stored and multiplied. On this CPU a sparse run costs as much
       time as a dense one (a little more: the mask multiply); the FLOPs column counts what an N:M
       kernel would do.
    2. The input layer stays dense by default (--input_layer=dense): the observation (actor) or
       observation + action (critics) is rarely a multiple of m (Pendulum: 3 and 4 inputs), and
       the layer is small (3 x 256 or 4 x 256 weights on Pendulum, against 256 x 256 in the layer
       after it: 1% of a dense network's weights, 8-10% of a 1:8 one's). --input_layer=nm makes
       it N:M too: the input is zero-padded to the next multiple of m and the row groups run over
       the padded width. Its pad columns start at 0, so magnitude never keeps a pad column over a
       real input; a group with fewer than n real inputs keeps pad slots, which stay 0 (their
       input is 0, so is their gradient).
       Why dense is the default: with an N:M input layer at 1:4 or 1:8 each first-layer unit
       sees exactly one of Pendulum's 3 or 4 inputs, and those arms barely learned in the
       comparison, while with a dense input layer they learned about as well as dense TD3
       (bench/RESULTS.md has both tables). Dense networks are never padded.
    3. The output layer is N:M like the others: its inputs are the hidden width, which must be a
       multiple of m (--hidden=256 or 128 suit 2:4, 1:4 and 1:8). Biases stay dense.
    4. The parameter count is the mask's kept slots plus the biases (what an N:M format stores),
       pad slots included. FLOPs per update count only the matmuls: 2 per active weight per sample
       forward, twice that backward; elementwise ops, Adam and Polyak are left out. The backward's
       input-gradient matmul uses W transposed, which is N:M along columns, not rows: hardware
       that accelerates only row-wise N:M would not speed it up, so the column is a best case.
    5. TD3 as published (Fujimoto et al.), with no tuning for sparsity: Adam 3e-4 for both,
       batch 256, gamma 0.99, tau 0.005, policy noise 0.2 clipped at 0.5, policy delay 2,
       exploration noise 0.1 (noise scales are in units of the action bound). Episodes cut by a
       time limit bootstrap; only true terminations do not. No observation normalisation.
    6. The comparison is Pendulum-v1 for 20,000 steps, a budget that fits 12 runs on one CPU
       thread: a small task and a short run, so it shows how fast each sparsity learns more than
       where it would end. Its tables and plot: bench/RESULTS.md, assets/rnm_td3.png.
"""

import argparse
import copy
import importlib.util
import json
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
LAYER_TEXT = {"dense": "first layer dense, every other layer N:M",
              "nm": "every layer N:M, inputs zero-padded to a multiple of m"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="Pendulum-v1")
    p.add_argument("--sparsity", default="2:4", help="n:m, or dense")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=20000, help="environment steps")
    p.add_argument("--start_steps", type=int, default=1000, help="random actions first")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--input_layer", default="dense", choices=["dense", "nm"],
                   help="the first layer: dense, or N:M over inputs zero-padded to m")
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
    p.add_argument("--out", default=os.path.join(ROOT, "out", "rnm_td3"), help="--compare's runs")
    return p.parse_args(argv)


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
    """Fix an N:M magnitude mask on every Linear of net (the first one excepted when dense_first),
    zero its pruned weights, and return the masks, one float (out, in) tensor per layer (1 =
    active; None for a dense first layer). Dense networks (nm None): None."""
    if nm is None:
        return None
    masks = [None] if dense_first else []
    with torch.no_grad():
        for layer in net.layers[len(masks):]:
            mask = nm_mask(layer.weight, *nm).float()
            layer.weight.mul_(mask)
            masks.append(mask)
    return masks


def build_agent(obs_dim, act_dim, max_action, hidden, nm, lr, input_layer="dense"):
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


def masked_step(opt, loss, pairs):
    """One optimizer step on loss in which pruned weights get no gradient. Zeroing the gradient
    BEFORE the step keeps Adam's moments at exactly 0 on pruned entries, so its update there is
    exactly 0 (no momentum, no bias-corrected leftovers), now and at every later step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    for weight, mask in pairs:
        weight.grad.mul_(mask)
    opt.step()


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
    cfg.policy_delay steps."""
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
    sa = torch.cat([obs, action], 1)
    critic_loss = (F.mse_loss(agent["critic1"](sa), target)
                   + F.mse_loss(agent["critic2"](sa), target))
    masked_step(agent["critic_opt"], critic_loss, masked_pairs(agent, ["critic1", "critic2"]))
    if step % cfg.policy_delay == 0:
        pi = torch.tanh(agent["actor"](obs)) * max_a
        # also fills the critics' .grad, which the next critic step's zero_grad clears
        actor_loss = -agent["critic1"](torch.cat([obs, pi], 1)).mean()
        masked_step(agent["actor_opt"], actor_loss, masked_pairs(agent, ["actor"]))
        polyak(agent, cfg.tau)


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
    hist = {"step": [], "return": []}
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
            td3_update(agent, buf.sample(cfg.batch, gen), step, cfg, gen)
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
    keys = {k: v for k, v in vars(cfg).items() if k not in ("compare", "seeds", "out", "threads")}
    layer = "" if cfg.sparsity == "dense" else f"_{cfg.input_layer}"
    path = os.path.join(cfg.out, f"{cfg.sparsity.replace(':', 'of')}{layer}_seed{cfg.seed}.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved["cfg"] == keys:
            log(f"{cfg.sparsity:>5} seed {cfg.seed} | loaded {path}")
            return saved["hist"]
    if not run:
        return None
    _, hist = train(cfg, log)
    os.makedirs(cfg.out, exist_ok=True)
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


def results_block(cfg, variants, obs_dim, act_dim):
    """The markdown that goes between the rnm_td3 markers of bench/RESULTS.md: the settings, then
    one table per input-layer choice that has all its runs."""
    hists = [h for results in variants.values() for runs in results.values() for h in runs]
    dense_finals = np.array([h["final"] for h in variants[cfg.input_layer]["dense"]])
    last = hists[0]["step"][-cfg.final_evals]
    defaults = vars(parse_args([]))
    command = " ".join(["python examples/rnm_td3.py --compare"]
                       + [f"--{k}={v}" for k, v in vars(cfg).items()
                          if k not in ("compare", "sparsity", "seed", "input_layer")
                          and v != defaults[k]])
    before = ", before any update" if cfg.eval_every <= cfg.start_steps else ""
    lines = [
        "## N:M sparse TD3 from scratch (RNM-TD3)", "",
        f"`{command}` (examples/rnm_td3.py; `--input_layer=nm` for the second table). "
        f"Hardware: {hardware()}. {cfg.env}, {cfg.steps:,} environment steps "
        f"({cfg.start_steps:,} random first), TD3 with 2 x {cfg.hidden} hidden units and batch "
        f"{cfg.batch}, seeds 0 to {cfg.seeds - 1}. Final return: the mean of the last "
        f"{cfg.final_evals} evaluations (steps {last:,} to {cfg.steps:,}, {cfg.eval_episodes} "
        f"noise-free episodes each); the first evaluation (step {cfg.eval_every:,}{before}) "
        f"averaged {np.mean([h['return'][0] for h in hists]):.0f}. Masks: fixed magnitude N:M "
        f"at initialisation on all six networks. Parameters: kept weight slots plus biases; "
        f"FLOPs: the matmuls of one update (critics every step, actor every {cfg.policy_delay}), "
        f"as an N:M kernel would do them. Runs: {sum(h['seconds'] for h in hists) / 60:.0f} "
        f"minutes in all. Curves: [assets/rnm_td3.png](../assets/rnm_td3.png)."]
    for layer, results in variants.items():
        lines += ["", f"{LAYER_TEXT[layer][0].upper()}{LAYER_TEXT[layer][1:]} "
                      f"(`--input_layer={layer}`):", ""]
        layer_cfg = argparse.Namespace(**{**vars(cfg), "input_layer": layer})
        lines += table(layer_cfg, results, obs_dim, act_dim, dense_finals)
    return "\n".join(lines)


def write_results(text, path=os.path.join(ROOT, "bench", "RESULTS.md")):
    """Put text between the rnm_td3 markers of RESULTS.md, appending the markers at the end of
    the file the first time."""
    with open(path) as f:
        doc = f.read()
    if "<!-- bench:rnm_td3 -->" not in doc:
        with open(path, "a") as f:
            f.write(("" if doc.endswith("\n") else "\n")
                    + "\n<!-- bench:rnm_td3 -->\n<!-- /bench:rnm_td3 -->\n")
    write_block("rnm_td3", text, path)


def compare(cfg, log=print):
    """dense, 2:4, 1:4 and 1:8 over seeds 0 .. cfg.seeds - 1, seed by seed (a stopped comparison
    has every arm on its first seeds), with cfg.input_layer. The other input-layer choice joins
    the plot and the results block when all its runs are on disk (the dense runs are shared)."""
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
    plot(variants, os.path.join(ROOT, "assets", "rnm_td3.png"), cfg.env)
    text = results_block(cfg, variants, obs_dim, act_dim)
    print(text)
    write_results(text)


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
