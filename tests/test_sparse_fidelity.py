"""The lossy sparse path's bookkeeping: a budget below the pages every step reads is refused, the
read fraction is what decode really read (against a count by hand), the rollout-level mismatch
(summed TV) against a hand computation and held by calibration and the Controller, rescoring that
cannot alias with a task's rhythm, and the dense engine forced to a sparse rollout's tokens (the
paired speed comparison)."""
import json
import math

import pytest
import torch

import config
from calibrate import (Controller, Schedule, calibrate, load_schedule, observe, read_figures,
                       read_fraction, tv_bin_stats)
from kvcache import rescores
from rollout import Engine
from sparsity import fixed_budget, rollout_tv
from test_rollout import CharTok, tiny_model


# ------------------------------------------------------------------------------ the budget floor


@pytest.mark.parametrize("argv,msg", [
    (["--kv_budget=table:3,2,5"], r"\(1, 2\)"),  # bin 1 asks for 2 of the 3 kept pages
    (["--kv_budget=fixed:1"], r"\(0, 1\)"),
    (["--kv_budget=table:2", "--kv_keep_first=0"], None),  # floor 2: honoured
    (["--kv_budget=table:1", "--kv_keep_first=0"], r"below the 2 pages"),
    (["--kv_candidates=(2,4)"], "kv_candidates"),
])
def test_a_budget_below_the_kept_pages_is_refused_at_parse(argv, msg):
    if msg is None:
        assert config.parse_config(argv).kv_budget == "table:2"
        return
    with pytest.raises(ValueError, match=msg):
        config.parse_config(argv)


def test_a_schedule_file_below_the_floor_is_refused_and_the_controller_stays_above(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(Schedule([2, 6], 4).state_dict()))
    with pytest.raises(ValueError, match=r"\(0, 2\)"):
        load_schedule(str(path), floor=3)
    s = load_schedule(str(path), floor=2)
    assert s.min_pages == 2
    # a calm controller lowers toward the floor, never below it
    c = Controller(Schedule([5, 5], 4, min_pages=3), target=0.5, step_pages=1, patience=1)
    for _ in range(10):
        c.observe([0.99, 0.99], [100, 100])
    assert c.schedule.table == [3, 3]


# ------------------------------------------------------------------ the read fraction, by hand


def test_read_fraction_per_layer_and_bin_is_counted_by_hand():
    """A fixed 3 pages of 4 tokens, 1 sink + 1 recent kept, 2 layers (the first dense), no EOS:
    at the decode step that caches c tokens (the new one included) a sparse layer reads
    min(ceil(c / 4), 3) pages and the dense layer ceil(c / 4)."""
    m, tok = tiny_model(), CharTok()
    prompts, new, ps = [[3, 4, 5, 6, 7], [8, 9]], 14, 4
    eng = Engine(m, tok, max_new_tokens=new, temperature=1.0, eos_ids=[], page_size=ps,
                 sparse=fixed_budget(3), keep_first=1, keep_recent=1, dense_layers=1)
    ro = eng.generate(prompts, group_size=2, seed=0)
    sparse = dense = 0
    per_bin = {}  # bin of 2 pages -> [pages read over both layers, pages cached over both]
    for p in prompts:
        for _ in range(2):
            for s in range(1, new):  # step s caches the prompt, s earlier tokens and the new one
                n = -(-(len(p) + s) // ps)
                sparse, dense = sparse + min(n, 3), dense + n
                b = per_bin.setdefault(min(n // 2, 2), [0, 0])
                b[0], b[1] = b[0] + min(n, 3) + n, b[1] + 2 * n
    t = ro.timings
    assert t["pages_read_layer"] == [dense, sparse]  # counted in the cache, per layer
    assert t["pages_read"] == dense + sparse and t["pages_dense"] == 2 * dense
    want = [per_bin[b][0] / per_bin[b][1] for b in sorted(per_bin)]
    got = read_fraction(ro.budget, ro.budget_dense, ro.mask, 2, 2, 1, n_bins=3)
    assert got["bins"] == pytest.approx(want)
    assert got["layers"] == pytest.approx([1.0, sparse / dense])
    assert got["all"] == pytest.approx(t["pages_read"] / t["pages_dense"])
    figs = read_figures(ro, 2, 2, 1)
    assert figs["kv_read_layers"] == pytest.approx([1.0, sparse / dense], abs=1e-4)


# ------------------------------------------------------------ the rollout-level statistic


def test_rollout_tv_and_its_bins_by_hand():
    alpha = torch.tensor([[1.0, 0.9, 0.8, 1.0], [0.5, 0.7, 0.0, 0.0]])
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    assert rollout_tv(alpha, mask).tolist() == pytest.approx([0.3, 0.8])
    pages = torch.tensor([[1, 1, 2, 2], [1, 2, 0, 0]])
    rows = torch.tensor([[7] * 4, [9] * 4])
    st = tv_bin_stats(alpha[mask], pages[mask], rows[mask], bin_pages=2, q=0.05)
    # bin 0: rates 0.1 / 2 and 0.5 / 1, their 95th percentile (linear) times the mean length 3
    assert st["held"].tolist() == pytest.approx([(0.05 + 0.95 * 0.45) * 3, (0.1 + 0.95 * 0.2) * 3])
    assert st["count"].tolist() == [3, 3] and st["rollouts"].tolist() == [2, 2]
    assert st["tv_tail"].item() == pytest.approx(0.3 + 0.95 * 0.5)
    assert st["tv_mean"].item() == pytest.approx(0.55)
    rec = observe(alpha[mask], pages[mask], 2, q=0.05, rows=rows[mask])
    assert rec["tv_tail"] == pytest.approx(0.775) and len(rec["tv_bins"]) == 2


def test_the_controller_and_calibration_hold_the_rollout_tv():
    s = Schedule([4, 4], 8, threshold=0.5, hold="rollout")
    c = Controller(s, step_pages=2, patience=1)
    assert c.hold == "rollout" and c.target == 0.5
    c.observe([0.9, 0.1], [100, 100])  # bin 0 parts too often: raised; bin 1 has room: lowered
    assert s.table == [6, 2]
    c.observe([0.45, 0.1], [100, 100])  # inside: bin 0 holds (4 failed), bin 1 goes on down
    assert s.table == [6, 1]
    # calibration: the smallest candidate whose TV is at most the target, bin by bin
    tv = lambda table: [2.0 / table[0], 6.0 / table[1]]  # fewer partings with more pages
    assert calibrate(tv, 2, [2, 4, 8, 16], threshold=0.5, hold="rollout") == [4, 16]
    assert calibrate(lambda t: [1 - 1 / t[0]] * 2, 2, [2, 4, 8], 0.7) == [4, 4]  # p5: unchanged
    with pytest.raises(ValueError, match="rollout"):
        Controller(Schedule([4], 8), hold="bogus")


# ---------------------------------------------------------------------- rescoring cannot alias


@pytest.mark.parametrize("every", [2, 3, 4, 5, 8])
def test_rescoring_reaches_every_phase_of_a_fixed_rhythm(every):
    steps = range(1, 2001)
    hit = [s for s in steps if rescores(s, every)]
    assert hit[0] == 1  # the first step has no kept scores
    # once per window of `every` steps, on average every `every` steps
    assert all(sum(rescores(s, every) for s in range(w * every + 1, (w + 1) * every + 1)) == 1
               for w in range(2000 // every))
    for rhythm in range(2, 9):  # a task that repeats every `rhythm` tokens: each phase rescored
        assert {s % rhythm for s in hit} == set(range(rhythm)), (every, rhythm)
    assert all(rescores(s, 1) for s in steps)


# ------------------------------------------------------ forced decoding: the same work, densely


def test_force_decodes_the_given_tokens_at_their_lengths():
    m, tok = tiny_model(), CharTok()
    prompts = [[3, 4, 5, 6, 7], [8, 9]]
    sp = Engine(m, tok, max_new_tokens=12, page_size=4, sparse=fixed_budget(2), dense_layers=0,
                keep_first=1, keep_recent=1).generate(prompts, 2, seed=3)
    lens = sp.mask.sum(1).tolist()
    force = [sp.tokens[i, :n].tolist() for i, n in enumerate(lens)]
    dense = Engine(m, tok, max_new_tokens=12, page_size=4)
    ro = dense.generate(prompts, 2, seed=0, force=force)
    assert ro.mask.sum(1).tolist() == lens and ro.timings["new_tokens"] == sp.timings["new_tokens"]
    assert all(ro.tokens[i, :n].tolist() == force[i] for i, n in enumerate(lens))
    # its log-probs are the dense model's: a dense rollout forced to its own tokens gives its own
    own = dense.generate(prompts, 2, seed=5)
    again = dense.generate(prompts, 2, seed=0, force=[own.tokens[i, :int(own.mask[i].sum())]
                                                      .tolist() for i in range(len(own))])
    assert torch.allclose(again.logp, own.logp, atol=1e-5) and again.finish == own.finish
    assert not math.isnan(ro.logp.sum().item())


# ------------------------------------------------------------------- the speculative mode, in the loop


@pytest.mark.parametrize("distill", [0, 4])
def test_speculative_mode_in_the_loop_is_exact_and_logs_acceptance(tmp_path, monkeypatch, distill):
    """rollout_mode=speculative: the rollouts' behaviour log-probs are the dense policy's (the IS
    ratio is 1 before each update), the log reads "exact" instead of a mismatch, and shows the
    acceptance rate and tokens a verify; the paired comparison runs beside it. With distill_r the
    adapter only drafts: it trains every step, and the samples stay the policy's."""
    import train
    import update
    from fake_reward import use_parity_reward
    from test_train import TINY_RUN
    use_parity_reward(monkeypatch.setattr)
    seen = []
    real = update.train_on

    def spy(cfg, model, opt, ids, tmask, adv, n, roll, *a, **k):  # before the first update
        lp = update.token_logprobs(model, ids, tmask, cfg.temperature)
        seen.append((lp[tmask] - roll[tmask]).abs().max().item())
        return real(cfg, model, opt, ids, tmask, adv, n, roll, *a, **k)

    monkeypatch.setattr(train, "train_on", spy)
    run = TINY_RUN + ["--steps=2", "--page_size=2", "--dense_layers=0", "--max_new_tokens=24",
                      "--rollout_mode=speculative", "--spec_k=3", "--kv_budget=fixed:2",
                      "--kv_keep_recent=1", "--kv_compare_every=1", "--save_every=100",
                      f"--out_dir={tmp_path}", f"--distill_r={distill}",
                      f"--spec_k_max={6 if distill else 0}"]  # adaptive k rides along
    recs = train.main(run)["records"]
    assert recs[0]["spec_k"] == 3 and all(1 <= r["spec_k"] <= (6 if distill else 3) for r in recs)
    assert all(("distill_kl" in r) == bool(distill) for r in recs)
    assert all(r["mismatch"] == "exact" and "alpha_p5" not in r for r in recs)
    assert all(0 <= r["spec_accept"] <= 1 and 1 <= r["spec_per_verify"] <= r["spec_k"] + 1 for r in recs)
    assert all("reward_gap" in r and r["rollout_speedup"] > 0 for r in recs)
    assert len(seen) == 2 and max(seen) < 1e-4  # the rollouts' log-probs are the trainer's
    with pytest.raises(ValueError, match="speculative"):
        config.parse_config(["--rollout_mode=speculative"])  # no sparse budget to draft with
    with pytest.raises(ValueError, match="spec_k_max"):
        config.parse_config(["--spec_k_max=4"])  # no speculative mode


def test_lowalpha_types_each_token_of_a_lagged_completion():
    from bench.lowalpha import token_types
    line = "12" * 32 + "\n"  # 65 tokens: 32 pairs (copy v, sum t) and a newline
    text = line + "34" + "#7"
    types = token_types(text, len(text) + 1)  # the EOS is the last token: part of the end
    assert types[:4] == [0, 1, 0, 1] and types[64] == 2 and types[65:67] == [0, 1]
    assert types[67:] == [3, 3, 3]
