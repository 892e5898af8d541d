"""DistillSparse: the replay of recorded page selections reproduces the sparse engine's log-probs,
the adapter is off for the policy, and training it pulls the sparse policy toward the dense one
(alpha's tail rises)."""
import torch

from distill import DistillSparse, ReplayCache, replay_logprobs
from model import ModelConfig, Transformer
from rollout import Engine
from sparsity import dense_logprobs, fixed_budget
from update import Group
from tests.test_rollout import CharTok

PROMPTS = [[3 + (i * 7 + j * 3) % 26 for j in range(n)] for i, n in enumerate([21, 13, 30])]


def model4(seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=30, hidden_size=32, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   intermediate_size=64)).eval()


def batch(ro):
    from update import build_batch
    p_ids = [PROMPTS[int(i)] for i in ro.prompt_index]
    ids, tmask = build_batch(p_ids, list(ro.tokens), list(ro.mask), 0)
    return ids, tmask, torch.tensor([len(p) for p in p_ids])


def sparse_rollouts(m, seed=0, G=4):
    eng = Engine(m, CharTok(), max_new_tokens=24, temperature=1.0, page_size=4,
                 sparse=fixed_budget(3), keep_recent=1, dense_layers=1, record_pages=True,
                 eos_ids=[])
    return eng.generate(PROMPTS, G, seed=seed)


def test_replay_reproduces_the_sparse_engine():
    m = model4()
    ro = sparse_rollouts(m)
    assert ro.read_pages.shape[:3] == (12, ro.tokens.shape[1], 2) and not ro.read_pages[:, 0].any()
    # fixed budget 3 (the partial page may add one)
    assert ro.read_pages[:, 1:].sum(-1).le(3 + 1).all()
    ids, tmask, plen = batch(ro)
    with torch.no_grad():
        lp, full = replay_logprobs(m, ids, tmask, ro.read_pages, plen, page_size=4, dense_layers=1)
        dense = dense_logprobs(m, PROMPTS, ro)
    got = torch.zeros_like(ro.logp)
    got[ro.mask] = lp[tmask]
    assert torch.allclose(got, ro.logp, atol=1e-5, rtol=0)
    # the budget is small enough that sparse differs from dense
    assert (got - dense).abs().max() > 1e-3
    assert torch.allclose(full.exp().sum(-1), torch.ones(full.shape[0]), atol=1e-5)


def test_replay_mask_is_causal_and_dense_in_the_prompt():
    read = torch.zeros(1, 3, 1, 1, 4, dtype=torch.bool)
    read[0, 1, 0, 0, 0] = read[0, 2, 0, 0, 2] = True  # token 1 read page 0; token 2 read page 2
    m = ReplayCache(read, [5], page_size=2, dense_layers=0).mask(0, 7, "cpu")[0, 0]
    # prompt and token 0: causal
    assert torch.equal(m[:5], torch.ones(7, 7, dtype=torch.bool).tril()[:5])
    assert m[5].tolist() == [True, True] + [False] * 5  # query 5 produced token 1: page 0 only
    # query 6 produced token 2: page 2 only
    assert m[6].tolist() == [False] * 4 + [True, True, False]


def test_a_query_that_read_no_page_sees_itself_not_an_empty_row():
    read = torch.zeros(1, 3, 1, 1, 4, dtype=torch.bool)  # a padded record: token 1 read nothing
    read[0, 2, 0, 0, 0] = True
    m = ReplayCache(read, [5], page_size=2, dense_layers=0).mask(0, 7, "cpu")[0, 0]
    assert m.any(-1).all()  # no backend meets an all-masked row
    assert m[5].tolist() == [False] * 5 + [True, False]  # the empty query sees only itself
    assert m[6].tolist() == [True, True] + [False] * 5  # a real record is unchanged


def test_adapter_starts_as_the_policy_and_refresh_keeps_it():
    m = model4()
    ds = DistillSparse(m, r=4, page_size=4, dense_layers=1)
    x = torch.tensor([PROMPTS[0]])
    assert torch.allclose(ds.model(x), m(x), atol=1e-6)  # LoRA B starts at zero
    assert all(not p.requires_grad for n, p in ds.model.named_parameters() if ".lora_" not in n)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01)
        next(p for n, p in ds.model.named_parameters() if "lora_B" in n).fill_(0.1)
    ds.refresh(m)
    from model import set_lora_enabled
    set_lora_enabled(ds.model, False)
    assert torch.allclose(ds.model(x), m(x), atol=1e-6)  # the base follows the policy
    set_lora_enabled(ds.model, True)
    assert not torch.allclose(ds.model(x), m(x), atol=1e-4)  # and the adapter is still there


def test_distillation_raises_alpha_at_a_fixed_budget():
    """On a fixed batch of sparse rollouts: the adapter's steps lower KL(dense || sparse) and raise
    the tail of the exact per-position alpha (sum_v min(p_dense, p_sparse), from the replay's full
    distributions)."""
    from sparsity import alpha_exact
    from update import token_logprobs
    m = model4(seed=1)
    ds = DistillSparse(m, r=4, lr=3e-3, page_size=4, dense_layers=1)
    ro = sparse_rollouts(ds.model, seed=0, G=8)
    ids, tmask, plen = batch(ro)
    with torch.no_grad():
        _, dense_full = token_logprobs(m, ids, tmask, full=True)

    def alpha():
        with torch.no_grad():
            _, sparse_full = replay_logprobs(ds.model, ids, tmask, ro.read_pages, plen, 4, 1)
        return alpha_exact(dense_full, sparse_full)

    before = alpha()
    kl = [ds.update(ids, tmask, ro.read_pages, plen, dense_full)["distill_kl"] for _ in range(10)]
    after = alpha()
    assert kl[-1] < 0.5 * kl[0], kl
    # the tail's distance from 1
    gap_before, gap_after = 1 - before.quantile(0.05), 1 - after.quantile(0.05)
    assert gap_after < 0.7 * gap_before and after.mean() > before.mean(), (gap_before, gap_after)


def test_step_on_pads_the_page_records_of_refill_tries_to_one_shape():
    """Kept groups from two refill tries: records of different lengths and page counts, one longer
    than any kept row's prompt + completion (its try's longest row was in a dropped group)."""
    ds = DistillSparse(model4(), r=4, page_size=4, dense_layers=1)
    torch.manual_seed(0)
    # (rows, Tc, layers, H_kv, pages)
    a, b = torch.rand(2, 10, 2, 2, 5) > 0.5, torch.rand(2, 4, 2, 2, 7) > 0.5
    kept = [Group(0, None, None, None, None, a), Group(1, None, None, None, None, b)]
    got = {}
    ds.update = (lambda ids, tmask, pages, plen, dense_full, pg=None:
                 got.update(pages=pages, plen=plen))
    ds.step_on(kept, [3, 2], 2, torch.zeros(4, 6, dtype=torch.long),
               torch.zeros(4, 6, dtype=torch.bool), None)
    p = got["pages"]
    assert p.shape == (4, 10, 2, 2, 7) and got["plen"].tolist() == [3, 3, 2, 2]
    assert torch.equal(p[:2, :, :, :, :5], a) and not p[:2, :, :, :, 5:].any()
    assert torch.equal(p[2:, :4], b) and not p[2:, 4:].any()


def test_the_adapter_as_a_speculative_draft_raises_acceptance():
    """Speculative mode: the policy verifies, DistillSparse's copy drafts (Engine(draft=)) with its
    selections recorded at each row's own positions. Steps on those records toward the dense
    distribution cut the rejections of fresh rollouts at the same seeds; the policy's samples
    are untouched in law (tests/test_speculative.py). With the adapter not drafting (or not
    trained), nothing moves: the same seeds draw the same variates, so the counts are equal.
        This random model's distributions are nearly flat (a random draft of the same shapes is
    still accepted 85% of the time; the sparse one about 97%), so a call's acceptance moves by
    a few hundredths between seeds: the rejections are pooled over four seeds."""
    from update import token_logprobs
    m = model4(seed=1)
    ds = DistillSparse(m, r=4, lr=3e-3, page_size=4, dense_layers=1)
    eng = Engine(m, CharTok(), max_new_tokens=24, temperature=1.0, page_size=4,
                 sparse=fixed_budget(3), keep_recent=1, dense_layers=1, record_pages=True,
                 eos_ids=[], speculative=4, draft=ds.model)
    ro = eng.generate(PROMPTS, 8, seed=0)
    assert ro.read_pages is not None and ro.read_pages.shape[:2] == ro.tokens.shape
    # every scored token has a record (the bonus tokens: every page)
    assert ro.read_pages[:, 1:].any(-1).all(-1).all(-1)[ro.mask[:, 1:]].all()
    # a drafted token read its budget, not every page: only the bonus tokens (after 4 accepted
    # drafts, at most 1 in 5 tokens) read them all
    full = ro.read_pages[:, 1:].all(-1).all(-1).all(-1)[ro.mask[:, 1:]].float().mean()
    assert 0 < full <= 0.2, full
    ids, tmask, plen = batch(ro)
    with torch.no_grad():
        _, dense_full = token_logprobs(m, ids, tmask, full=True)

    def rejected():  # the share of drafts rejected, pooled over four calls
        t = [eng.generate(PROMPTS, 8, seed=s).timings for s in range(4)]
        return 1 - sum(x["accepted"] for x in t) / sum(x["drafted"] for x in t)

    before = rejected()
    for _ in range(30):
        ds.update(ids, tmask, ro.read_pages, plen, dense_full)
    after = rejected()
    assert after < 0.7 * before, (before, after)
