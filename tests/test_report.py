"""report.py: the pass@k estimator against hand computations; out_dir/summary.json's figures (the
per-difficulty tables before and after RL, each figure with its problem count); the tracker's copy
of them; run.png's x convention, integer ticks, legend and colours."""
import json
import sys
import types

import numpy as np
import pytest
import torch

import report
from tasks import Problem


@pytest.mark.parametrize("rewards, k, want", [
    ([1, 0, 0, 0], 1, 1 / 4),                      # pass@1 is the mean
    ([1, 0, 0, 0], 2, 1 - 3 / 6),                  # 1 - C(3,2) / C(4,2)
    ([1, 1, 0, 0, 0], 3, 1 - 1 / 10),              # 1 - C(3,3) / C(5,3)
    ([1, 0, 0, 0, 0, 0, 0, 0], 4, 1 - 35 / 70),    # 1 - C(7,4) / C(8,4)
    ([0, 0, 0, 0], 1, 0.0), ([0, 0, 0, 0], 4, 0.0),  # c = 0: never
    ([1, 1, 1, 1], 1, 1.0), ([1, 1, 1, 1], 3, 1.0),  # c = n: always
    ([0, 1, 0, 0], 4, 1.0), ([0, 0, 1, 1], 4, 1.0),  # k = n: whether any is right
    ([1, 0.67, 0.5, 0], 2, 1 - 3 / 6),             # partial credit is not a right answer
])
def test_pass_at_k_against_a_hand_computation(rewards, k, want):
    got, = report.pass_at(torch.tensor(rewards, dtype=torch.float32), [k])
    assert got == pytest.approx(want, abs=1e-12)


def test_pass_ks_lists_the_columns_a_run_reports():
    assert report.pass_ks(64) == [1, 8, 64] and report.pass_ks(8) == [1, 8]
    assert report.pass_ks(4) == [1, 4] and report.pass_ks(1) == [1]


def history():
    """A finished 10-step run on 2- and 5-term sums, held out 3 and 2 problems (difficulty 9 has
    none: its NaN must not reach JSON)."""
    recs = [{"step": s, "reward": 0.1 * s, "groups_kept": 16, "groups": 16, "gen_s": 1.0,
             "train_s": 0.5} for s in range(10)]
    recs[4].update(acc=0.4, acc_by_difficulty={"2": 1.0, "5": 0.0})
    recs[9].update(acc=0.6, acc_by_difficulty={"2": 1.0, "5": 0.5})
    return {"records": recs, "acc0": 0.2, "examples": [{"prompt": "2+3=", "before": "4"}],
            "start": {"greedy": {2: 1 / 3, 5: 0.0, 9: float("nan")}, "pass@1": {2: 0.5, 5: 0.25},
                      "pass@8": {2: 1.0, 5: 0.75}},
            "end": {"greedy": {"2": 1.0, "5": 0.5}, "pass@1": {2: 0.9, 5: 0.5},
                    "pass@8": {2: 1.0, 5: 1.0}}}


PROBLEMS = [Problem("p", "1", "synthetic", {"difficulty": d}) for d in (2, 2, 2, 5, 5)]


def test_summary_json_holds_the_tables_before_and_after_rl_with_their_counts(tmp_path):
    figs = report.run_figures(history(), PROBLEMS, seconds=12.0, ledger={"steps": 10})
    path = report.write_summary(str(tmp_path), figs)
    saved = json.loads(open(path).read())  # JSON proper: no NaN
    assert saved["held_out"] == {"problems": 5, "by_difficulty": {"2": 3, "5": 2}}
    assert saved["accuracy_before_rl"] == 0.2 and saved["accuracy_after_rl"] == 0.6
    before, after = saved["by_difficulty"]["before RL"], saved["by_difficulty"]["after RL"]
    assert set(before) == set(after) == {"greedy", "pass@1", "pass@8"}
    assert before["greedy"]["2"] == {"value": pytest.approx(1 / 3), "n": 3}
    assert before["greedy"]["9"] == {"value": None, "n": None}  # no figure, no problem
    assert before["pass@8"]["5"] == {"value": 0.75, "n": 2}
    assert after["greedy"]["5"] == {"value": 0.5, "n": 2} and after["pass@1"]["2"]["value"] == 0.9
    assert saved["summary"]["RL wall time"] == 12.0 and saved["summary"]["steps"] == 10
    assert saved["summary"]["held-out accuracy before RL"] == 0.2
    assert saved["ledger"] == {"steps": 10} and saved["finished"]
    # pass@k on a subset of each bin (eval_k_per_bin): its own counts beside its figures
    h = history()
    h["counts"] = {"greedy": {2: 3, 5: 2}, "sampled": {2: 1, 5: 1}}
    saved = report.run_figures(h, PROBLEMS, seconds=12.0)
    assert saved["held_out"]["sampled_by_difficulty"] == {"2": 1, "5": 1}
    before = saved["by_difficulty"]["before RL"]
    assert before["pass@8"]["5"] == {"value": 0.75, "n": 1} and before["greedy"]["5"]["n"] == 2
    assert saved["by_difficulty"]["after RL"]["pass@1"]["2"] == {"value": 0.9, "n": 1}


def test_at_the_start_summary_json_holds_the_warm_starts_figures():
    h = history()
    h["records"], h["end"] = [], {}
    figs = report.run_figures(h, PROBLEMS)
    assert not figs["finished"] and figs["accuracy_before_rl"] == 0.2
    assert figs["by_difficulty"]["before RL"]["pass@1"]["5"] == {"value": 0.25, "n": 2}
    assert figs["by_difficulty"]["after RL"] == {} and "summary" not in figs
    # before the end's pass@k, "after RL" is the last evaluation's greedy column
    h = history()
    del h["end"]
    after = report.run_figures(h, PROBLEMS, 1.0)["by_difficulty"]["after RL"]
    assert after == {"greedy": {"2": {"value": 1.0, "n": 3}, "5": {"value": 0.5, "n": 2}}}


def test_the_tracker_gets_the_figures_flat_and_both_pictures(tmp_path, monkeypatch):
    calls = []
    mod = types.ModuleType("trackio")
    mod.init = lambda **kw: calls.append(("init",))
    mod.log = lambda metrics, step=None: calls.append(("log", metrics, step))
    mod.Image = lambda path: ("image", path)
    mod.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "trackio", mod)
    cfg = types.SimpleNamespace(tracker="trackio", out_dir=str(tmp_path), resume=False)
    monkeypatch.setattr(report.dataclasses, "asdict", lambda c: {})
    t = report.Tracker(cfg)
    figs = report.run_figures(history(), PROBLEMS, 3.0, {"stages": {"sync": {"items": [
        {"what": "bytes shipped", "done": 5, "naive": 9, "unit": "bytes"}]}}})
    t.figures(figs, step=0)
    flat = calls[-1][1]
    assert calls[-1][2] == 0 and flat["accuracy_before_rl"] == 0.2
    assert flat["by_difficulty/before RL/pass@8/5/value"] == 0.75
    assert flat["by_difficulty/before RL/pass@8/5/n"] == 2
    assert flat["ledger/stages/sync/items/bytes shipped/done"] == 5
    assert all(isinstance(v, (int, float)) for v in flat.values())
    for name in ("run.png", "ledger.png"):
        (tmp_path / name).write_bytes(b"png")
    t.step = 9
    t.finish(str(tmp_path / "run.png"), figs)
    _, logged, step = calls[-2]
    assert step == 9 and logged["run.png"] == ("image", str(tmp_path / "run.png"))
    assert logged["ledger.png"] == ("image", str(tmp_path / "ledger.png"))
    assert logged["summary/RL wall time"] == 3.0 and calls[-1] == ("finish",)


def test_run_png_puts_every_figure_on_one_x_and_says_so(tmp_path):
    """x = the optimizer steps the policy had taken: a step's reward at its step (its rollouts
    come before its update), the held-out accuracy after step s at s + 1, the warm start at 0."""
    h = history()
    series = report.plot_series(h)
    assert series["reward"][0] == list(range(10))
    assert series["all"] == [(0, 0.2), (5, 0.4), (10, 0.6)]
    assert series[5] == [(0, 0.0), (5, 0.0), (10, 0.5)]
    fig = report.plot(h, str(tmp_path / "run.png"), "terms")
    for ax in fig.axes[:2]:
        assert "optimizer steps done" in ax.get_xlabel()


def test_run_png_has_integer_ticks_named_difficulties_and_colours_apart(tmp_path):
    recs = [{"step": s, "reward": 0.5} for s in range(2)]
    recs[1].update(acc=0.5, acc_by_difficulty={str(d): 0.5 for d in range(2, 13)})
    h = {"records": recs, "acc0": 0.4, "start": {"greedy": {d: 0.4 for d in range(2, 13)}}}
    fig = report.plot(h, str(tmp_path / "run.png"), "terms")
    for ax in fig.axes[:2]:  # a 2-step run: ticks at whole steps only
        ticks = [x for x in ax.get_xticks() if ax.get_xlim()[0] <= x <= ax.get_xlim()[1]]
        assert ticks and all(float(x).is_integer() for x in ticks), ticks
    legend = fig.axes[1].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels[0] == "2 terms" and labels[-2] == "12 terms" and labels[-1] == "all"
    assert legend.get_title().get_text() == "number of terms"
    colours = [np.array(line.get_color()[:3]) for line in fig.axes[1].get_lines()[:11]]
    gaps = [np.linalg.norm(a - b) for a, b in zip(colours, colours[1:])]
    assert min(gaps) > 0.15, gaps  # neighbouring difficulties, the hard ones included
    assert (tmp_path / "run.png").stat().st_size > 10_000


def test_difficulty_names_follow_the_task():
    cfg = lambda task, order="defined": types.SimpleNamespace(task=task, order=order)
    assert report.difficulty_name(cfg("reasoning_gym:chain_sum")) == "terms"
    assert report.difficulty_name(cfg("synthetic", "lagged")) == "lines"
    assert report.difficulty_name(cfg("gsm8k")) == ""
    assert report.plain({"a": [float("inf"), 1.0]}) == {"a": [None, 1.0]}  # JSON has no inf
