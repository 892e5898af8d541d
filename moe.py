"""
moe.py: the Qwen3-MoE block and router replay (R3). The rollout engine records which experts every
MoE layer chose for every token; the trainer's forward can route through those instead of its own
top-k, so that a rollout copy in another precision and the trainer run the same experts.

    moe = MoE(cfg, lambda: MLP(cfg.hidden_size, cfg.moe_intermediate_size))  # model.py's Block
    ro = engine.generate(prompt_ids, G)   # on an MoE model: ro.experts, a Routes (the engine
                                          # records through moe.record_routes)
    r = ro.experts.take(range(0, G))      # one group's rows (the shared prompt stays one entry)
    routes = replay_batch([r], [ro.mask[:G]], ids.shape)  # laid out as update.build_batch's ids:
                                          # (B, T, MoE layers, k), -1 where nothing was recorded
    aux = []
    with replaying(model, routes, aux=aux):  # these forwards use the recorded experts
        logits = model(ids)
    torch.stack(aux).mean()               # the load-balancing loss, over the MoE layers
    python train.py configs/tiny_moe.py   # replay in the loop (config key router_replay)
    python -m pytest -q tests/test_moe_replay.py

Router replay, as the trainer does it:
    1. The recorded ids replace the router's own top-k: the same experts run in both.
    2. The gate weights are the CURRENT router's probabilities at those ids (renormalised over the
       k when norm_topk_prob), so the router still gets a gradient.
    3. A row of -1 ids (padding, and the last sampled token, which the engine never feeds back)
       routes by the router's own top-k: no scored log-prob depends on it.

Recording: `last_experts` (tokens, k) holds the experts of a module's last forward. The engine's
cache calls Recorder.add after each forward: at prefill, one batch row per distinct prompt, whose
ids are stored once for the rows that share it; at decode, one token per live row.

Simplifications:
    1. Experts run as a loop over the experts that received tokens (the reference implementation's
       way); no grouped-GEMM kernel.
    2. The load-balancing loss is Switch's, per layer, averaged over the MoE layers:
       E * sum_e f_e * P_e, where f_e is the share of the k * tokens picks that went to e (the
       experts the forward used: the replayed ones under replay) and P_e the mean router
       probability; 1 when balanced. Only the forward's real tokens count (`valid`).
    3. Expert ids are stored as int16 (up to 32,767 experts), on the CPU once the call ends.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MoE(nn.Module):
    """Softmax router over all experts, keep the top-k (or the replayed ids), optionally
    renormalise their weights to sum to one. `expert` builds one expert (an MLP)."""

    def __init__(self, cfg, expert):
        super().__init__()
        self.k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(expert() for _ in range(cfg.num_experts))
        # last_experts: the (tokens, k) ids the last forward used; replay: (tokens, k) ids to use
        # instead (-1 rows: the router's own); valid: (tokens,) bool, the tokens the balance loss
        # counts; aux: a list each forward appends its balance loss to (set by `replaying`)
        self.last_experts = self.replay = self.valid = self.aux = None

    def forward(self, x):
        B, T, C = x.shape
        x = x.reshape(-1, C)  # (N, C)
        # (N, E) in fp32 at least (fp64 stays fp64: the finite-difference test)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.promote_types(x.dtype, torch.float32))
        w, idx = probs.topk(self.k, dim=-1)  # (N, k)
        if self.replay is not None:
            rec = self.replay.to(x.device).reshape(-1, self.k).long()
            # the recorded experts, weighted by this forward's router: the router keeps a gradient
            idx = torch.where((rec >= 0).all(-1, keepdim=True), rec, idx)
            w = probs.gather(-1, idx)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        self.last_experts = idx.detach()
        if self.aux is not None:
            self.aux.append(balance_term(probs, idx, self.valid))
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():  # CPU-GPU sync point; fine at reference scale
            tok, slot = torch.where(idx == e)  # the tokens routed to e, and which of their k picks
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])  # sum over k
        return out.view(B, T, C)


def balance_term(probs, idx, valid=None):
    """Switch's load-balancing loss of one layer: E * sum_e f_e * P_e over the valid tokens, f_e
    the share of the picks `idx` (N, k) that went to expert e, P_e its mean probability (N, E)."""
    if valid is not None:
        valid = valid.to(probs.device).reshape(-1)
        probs, idx = probs[valid], idx[valid]
    E = probs.shape[-1]
    if probs.shape[0] == 0:
        return probs.sum() * 0.0
    f = torch.bincount(idx.flatten(), minlength=E).float() / idx.numel()  # no gradient: counts
    return E * (f * probs.mean(0)).sum()


def moe_layers(model):
    """The MoE blocks of a model, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


@contextlib.contextmanager
def replaying(model, routes=None, valid=None, aux=None):
    """Within the block, each MoE layer i routes by routes[..., i, :] ((B, T, layers, k), -1 rows:
    the router's own) and, when `aux` is a list, appends its load-balancing loss over the `valid`
    (B, T) tokens to it. None: own routing / every token. The tokens are the forward's, in its
    layout: padded (B, T) or packed (1, N). The mean of `aux` is the model's balance loss."""
    layers = moe_layers(model)
    try:
        for i, m in enumerate(layers):
            m.replay = None if routes is None else routes[..., i, :]
            m.valid, m.aux = valid, aux
        yield
    finally:
        for m in layers:
            m.replay = m.valid = m.aux = None


def disagreement(model, routes, where):
    """How the experts the last forward used differ from `routes` (B, T, layers, k) at the `where`
    (B, T) tokens: (share of the k * layers picks not in the other side's set, share of the tokens
    with a different set in at least one layer). Exactly (0, 0) under replay of `routes`."""
    layers = moe_layers(model)
    t = layers[0].last_experts.shape[0] // max(1, where.shape[0])  # cut to the longest row
    where, routes = where[:, :t], routes[:, :t]
    used = torch.stack([m.last_experts.view(*where.shape, -1) for m in layers], 2)  # (B, t, L, k)
    used, rec = used[where.to(used.device)].cpu(), routes[where.cpu()].long()  # (M, L, k)
    hit = (used[..., :, None] == rec[..., None, :]).any(-1)  # (M, L, k): a pick both sides made
    return 1 - hit.float().mean().item(), (~hit).any(-1).any(-1).float().mean().item()


# ----------------------------------------------------------- recording in the rollout engine


@dataclass
class Routes:
    """The experts an engine's model chose. prompts[j]: (len, layers, k) ids of distinct prompt j,
    stored once for every row that shares it; prompt_of (N,): each row's entry; completion (N, T,
    layers, k): the ids of each fed completion token, -1 where none ran (the last sampled token,
    padding)."""
    prompts: list
    prompt_of: torch.Tensor
    completion: torch.Tensor

    def take(self, rows):
        """The routes of some rows; the prompts they share stay one entry each."""
        rows = torch.as_tensor(list(rows), dtype=torch.long, device="cpu")  # Routes live there
        used = self.prompt_of[rows].unique()  # sorted
        return Routes([self.prompts[j] for j in used.tolist()],
                      torch.searchsorted(used, self.prompt_of[rows]), self.completion[rows])

    def sequence(self, i, n):
        """Row i's ids over its prompt and first n completion tokens: (len + n, layers, k)."""
        return torch.cat([self.prompts[int(self.prompt_of[i])], self.completion[i, :n]])


def replay_batch(parts, masks, shape):
    """Routes of the rows of a training batch laid out as update.build_batch lays them (prompt,
    then the sampled tokens, right-padded to shape (B, T)): parts, a Routes per block of rows, and
    masks, their (rows, T_completion) sampled-token masks -> (B, T, layers, k) int16, -1 where
    nothing was recorded."""
    seqs = [r.sequence(i, int(m[i].sum())) for r, m in zip(parts, masks) for i in range(len(m))]
    # on the host on purpose, as the Routes are: the trainer copies the whole batch to its device
    out = torch.full((shape[0], shape[1], *seqs[0].shape[1:]), -1, dtype=torch.int16,
                     device="cpu")
    for b, s in enumerate(seqs):
        out[b, :len(s)] = s
    return out


class Recorder:
    """What the engine's cache calls after each forward (PagedKVCache.advance): the expert ids of
    the forward, filed under the rows and positions the forward ran. `result` packs them."""

    def __init__(self, layers, N):
        self.layers, self.N = layers, N
        self.prompts, self.prompt_of, self.steps = [], [0] * N, []

    def _last(self):  # (tokens, layers, k) of the forward that just ran, kept on the device
        return torch.stack([m.last_experts for m in self.layers], 1).to(torch.int16)

    def add(self, mode, layout):
        """mode "prefill": layout[i] = (length, rows) of batch row i, a prompt those rows share;
        "decode": layout = the live rows, one new token each (their next completion position)."""
        if not self.layers:  # a dense model: nothing to record
            return
        ids = self._last()
        if mode == "prefill":
            ids = ids.view(len(layout), -1, *ids.shape[1:])  # (b, T, layers, k)
            for i, (n, rows) in enumerate(layout):
                for r in rows:
                    self.prompt_of[r] = len(self.prompts)
                self.prompts.append(ids[i, :n])
        else:
            self.steps.append((list(layout), ids))

    def result(self, T):
        """-> Routes on the CPU, completions padded to T positions (None: a dense model)."""
        if not self.layers:
            return None
        L, k = len(self.layers), self.layers[0].k
        comp = torch.full((self.N, T, L, k), -1, dtype=torch.int16, device="cpu")  # host: Routes
        for s, (rows, ids) in enumerate(self.steps):  # decode forward s fed completion token s
            comp[torch.tensor(rows, device="cpu"), s] = ids.cpu()
        prompt_of = torch.tensor(self.prompt_of, device="cpu")
        return Routes([p.cpu() for p in self.prompts], prompt_of, comp)


def record_routes(model, N):
    """A Recorder for an engine call of N rows on `model` (None, or a dense model: it does
    nothing)."""
    return Recorder(moe_layers(model) if model is not None else [], N)
