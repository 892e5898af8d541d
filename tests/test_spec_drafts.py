"""Drafts from text the group already has, in the engine (Engine(spec_draft="suffix" | "mix"),
drafts.py): every token stays an exact sample of the dense policy (chi-square against the
enumerated distribution), a prompt's earlier rollouts draft its later ones, the chooser mixes the
two drafters, and the acceptance of each drafter is logged, in the timings and the step record."""
import pytest
import torch

import speculative
from drafts import Choice, DraftStats, choose
from rollout import Engine
from sparsity import fixed_budget
from test_speculative import ONE_PAGE, PROMPT, Ids, chi2, chi2_critical, exact_dense, tiny_model


def mixed(monkeypatch):
    """The chooser's decisions follow measured seconds; here every round is mixed instead: the
    sparse draft runs, and of the rows with a suffix match every other one takes it."""
    def forced(lengths, *a):
        c = choose(lengths, *a)
        return Choice(c.k, True, [n > 0 and j % 2 == 0 for j, n in enumerate(lengths)], c.rate)
    monkeypatch.setattr(speculative, "choose", forced)


@pytest.mark.parametrize("mode,temperature,top_p", [("suffix", 1.0, 1.0), ("mix", 1.0, 1.0),
                                                    ("mix", 0.8, 0.9)])
def test_group_drafts_keep_the_samples_exact(mode, temperature, top_p, monkeypatch):
    """4,000 rows (two seeds) of one prompt, k = 3, drafted from the group's text (the prompt,
    the siblings so far, the earlier call's rows) or, mixed, per row from that or the one-page
    sparse draft: each position's marginal (1 to 3) and the joint of positions 1 and 2 pass a
    chi-square test at p = 1e-4 against the dense policy's exact distribution. Both drafters
    drafted in the mix (every round mixed: `mixed`), and the suffix drafts are often wrong (the
    test has teeth)."""
    if mode == "mix":
        mixed(monkeypatch)
    m, V, n = tiny_model(), 8, 4
    eng = Engine(m, Ids(), max_new_tokens=n, temperature=temperature, top_p=top_p,
                 eos_ids=[-1], speculative=3, spec_draft=mode, **ONE_PAGE)
    ros = [eng.generate([PROMPT], 2000, seed=s) for s in (0, 1)]
    drafted = {d: sum(ro.timings[f"{d}_drafted"] for ro in ros) for d in ("suffix", "sparse")}
    accepted = sum(ro.timings["suffix_accepted"] for ro in ros)
    assert drafted["suffix"] > 1000 and accepted / drafted["suffix"] < 0.8
    assert (drafted["sparse"] > 1000) == (mode == "mix")
    toks = torch.cat([ro.tokens for ro in ros])  # (4000, n)
    joint = exact_dense(m, PROMPT, n, temperature, top_p)  # (V, V, V, V)
    for pos in (1, 2, 3):
        marg = joint.sum(dim=[d for d in range(n) if d != pos])
        stat, dof = chi2(torch.bincount(toks[:, pos], minlength=V), marg)
        assert stat < chi2_critical(dof), f"position {pos}: chi2 {stat:.1f} on {dof} dof"
    pair = joint.sum(dim=(0, 3)).view(-1)
    stat, dof = chi2(torch.bincount(toks[:, 1] * V + toks[:, 2], minlength=V * V), pair)
    assert stat < chi2_critical(dof), f"positions 1, 2: chi2 {stat:.1f} on {dof} dof"


def test_a_prompts_earlier_rollouts_draft_its_later_ones():
    """Greedy, so a prompt's rows repeat its earlier rollouts: the first call drafts from the
    prompt and the group (siblings run in lockstep, none ahead of another), the second from the
    first call's rows, kept in Engine.history: it drafts more, accepts nearly every draft and
    needs fewer verifies; the tokens are dense greedy's either way."""
    m = tiny_model()
    prompts = [PROMPT, PROMPT[:9]]
    kw = dict(max_new_tokens=20, temperature=0.0, eos_ids=[-1], page_size=4)
    dense = Engine(m, Ids(), **kw).generate(prompts, 2)
    eng = Engine(m, Ids(), speculative=4, spec_draft="suffix", sparse=fixed_budget(1),
                 dense_layers=0, keep_first=0, keep_recent=0, **kw)
    first, second = eng.generate(prompts, 2), eng.generate(prompts, 2)
    assert torch.equal(first.tokens, dense.tokens) and torch.equal(second.tokens, dense.tokens)
    a, b = first.timings, second.timings
    assert b["suffix_acceptance"] > 0.95 and b["tokens_per_verify"] > 4.5  # k = 4: at most 5
    assert b["verify_calls"] < a["verify_calls"] and b["suffix_drafted"] > a["suffix_drafted"]
    assert second.timings["sparse_drafted"] == 0  # suffix drafts only: no draft step ran


def test_acceptance_per_drafter_is_logged_and_adds_up(monkeypatch):
    """Each drafter's drafted, accepted, rejections and acceptance in the timings; together they
    are the call's (pads are not drafts); a call split in two recomputes each ratio."""
    mixed(monkeypatch)
    m = tiny_model()
    kw = dict(max_new_tokens=16, temperature=1.0, eos_ids=[-1], speculative=3, spec_draft="mix",
              **ONE_PAGE)
    t = Engine(m, Ids(), **kw).generate([PROMPT, PROMPT[:7]], 6, seed=2).timings
    for key in ("drafted", "accepted", "rejections"):
        assert t[f"suffix_{key}"] + t[f"sparse_{key}"] == t[key], key
    assert t["suffix_drafted"] > 0 and t["sparse_drafted"] > 0
    for d in ("suffix", "sparse"):
        assert t[f"{d}_acceptance"] == pytest.approx(t[f"{d}_accepted"] / t[f"{d}_drafted"])
    split = Engine(m, Ids(), pool_tokens=4 * 40, **kw).generate([PROMPT, PROMPT[:7]], 6, seed=2)
    s = split.timings
    assert s["generate_calls"] == 2
    for d in ("suffix", "sparse"):
        assert s[f"{d}_acceptance"] == pytest.approx(s[f"{d}_accepted"] / max(1, s[f"{d}_drafted"]))


def test_the_step_record_has_each_drafters_acceptance(tmp_path, monkeypatch):
    """train.py with rollout_mode=speculative and spec_draft=mix: each step's record holds the
    drafts each drafter sent and their acceptance; suffix alone needs no sparse budget."""
    import config
    import train
    from fake_reward import use_parity_reward
    from test_train import TINY_RUN
    use_parity_reward(monkeypatch.setattr)
    run = TINY_RUN + ["--steps=2", "--page_size=2", "--dense_layers=0", "--max_new_tokens=16",
                      "--rollout_mode=speculative", "--spec_k=3", "--kv_budget=fixed:2",
                      "--kv_keep_recent=1", "--spec_draft=mix", "--save_every=100",
                      f"--out_dir={tmp_path}"]
    recs = train.main(run)["records"]
    for r in recs:
        assert r["spec_drafted_suffix"] + r["spec_drafted_sparse"] > 0
        assert all(0 <= r[f"spec_accept_{d}"] <= 1 for d in ("suffix", "sparse"))
    config.parse_config(["--rollout_mode=speculative", "--spec_draft=suffix"])
    with pytest.raises(ValueError, match="spec_draft"):
        config.parse_config(["--spec_draft=tree"])


def test_the_mix_picks_per_round_and_per_row_by_tokens_a_second(monkeypatch):
    """spec_draft="mix" on the chooser's own decisions (drafts.choose, from the engine's running
    figures; only watched here). Greedy, so a prompt's later calls repeat its first: rows of the
    prompt seen before find their continuation in Engine.history, rows of a new one do not. On
    this tiny model a sparse draft step costs about a verify (fixed cost), so the engine's own
    figures never favour it; planted figures of a machine where it is cheap (0.1 ms a step
    against 50 ms a verify, acceptance 0.8) make it pay for rows without a match: in one round,
    the new prompt's rows take the sparse drafts and the seen prompt's rows their suffix drafts;
    where every row has a long match the round skips the sparse draft. Tokens: dense greedy's."""
    rounds = []

    def watched(lengths, *a):
        c = choose(lengths, *a)
        rounds.append((list(lengths), c))
        return c
    monkeypatch.setattr(speculative, "choose", watched)
    m = tiny_model()
    g = torch.Generator().manual_seed(3)
    seen, new = PROMPT, torch.randint(0, 8, (13,), generator=g).tolist()
    kw = dict(max_new_tokens=24, temperature=0.0, eos_ids=[-1], page_size=4)
    eng = Engine(m, Ids(), speculative=4, spec_draft="mix", sparse=fixed_budget(1),
                 dense_layers=0, keep_first=0, keep_recent=0, **kw)
    eng.generate([seen], 2)  # the history
    eng.draft_stats["sparse"] = DraftStats("sparse", accepted=800, rejections=200, seconds=0.1,
                                           steps=1000)
    eng.verify_time, eng.since_sparse = [50.0, 1000], 0
    eng.warm.add("sparse")
    rounds.clear()
    ro = eng.generate([seen, new], 2)
    assert torch.equal(ro.tokens, Engine(m, Ids(), **kw).generate([seen, new], 2).tokens)
    t = ro.timings
    assert t["suffix_drafted"] > 0 and t["sparse_drafted"] > 0
    k = eng.speculative
    split = [c for n, c in rounds if len(n) == 4 and min(n[:2]) >= k and max(n[2:]) == 0]
    assert split and all(c.sparse and c.suffix == [True, True, False, False] for c in split)
    matched = [c for n, c in rounds if len(n) == 4 and min(n) >= k]
    assert matched and not any(c.sparse for c in matched)
    # the verify got what each round chose, row by row: the drafts each drafter sent
    assert t["sparse_drafted"] == sum(c.k * c.suffix.count(False) for _, c in rounds if c.sparse)
    assert t["suffix_drafted"] == sum(min(m, c.k) for n, c in rounds
                                      for m, u in zip(n, c.suffix) if u or not c.sparse)
