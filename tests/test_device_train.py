"""Device discipline on the training side: every tensor that the update, MoE router replay,
DistillSparse and the weight sync make names its device (the run's, or the host on purpose). With
torch's default device set to `meta` after the model is built, a factory left to the default makes
a meta tensor, which fails as soon as it meets real data: these steps run to the end on the CPU."""
import contextlib
import copy

import pytest
import torch

import config
import update
from distill import DistillSparse
from model import ModelConfig, Transformer
from moe import Recorder, Routes, disagreement, moe_layers, replay_batch
from sync import Receiver, Sender, Update

CPU, G = torch.device("cpu"), 4


@contextlib.contextmanager
def default_device_meta():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        # None, not cpu: a default device is a torch-function mode that would stay on and
        # re-enter every torch function in the tests after this one
        torch.set_default_device(None)


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=30, hidden_size=32, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   intermediate_size=64, **kw))


def moe_tiny(seed=0):
    return tiny(seed, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def groups(seed=0, routes_of=None, pages=None):
    """Two kept groups of G rows on the host, as stages 1-3 hand them over: prompts of 5 and 3
    tokens, completions of 2 to 7 tokens. routes_of: an MoE model (each group's Routes); pages:
    (sparse layers, KV heads, pages) of a DistillSparse record."""
    gen = torch.Generator().manual_seed(seed)
    pool, kept = [[3, 4, 5, 6, 7], [8, 9, 10]], []
    for g, p in enumerate(pool):
        tokens = torch.randint(2, 30, (G, 7), generator=gen)
        mask = torch.arange(7) < torch.randint(2, 8, (G, 1), generator=gen)
        routes = None
        if routes_of is not None:
            L, k, E = len(moe_layers(routes_of)), routes_of.config.num_experts_per_tok, 4
            ids = lambda *s: torch.randint(0, E, (*s, L, k), generator=gen).to(torch.int16)
            routes = Routes([ids(len(p))], torch.zeros(G, dtype=torch.long), ids(G, 7))
        rec = None if pages is None else torch.rand(G, 7, *pages, generator=gen) < 0.5
        kept.append(update.Group(g, tokens, mask, torch.tensor([1.0, 0.0, 0.5, 0.0]),
                                 torch.randn(G, 7, generator=gen) - 2, rec,
                                 torch.zeros(G, dtype=torch.bool), routes))
    return pool, kept


def learn(cfg, m, kept, pool, ref=None, dense_dist=False):
    """train.py's `learn`, the parts this side owns: the batch, the routes, train_on."""
    ids, tmask, adv, roll = update.batch_from_groups(kept, pool, G, 0, 1e-6, CPU)
    routes = (replay_batch([k.routes for k in kept], [k.mask for k in kept], ids.shape).to(CPU)
              if kept[0].routes is not None else None)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    out = update.train_on(cfg, m, opt, ids, tmask, adv, 1, roll, ref_model=ref,
                          dense_dist=dense_dist, routes=routes)
    return out, (ids, tmask, adv, roll)


def on_meta_as_off(build, run):
    """run(*build()) twice, each on objects built on the CPU: with the default device as it is,
    then set to meta. A factory left to the default makes a meta tensor: it raises where it meets
    real data, or (indexing a host tensor) reads garbage or writes nothing. Either way the second
    run fails or differs. -> the first run's results."""
    want = run(*build())
    objs = build()
    with default_device_meta():
        got = run(*objs)
    for k in want:  # tensors on the CPU and equal; numbers equal
        if torch.is_tensor(want[k]):
            assert got[k].device == CPU and torch.equal(got[k], want[k]), k
        else:
            assert got[k] == want[k], k
    return want


def changed(before, m):
    return any(not torch.equal(before[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("share_prompt,passes,minibatches,pack", [
    (False, 2, 2, "off"),  # logp_old's own pass, two micro-batches a step
    (True, 1, 1, "off"),  # the shared prompt (PromptOnce), one step: no logp_old pass
    (True, 2, 1, "off"),
    (False, 1, 2, "on"),  # packed rows on SDPA (the mask made once per forward)
])
def test_a_training_step_makes_every_tensor_on_its_device(share_prompt, passes, minibatches,
                                                          pack):
    pool, kept = groups()
    ids, tmask = update.batch_from_groups(kept, pool, G, 0, 1e-6, CPU)[:2]
    lens = (tmask.flip(1).cumsum(1).flip(1) > 0).sum(1) + 1
    assert update.split_prompts(ids, tmask, lens) is not None  # a group's rows share their prompt
    cfg = config.Config(micro_batch=4, group_size=G, share_prompt=share_prompt, passes=passes,
                        minibatches=minibatches, pack=pack, kl_coef=0.05)

    def run(m, ref):
        before = copy.deepcopy(m.state_dict())
        out, _ = learn(cfg, m, kept, pool, ref=ref)
        assert out["stats"][1] > 0 and out["stats"][3] == 0 and changed(before, m)
        return {"stats": out["stats"], **m.state_dict()}

    on_meta_as_off(lambda: (tiny(), tiny().requires_grad_(False)), run)


def test_moe_router_replay_and_its_recording_make_every_tensor_on_its_device():
    pool, kept = groups(routes_of=moe_tiny())
    cfg = config.Config(micro_batch=4, group_size=G, router_replay="update", moe_aux_coef=0.01,
                        passes=2)

    def run(m):
        before = copy.deepcopy(m.state_dict())
        out, (ids, tmask, _, _) = learn(cfg, m, kept, pool)
        assert out["moe_aux"] > 0 and changed(before, m)
        routes = replay_batch([k.routes.take(range(2)) for k in kept],
                              [k.mask[:2] for k in kept], ids[[0, 1, 4, 5]].shape)
        with torch.no_grad():  # the engine's side: what a prefill and a decode step record
            rec = Recorder(moe_layers(m), 2)
            m(ids[[0, 4], :5])
            rec.add("prefill", [(5, [0]), (3, [1])])
            m(ids[[0, 4], 5:6])
            rec.add("decode", [0, 1])
            got = rec.result(4)
            m(ids[[0, 1, 4, 5]])
            diff = disagreement(m, routes, tmask[[0, 1, 4, 5]])
        return {"routes": routes, "completion": got.completion, "prompt_of": got.prompt_of,
                "diff": diff, "aux": out["moe_aux"],
                **m.state_dict()}

    got = on_meta_as_off(lambda: (moe_tiny(),), run)
    assert (got["completion"][:, 0] >= 0).all()  # the decode step was filed


def test_distill_sparse_makes_every_tensor_on_its_device():
    pool, kept = groups(pages=(2, 2, 8))
    cfg = config.Config(micro_batch=4, group_size=G)

    def build():
        m = tiny()
        return m, DistillSparse(m, r=4, lr=1e-2, page_size=2, dense_layers=1, micro_batch=4,
                                pg=True)

    def run(m, ds):
        before = copy.deepcopy(ds.model.state_dict())
        out, (ids, tmask, adv, roll) = learn(cfg, m, kept, pool, dense_dist=True)
        pg = lambda lp, rows: update.pg_loss(lp, roll[rows], adv[rows], tmask[rows], 0.2, 0.28)[0]
        figs = ds.step_on(kept, [len(pool[k.prompt]) for k in kept], G, ids, tmask,
                          out["_dense_full"], pg)
        assert figs["distill_kl"] > 0 and changed(before, ds.model)
        ds.refresh(m)
        return {"kl": figs["distill_kl"], **ds.model.state_dict()}

    on_meta_as_off(build, run)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sync_full_then_delta_makes_every_tensor_on_its_device(dtype):
    pool, kept = groups()

    def run(m, rollout):
        sender, receiver = Sender(m, dtype=dtype), Receiver(rollout)
        receiver.apply(Update.from_bytes(sender.make_update().to_bytes()))  # a full update
        learn(config.Config(micro_batch=8, group_size=G), m, kept, pool)
        with torch.no_grad():
            m.model.layers[0].mlp.up_proj.weight[0, :3] += 1.0  # a few elements: indices
        delta = sender.make_update()
        receiver.apply(Update.from_bytes(delta.to_bytes()))
        assert delta.kind == "delta" and receiver.checksum() == sender.checksum()
        assert all(torch.equal(a.to(dtype), b) for a, b in zip(m.state_dict().values(),
                                                                rollout.state_dict().values()))
        return {"bytes": delta.nbytes, **rollout.state_dict()}

    on_meta_as_off(lambda: (tiny(), tiny().to(dtype)), run)
