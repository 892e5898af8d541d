"""What makes each method the method it claims to be, tested on the step that defines it: RoI's
training forward draws a fresh soft mask whose average is the relaxed top-k draw; TD3's target takes
the smaller of the two target critics at a clipped-noise target action; HiReLC's search returns a
plan that meets a threshold which rejects faster candidates, and its surrogate fits its points; MoE
router replay weighs the replayed experts by the current router; the engine samples
softmax(logits / T); in the loop, a cheaper rollout copy is the one the updated policy re-derives;
and a checkpoint save that dies mid-write leaves the previous checkpoint loadable."""
import importlib.util
import itertools
import math
import os
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoint
import copies
import config
import roi
import train
from model import ModelConfig, Transformer
from moe import MoE
from rollout import Engine
from tasks import build_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples",
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def chi_square(counts, probs):
    """Pearson's statistic of counts (V,) against probs (V,), the cells expected under 5 pooled
    into one -> (statistic, degrees of freedom)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return ((obs - exp)[keep] ** 2 / exp[keep]).sum().item(), int(keep.sum()) - 1


def chi_limit(df):
    """Far in the tail: about five standard deviations of chi-square(df) above its mean."""
    return df + 5 * math.sqrt(2 * df)


# ----------------------------------------------------------------------------- RoI


def reference_relaxed_topk(phi, n, tau, lam, gen):
    """The module docstring's step 2, written out: kappa = phi / lambda + Gumbel; n rounds of
    mu_k = softmax(alpha_k / tau), alpha_{k+1} = alpha_k + log(1 - mu_k); the mask is sum_k mu_k."""
    u = torch.rand(phi.shape, generator=gen, dtype=torch.float64)
    alpha = phi.double() / lam - torch.log(-torch.log(u))
    soft = torch.zeros_like(alpha)
    for _ in range(n):
        mu = torch.softmax(alpha / tau, -1)
        soft += mu
        alpha = alpha + torch.log1p(-mu).clamp(min=-1e4)
    return soft


def pair_probs(phi, lam):
    """(rows, 6) probabilities of each pair of 4 entries being the 2 drawn without replacement with
    probabilities ~ exp(phi / lambda), the order summed out: what the Gumbel top-2 picks (the
    relaxation's hard limit), by hand. Pairs in itertools.combinations order."""
    p = torch.softmax(phi.double() / lam, -1)  # (rows, 4)
    pairs = list(itertools.combinations(range(4), 2))
    out = torch.zeros(len(p), len(pairs), dtype=torch.float64)
    for a, b in itertools.permutations(range(4), 2):
        out[:, pairs.index(tuple(sorted((a, b))))] += p[:, a] * p[:, b] / (1 - p[:, a])
    return out, pairs


def layer_masks(layer, draws):
    """(draws, out, in) effective masks of a RoILinear with all-ones weights: its output on the
    identity is the masked weight, transposed."""
    eye = torch.eye(layer.in_features)
    with torch.no_grad():
        return torch.stack([layer(eye).T for _ in range(draws)])


def test_roi_training_forward_draws_the_relaxed_topk_mask_afresh():
    torch.manual_seed(0)
    n, m, rows = 2, 4, 6
    layer = roi.RoILinear(nn.Linear(m, rows, bias=False), n, m, torch.ones(rows, m), 1.0)
    with torch.no_grad():
        layer.weight.fill_(1.0)
        layer.logits.copy_(torch.randn(rows, 1, m))
    phi = layer.logits.detach()[:, 0]  # (rows, m): one group per row
    layer.train()
    # two training forwards draw two different soft masks; eval uses the n largest logits (some
    # are negative: the largest |logit| would be another mask)
    a, b = layer_masks(layer, 2)
    assert (a - b).abs().max() > 0.05
    layer.eval()
    hard = torch.zeros(rows, m).scatter_(-1, phi.topk(n, -1).indices, 1.0)
    assert torch.equal(layer_masks(layer, 1)[0], hard)
    layer.train()
    # the average of many draws: the docstring's relaxed top-k at tau = 1 ...
    gen = torch.Generator().manual_seed(1)
    layer.tau, layer.lam = 1.0, 0.5
    got = layer_masks(layer, 3000).mean(0)
    ref = torch.stack([reference_relaxed_topk(phi, n, 1.0, 0.5, gen) for _ in range(3000)]).mean(0)
    assert (got - ref).abs().max() < 0.04, (got - ref).abs().max()
    assert torch.allclose(got.sum(-1), torch.full((rows,), float(n)), atol=1e-4)
    # ... and near tau = 0 the Gumbel top-2: each pair drawn as often as sampling without
    # replacement draws it (chi-square per row, summed)
    layer.tau = 0.02
    top = layer_masks(layer, 3000).topk(n, -1).indices.sort(-1).values  # (draws, rows, 2)
    want, pairs = pair_probs(phi, 0.5)
    stat = df = 0
    for r in range(rows):
        drawn = torch.tensor([pairs.index(tuple(t)) for t in top[:, r].tolist()])
        s, d = chi_square(torch.bincount(drawn, minlength=len(pairs)), want[r])
        stat, df = stat + s, df + d
    assert stat < chi_limit(df), (stat, df)
    assert want.min() < 0.05 and want.max() > 0.6  # the logits matter: not a uniform draw


# ----------------------------------------------------------------------------- TD3


class Const(nn.Module):
    """A stand-in network: out = fn(input)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def td3_target(monkeypatch, rnm_td3, agent, batch, cfg):
    """The critics' regression target of one td3_update, caught at its MSE."""
    seen = []
    real = F.mse_loss

    def spy(pred, target, *a, **k):
        seen.append(target.detach().clone())
        return real(pred, target, *a, **k)

    monkeypatch.setattr(rnm_td3.F, "mse_loss", spy)
    rnm_td3.td3_update(agent, batch, 1, cfg, torch.Generator().manual_seed(0))
    monkeypatch.setattr(rnm_td3.F, "mse_loss", real)
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])  # both critics, one target
    return seen[0]


def td3_setup(B, obs_dim=3, act_dim=1, max_a=2.0, **over):
    pytest.importorskip("gymnasium")
    rnm_td3 = load_example("rnm_td3")
    cfg = rnm_td3.parse_args([f"--{k}={v}" for k, v in over.items()])
    torch.manual_seed(0)
    agent = rnm_td3.build_agent(obs_dim, act_dim, max_a, 16, None, cfg.lr)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(B, obs_dim, generator=g), torch.rand(B, act_dim, generator=g) - 0.5,
             torch.randn(B, 1, generator=g), torch.randn(B, obs_dim, generator=g),
             (torch.rand(B, 1, generator=g) < 0.3).float())
    return rnm_td3, cfg, agent, batch


def test_td3_target_takes_the_smaller_target_critic(monkeypatch):
    rnm_td3, cfg, agent, batch = td3_setup(64, policy_delay=2)
    _, _, rew, next_obs, done = batch
    # the targets as known functions of s': which one is smaller changes from row to row
    agent["critic1_t"] = Const(lambda sa: sa[:, :1] * 3)
    agent["critic2_t"] = Const(lambda sa: sa[:, 1:2] * 3)
    q1, q2 = next_obs[:, :1] * 3, next_obs[:, 1:2] * 3
    assert (q1 < q2).any() and (q2 < q1).any()
    target = td3_target(monkeypatch, rnm_td3, agent, batch, cfg)
    want = rew + cfg.gamma * (1 - done) * torch.minimum(q1, q2)
    assert torch.allclose(target, want, atol=1e-6), (target - want).abs().max()


def test_td3_target_action_carries_clipped_gaussian_noise(monkeypatch):
    B, max_a = 40_000, 2.0
    rnm_td3, cfg, agent, batch = td3_setup(B, max_a=max_a, gamma=1.0, policy_delay=2)
    obs, action, _, next_obs, _ = batch
    batch = (obs, action, torch.zeros(B, 1), next_obs, torch.zeros(B, 1))
    # target actor 0 (tanh 0 = 0) and Q' = the action: the target is the target action itself
    agent["actor_t"] = Const(lambda s: torch.zeros(len(s), 1))
    for name in ("critic1_t", "critic2_t"):
        agent[name] = Const(lambda sa: sa[:, -1:])
    noise = td3_target(monkeypatch, rnm_td3, agent, batch, cfg)[:, 0] / max_a  # action units
    sigma, clip = cfg.policy_noise, cfg.noise_clip
    assert (sigma, clip) == (0.2, 0.5)  # TD3's published values
    # clipped: nothing past the clip, and the mass beyond it sits on it (P(|z| > 2.5) = 1.24%)
    assert noise.abs().max() == pytest.approx(clip)
    at_clip = (noise.abs() > clip - 1e-6).float().mean().item()
    tail = math.erfc(clip / sigma / math.sqrt(2))
    assert abs(at_clip - tail) < 0.003, (at_clip, tail)
    # Gaussian inside the clip: the empirical CDF against the normal one, at a few points
    for x in (-0.3, -0.1, 0.0, 0.05, 0.2, 0.4):
        cdf = 0.5 * (1 + math.erf(x / sigma / math.sqrt(2)))
        assert abs((noise <= x).float().mean().item() - cdf) < 0.01, x
    assert len(noise.unique()) > B // 2  # a fresh draw per row


# ----------------------------------------------------------------------------- HiReLC

# a known landscape: the p5 a block's setting costs, times the block's sensitivity
DAMAGE = {"dense": 0.0, "6:8": 0.03, "4:8": 0.06, "2:4": 0.1, "1:4": 0.3,
          "bf16": 0.0, "fp8": 0.02, "int8": 0.05}
SENS = [0.5, 1.0, 1.5]


def landscape_p5(setting):
    return 1.0 - sum(s * (DAMAGE[p] + DAMAGE[q]) for s, (p, q) in zip(SENS, setting))


class LandscapeEvaluator:
    """hirelc.Evaluator's interface over the known landscape: real() is the measurement, proxy()
    a logit MSE that the p5 fit can invert."""

    def __init__(self):
        self.cache, self.n_real, self.n_proxy = {}, 0, 0

    def real(self, setting):
        key = tuple(setting)
        if key not in self.cache:
            self.n_real += 1
            p5 = landscape_p5(setting)
            self.cache[key] = dict(p5_bins=[p5, p5 + 0.01], p5=p5, mean=1 - (1 - p5) / 3)
        return self.cache[key]

    def proxy(self, setting):
        self.n_proxy += 1
        return ((1 - landscape_p5(setting)) / 2) ** 2


def hirelc_cost(hirelc):
    return hirelc.CostModel([[(128, 64), (64, 128)]] * 3, (30, 64), rows=128)


def test_hirelc_search_meets_a_threshold_that_binds(monkeypatch):
    hirelc = load_example("hirelc")
    cost, budget, thr = hirelc_cost(hirelc), 0.6, 0.85
    every = [list(s) for s in itertools.product(itertools.product(hirelc.PATTERNS,
                                                                  hirelc.PRECISIONS), repeat=3)]
    fits = [s for s in every if cost.within(s, budget)]
    ok = [s for s in fits if landscape_p5(s) >= thr]
    # the threshold binds: the fastest settings within the budget miss it, many others too
    assert ok and len(ok) < 0.7 * len(fits)
    fastest = max(fits, key=cost.speed)
    assert landscape_p5(fastest) < thr
    args, _ = hirelc.parse_args(["--episodes=40", "--max_real=10", f"--threshold={thr}",
                                 "--n_bins=2"])
    ev = LandscapeEvaluator()
    best, counts = hirelc.search(ev, SENS, cost, budget, args, lambda s: None)
    assert best is not None and cost.within(best, budget)
    assert ev.real(best)["p5"] >= thr, (best, landscape_p5(best))
    # the search saw, for real, faster settings within the budget that the threshold turned down
    rejected = [k for k, r in ev.cache.items() if r["p5"] < thr and cost.within(list(k), budget)
                and cost.speed(list(k)) > cost.speed(best)]
    assert rejected
    # and its choice is a good one among those that meet the threshold
    assert cost.speed(best) >= 0.8 * max(cost.speed(s) for s in ok)
    # a surrogate that promises every setting passes cannot pass one off: the real p5 decides
    monkeypatch.setattr(hirelc.Surrogate, "add", lambda self, s, y: self.x.append(s))
    monkeypatch.setattr(hirelc.Surrogate, "predict", lambda self, s: 1.0)
    ev = LandscapeEvaluator()
    best, _ = hirelc.search(ev, SENS, cost, budget, args, lambda s: None)
    assert best is not None and ev.real(best)["p5"] >= thr, (best, landscape_p5(best))
    assert any(r["p5"] < thr for r in ev.cache.values())  # it was offered failing ones


def test_hirelc_surrogate_depends_on_the_setting_and_fits_its_points():
    hirelc = load_example("hirelc")
    sur = hirelc.Surrogate(3, 2, seed=0)
    settings = [[("dense", "bf16")] * 3, [("1:4", "int8")] * 3, [("2:4", "fp8")] * 3,
                [("dense", "bf16"), ("2:4", "bf16"), ("1:4", "fp8")],
                [("1:4", "int8"), ("dense", "fp8"), ("dense", "bf16")],
                [("4:8", "bf16"), ("6:8", "int8"), ("2:4", "bf16")],
                [("6:8", "fp8"), ("1:4", "bf16"), ("4:8", "int8")],
                [("dense", "int8"), ("4:8", "fp8"), ("6:8", "bf16")]]
    ys = [landscape_p5(s) for s in settings]
    assert max(ys) - min(ys) > 0.5
    for s, y in zip(settings[:-1], ys):  # the data so far, then one more point: a refit on all
        sur.x.append(sur.features(s))
        sur.y.append(torch.tensor([y, y + 0.01]))
    sur.add(settings[-1], [ys[-1], ys[-1] + 0.01])
    pred = [sur.predict(s) for s in settings]
    assert max(abs(p - y) for p, y in zip(pred, ys)) < 0.03, list(zip(pred, ys))
    # a setting changes the prediction: the two ends of the landscape are told apart
    assert sur.predict(settings[0]) - sur.predict(settings[1]) > 0.5


# ----------------------------------------------------------------------------- MoE router replay


class Unit(nn.Module):
    """An expert whose output is its own one-hot: the MoE's output row is then its gate weights."""

    def __init__(self, e):
        super().__init__()
        self.e = e

    def forward(self, x):
        out = torch.zeros_like(x)
        out[:, self.e] = 1
        return out


@pytest.mark.parametrize("norm", [True, False])
def test_router_replay_weighs_replayed_experts_by_the_current_router(norm):
    E, k, C, N = 6, 2, 8, 40
    cfg = types.SimpleNamespace(num_experts_per_tok=k, norm_topk_prob=norm, hidden_size=C,
                                num_experts=E)
    torch.manual_seed(0)
    moe = MoE(cfg, iter(Unit(e) for e in range(E)).__next__).double()
    with torch.no_grad():
        moe.gate.weight.normal_(0, 1)
    x = torch.randn(1, N, C, dtype=torch.float64)
    probs = torch.softmax(x[0] @ moe.gate.weight.T, -1)  # (N, E), by hand
    own = probs.topk(k, -1).indices
    rec = probs.topk(k, -1, largest=False).indices  # the router's two least likely: not its own
    rec[N // 2:] = -1  # unrecorded rows route by the router's own top-k
    moe.replay = rec.to(torch.int16)
    w = moe(x)[0, :, :E]  # (N, E): each expert's gate weight
    idx = torch.where(rec >= 0, rec, own)
    want = torch.zeros(N, E, dtype=torch.float64)
    pick = probs.gather(-1, idx)
    want.scatter_(-1, idx, pick / pick.sum(-1, keepdim=True) if norm else pick)
    assert torch.equal(moe.last_experts, idx)
    assert (w - want).abs().max() < 1e-12, (w - want).abs().max().item()
    w[:N // 2].pow(2).sum().backward()  # the replayed rows' weights reach the router
    assert moe.gate.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- sampling


class CharTok:  # what the engine needs of a tokenizer: pad 0, eos 1
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["" for _ in rows]


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_engine_samples_softmax_of_logits_over_temperature(temperature):
    """Token frequencies of the engine's first two steps (prefill, then one decode step) against
    softmax(logits / T) of a plain forward, by chi-square; the reported log-probs exactly."""
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=24, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                intermediate_size=64)).eval()
    with torch.no_grad():  # logits of std T: softmax(logits / T) spreads over the vocabulary
        m.lm_head.weight.mul_(temperature / m(torch.tensor([[5, 6, 7, 8]]))[0, -1].std())
    prompt, N = [5, 6, 7, 8], 3000
    ro = Engine(m, CharTok(), max_new_tokens=2, temperature=temperature).generate([prompt], N,
                                                                                  seed=3)
    with torch.no_grad():
        logp = F.log_softmax(m(torch.tensor([prompt]))[0, -1].double() / temperature, -1)
    first = ro.tokens[:, 0]
    stat, df = chi_square(torch.bincount(first, minlength=24), logp.exp())
    assert stat < chi_limit(df), (stat, df)
    assert torch.allclose(ro.logp[:, 0].double(), logp[first], atol=1e-4)
    # the decode step, given the most frequent first token (when it is not EOS)
    t = int(torch.bincount(first[first != 1]).argmax())
    rows = (first == t) & ro.mask[:, 1]
    with torch.no_grad():
        logp2 = F.log_softmax(m(torch.tensor([prompt + [t]]))[0, -1].double() / temperature, -1)
    stat, df = chi_square(torch.bincount(ro.tokens[rows, 1], minlength=24), logp2.exp())
    assert rows.sum() > 300 and stat < chi_limit(df), (stat, df)


# ----------------------------------------------------------------------------- the loop


@pytest.mark.parametrize("form", ["fp8", "nm2:4", "plan"])
def test_rollout_copy_tracks_the_policy_through_the_loop(tmp_path, monkeypatch, form):
    """train.main with a cheaper rollout copy: after the updates, the copy the loop generated with
    is exactly the copy re-derived from the updated policy (and not the one from the start)."""
    from fake_reward import use_parity_reward
    from test_train import TINY_RUN
    use_parity_reward(monkeypatch.setattr)
    if form == "plan":  # a searched copy: examples/hirelc.py's plan file
        form = str(tmp_path / "plan.json")
        load_example("hirelc").write_plan(form, ["model.layers.0"], [("2:4", "int8")])
    runs, real_build = [], train.build

    def build(cfg, *a, **k):
        run = real_build(cfg, *a, **k)
        runs.append((run, copies.make_rollout_copy(run.model, form).state_dict()))
        return run

    monkeypatch.setattr(train, "build", build)
    recs = train.main(TINY_RUN + ["--steps=2", f"--rollout_copy={form}", "--is_correction=tis",
                                  f"--out_dir={tmp_path / 'run'}", "--save_every=100"])["records"]
    assert any(r["tokens"] > 0 for r in recs)  # the policy was updated
    (run, start), = runs
    got = run.sparse.rollout_model
    assert got is not run.model and got.rollout_form == copies.parse_form(form)[3]
    want = copies.make_rollout_copy(run.model, form).state_dict()
    assert set(got.state_dict()) == set(want)
    stale = [k for k, v in got.state_dict().items() if not torch.equal(v, want[k])]
    assert not stale, f"the copy lags the policy in {stale[:3]}"
    assert any(not torch.equal(v, start[k]) for k, v in want.items())  # it did move


# ----------------------------------------------------------------------------- checkpoints


class Sampler:  # what save_checkpoint and load_checkpoint ask of the prompt sampler
    def __init__(self, pos=0):
        self.pos = pos

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, d):
        self.pos = d["pos"]


def test_a_checkpoint_save_killed_mid_write_leaves_the_last_one_loadable(tmp_path, monkeypatch):
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    cfg = config.parse_config([f"--out_dir={tmp_path / 'run'}"])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    intermediate_size=64))
    opt = torch.optim.AdamW(model.parameters())

    def save(step):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        checkpoint.save_checkpoint(cfg, model, tok, opt, Sampler(step), step, [step], {})

    def loaded():
        fresh = Transformer(model.config)
        sampler = Sampler()
        step, hist = checkpoint.load_checkpoint(cfg, fresh, torch.optim.AdamW(fresh.parameters()),
                                                sampler, torch.device("cpu"), {})
        vals = {p.unique().item() for p in fresh.parameters()}
        return step, hist, sampler.pos, vals

    class Killed(Exception):
        pass

    def cut_and_die(path):  # half the file on disk, then the process is gone
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        raise Killed

    save(3)
    assert loaded() == (3, [3], 3, {3.0})
    real_save_pretrained, real_torch_save, real_replace = (model.save_pretrained, torch.save,
                                                           os.replace)
    # killed while the weights are written, while the trainer state is, and between the renames
    monkeypatch.setattr(model, "save_pretrained", lambda d: (
        real_save_pretrained(d), cut_and_die(os.path.join(d, "model.safetensors"))))
    with pytest.raises(Killed):
        save(4)
    assert loaded() == (3, [3], 3, {3.0})
    monkeypatch.setattr(model, "save_pretrained", real_save_pretrained)
    monkeypatch.setattr(checkpoint.torch, "save", lambda obj, path: (real_torch_save(obj, path),
                                                                     cut_and_die(path)))
    with pytest.raises(Killed):
        save(5)
    assert loaded() == (3, [3], 3, {3.0})
    monkeypatch.undo()

    def replace_then_die(a, b):
        if a.endswith(".tmp"):  # the old folder moved aside, the new one not yet in place
            raise Killed
        real_replace(a, b)

    monkeypatch.setattr(checkpoint.os, "replace", replace_then_die)
    with pytest.raises(Killed):
        save(6)
    assert not os.path.exists(os.path.join(cfg.out_dir, "ckpt"))
    assert loaded() == (3, [3], 3, {3.0})  # from ckpt.old
    monkeypatch.undo()
    save(7)  # and the next complete save is the one loaded
    assert loaded() == (7, [7], 7, {7.0})
