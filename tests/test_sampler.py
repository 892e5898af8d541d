"""The growth-zone sampler on a simulated pool with known pass rates, its state round trip, and the
dynamic-sampling test."""
import io
import os
import sys
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prompts import GrowthZoneSampler, PassRates, PromptSampler, group_has_signal  # noqa: E402
from tasks import Problem  # noqa: E402

G = 8  # completions per prompt


def pool(n):
    return [Problem(f"p{i}", "0", "synthetic") for i in range(n)]


def simulated_rates(seed=0):
    """300 prompts: 100 always solved, 100 never solved, 100 in between (0.2 to 0.8)."""
    return np.concatenate([np.ones(100), np.zeros(100),
                           np.random.default_rng(seed).uniform(0.2, 0.8, 100)])


def run(sampler, rates, steps, batch=32, seed=0):
    """Draw, reward from the known rates, observe; returns the drawn indices of each step."""
    rng, drawn = np.random.default_rng(seed), []
    for _ in range(steps):
        idx = [i for i, _ in sampler.next_batch(batch)]
        sampler.observe(idx, [(rng.random(G) < rates[i]).astype(float).tolist() for i in idx])
        drawn.append(idx)
    return drawn


def test_concentrates_on_the_growth_zone_and_still_visits_the_rest():
    rates = simulated_rates()
    s = GrowthZoneSampler(pool(300), seed=1)
    drawn = np.array(run(s, rates, 200)[50:]).ravel()  # after a warm-up of 50 steps
    middle = np.mean(drawn >= 200)
    assert middle > 0.6, middle  # uniform sampling would give 1/3
    assert np.mean(drawn < 200) > 0.03  # the easy and the hard ones still come back
    assert len(set(drawn[drawn < 200].tolist())) > 100  # ... and many different ones
    st = s.stats()
    assert st["pool_seen"] == 1.0 and st["unseen"] == 0.0
    assert st["pool_zone"] == pytest.approx(1 / 3, abs=0.05)
    assert (st["pool_easy"] == pytest.approx(1 / 3, abs=0.05)
            and st["pool_hard"] == pytest.approx(1 / 3, abs=0.05))
    assert st["zone"] > 0.6 and st["zone_obs"] > 0.5 and 0 < st["explored"] < 0.4


def test_a_prompt_that_becomes_solvable_reenters_the_zone():
    rates = simulated_rates()
    s = GrowthZoneSampler(pool(300), seed=2)
    run(s, rates, 100)
    target = 150  # never solved so far
    assert s.rates.mean()[target] < 0.1
    rates[target] = 0.5
    drawn = run(s, rates, 150, seed=1)
    first = [target in idx for idx in drawn].index(True)
    assert first < 100  # exploration brings it back: about 200 stale prompts / 3 explored per step
    assert 0.1 < s.rates.mean()[target] < 0.9
    later = np.array(drawn[first + 20:]).ravel()  # once its estimate has caught up:
    # the average share of a never-solved prompt
    hard_share = np.isin(later, np.arange(100, 200)).mean() / 100
    assert np.mean(later == target) > 3 * hard_share  # it is drawn like a prompt of the zone
    assert np.mean(later == target) > 0.5 * np.isin(later, np.arange(200, 300)).mean() / 100


def test_unseen_prompts_get_tried():
    s = GrowthZoneSampler(pool(1000), seed=0)
    # 2000 draws: uniform sampling would see 87% of the pool
    run(s, np.full(1000, 0.5), 50, batch=40)
    assert s.stats()["pool_seen"] > 0.8
    # pure exploration: oldest pick first
    sweep = GrowthZoneSampler(pool(1000), seed=0, explore=1.0)
    batches = [sweep.next_batch(40) for _ in range(25)]
    # the pool once, no repeats
    assert sorted(i for b in batches for i, _ in b) == list(range(1000))
    assert (sweep.stats()["unseen"] == 1.0 and sweep.stats()["explored"] == 1.0
            and sweep.stats()["pool_seen"] == 0.0)


def test_batch_larger_than_the_pool():
    s = GrowthZoneSampler(pool(10), seed=0)
    counts = np.bincount([i for i, _ in s.next_batch(25)], minlength=10)
    assert counts.sum() == 25 and counts.min() >= 2 and counts.max() <= 3


def test_state_round_trip_continues_identically():
    rates = simulated_rates()
    ref = GrowthZoneSampler(pool(300), seed=3)
    run(ref, rates, 20)
    want = run(ref, rates, 20, seed=9)

    s = GrowthZoneSampler(pool(300), seed=3)
    run(s, rates, 20)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)  # as in a checkpoint; plain tensors and Python data only
    buf.seek(0)
    resumed = GrowthZoneSampler(pool(300), seed=12345, zone=(0.1, 0.9))
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.stats() == s.stats()
    assert run(resumed, rates, 20, seed=9) == want

    with pytest.raises(ValueError, match="300 problems"):
        GrowthZoneSampler(pool(299), seed=3).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="not from a GrowthZoneSampler"):
        resumed.load_state_dict(PromptSampler(pool(300), seed=0).state_dict())
    with pytest.raises(ValueError, match="another sampler"):
        PromptSampler(pool(300), seed=0).load_state_dict(s.state_dict())


def test_same_seed_same_batches_different_seed_different():
    a, b, c = (GrowthZoneSampler(pool(200), seed=s) for s in (5, 5, 6))
    rates = simulated_rates()[:200]
    assert run(a, rates, 10) == run(b, rates, 10) != run(c, rates, 10)


def test_pass_rates_threshold_and_forgetting():
    pr = PassRates(3, prior=(1.0, 1.0), decay=0.5, threshold=0.7)
    pr.observe([0, 1], [np.array([0.9, 0.7, 0.2, 0.5]), np.array([0.69, 0.1])])
    assert pr.s.tolist() == [2.0, 0.0, 0.0] and pr.f.tolist() == [2.0, 2.0, 0.0]
    assert pr.mean()[2] == 0.5 and pr.visits.tolist() == [1, 1, 0]
    for _ in range(200):  # a long run of failures: the counts stay bounded ...
        pr.observe([2], [np.zeros(G)])
    assert pr.f[2] <= G / (1 - 0.5) + 1e-9 and pr.mean()[2] < 0.06
    pr.observe([2], [np.ones(G)])  # ... so one good group still moves the estimate a lot
    assert pr.mean()[2] > 0.45
    with pytest.raises(ValueError, match="decay"):
        PassRates(3, decay=0.0)
    with pytest.raises(ValueError, match="prior"):
        PassRates(3, prior=(0.0, 1.0))
    with pytest.raises(ValueError, match="not all finite"):
        pr.observe([1], [np.array([np.nan])])


def test_observe_accepts_groups_or_single_rewards_and_checks_them():
    s = GrowthZoneSampler(pool(5), seed=0, threshold=0.5)
    s.observe([0, 1], [[1.0, 0.0], 0.75])  # a group, and one reward alone
    assert s.rates.s[:2].tolist() == [1.0, 1.0] and s.rates.f[:2].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 indices but 1"):
        s.observe([0, 1], [[1.0]])
    with pytest.raises(IndexError, match=r"\[7\] outside the pool of 5"):
        s.observe([7], [[1.0]])


@pytest.mark.parametrize("kwargs, name", [
    ({"zone": (0.9, 0.1)}, "zone"), ({"zone": (0.0, 1.5)}, "zone"), ({"explore": 1.5}, "explore"),
    ({"cooldown": -1}, "cooldown"), ({"decay": 2.0}, "decay"),
])
def test_bad_config_names_the_key(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GrowthZoneSampler(pool(5), seed=0, **kwargs)


def test_cooldown_keeps_a_prompt_out_of_the_exploit_slots():
    rates = np.full(40, 0.5)
    s = GrowthZoneSampler(pool(40), seed=0, explore=0.0, cooldown=1)
    drawn = run(s, rates, 30, batch=8)
    for a, b in zip(drawn[5:], drawn[6:]):
        assert not set(a) & set(b)  # picked at step t: not exploited at t + 1


def test_fast_on_a_large_pool():
    n = 100_000
    s = GrowthZoneSampler(pool(n), seed=0)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for _ in range(10):
        idx = [i for i, _ in s.next_batch(64)]
        s.observe(idx, (rng.random((64, G)) < 0.5).astype(float).tolist())
    per_step = (time.perf_counter() - t0) / 10
    # about 25 ms on one busy core: numpy over the pool, no Python loop
    assert per_step < 0.5, per_step
    assert s.stats()["pool_seen"] > 0.9 * 9 * 64 / n  # counted before the last batch


@pytest.mark.parametrize("rewards, min_spread, spread, want", [
    ([0, 0, 0, 0], 0.0, "range", False),
    ([1, 1, 1, 1], 0.0, "range", False),
    ([0, 1, 0, 0], 0.0, "range", True),
    ([0, 1, 0, 0], 0.0, "std", True),
    ([0.3, 0.3, 0.3], 0.0, "std", False),  # an exact zero, not a rounding residue
    ([0.50, 0.52, 0.51], 0.05, "range", False),  # non-binary: differences below the noise level
    ([0.50, 0.52, 0.51], 0.01, "range", True),
    ([0.2, 0.9, 0.4], 0.3, "std", False),  # std 0.29
    ([0.2, 0.9, 0.4], 0.25, "std", True),
    ([1.0], 0.0, "range", False),
    ([], 0.0, "range", False),
])
def test_group_has_signal(rewards, min_spread, spread, want):
    assert group_has_signal(rewards, min_spread, spread) is want


def test_group_has_signal_inputs():
    assert group_has_signal(torch.tensor([0.0, 1.0])) and group_has_signal(np.array([[0.0], [1.0]]))
    with pytest.raises(ValueError, match="finite"):
        group_has_signal([0.0, float("nan")])
    with pytest.raises(ValueError, match="spread"):
        group_has_signal([0.0, 1.0], spread="var")


def test_the_pooled_prior_skips_unseen_prompts_of_a_solved_difficulty():
    """A large pool, each prompt seen about once: with a flat prior an unseen prompt draws from
    Beta(1, 1) and the sampler is nearly uniform; with its difficulty's pooled pass rate as its
    prior, unseen prompts of an always-solved difficulty are skipped and the batch fills from the
    difficulty in the zone. Bins: 0 always solved, 1 solved half the time, 2 never."""
    n = 6000
    bins = [i % 3 for i in range(n)]
    rates = np.array([(1.0, 0.5, 0.0)[b] for b in bins])
    share = {}
    for name, b in (("flat", None), ("pooled", bins)):
        s = GrowthZoneSampler(pool(n), seed=3, bins=b)
        drawn = np.array(run(s, rates, 40)[5:]).ravel()
        share[name] = np.mean(np.array(bins)[drawn] == 1)
    assert share["flat"] < 0.45, share  # about a third: nearly uniform over the bins
    assert share["pooled"] > 0.8, share


def test_pooled_prior_counts_round_trip_and_a_changed_binning_is_refused():
    bins = [0, 0, 1, 1]
    s = GrowthZoneSampler(pool(4), seed=0, bins=bins)
    s.observe([0, 2], [[1.0] * G, [0.0] * G])
    t = GrowthZoneSampler(pool(4), seed=0, bins=bins)
    t.load_state_dict(s.state_dict())
    assert np.allclose(t.rates.mean(), s.rates.mean()) and t.rates.bs[0] == G
    assert t.rates.mean()[1] == pytest.approx(0.9) and t.rates.mean()[3] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="zone_prior"):
        GrowthZoneSampler(pool(4), seed=0).load_state_dict(s.state_dict())
