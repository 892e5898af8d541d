"""bench/recipe.py: RL variants of the default from the same warm starts, ranked by RL's pass@1
past SFT's range against the warm start's pass@k there. Every variant changes keys config.py has;
--quick runs in seconds; a run recorded with the same arguments is read, not run again; the table
ranks by the margin and counts the seeds where RL reaches the warm start's pass@k."""
import json
import os
import pytest

import config
from bench import recipe
from bench.__main__ import main as bench_main


def test_every_variant_sets_keys_config_has_and_the_band_is_past_sft_inside_rl():
    for name, (what, keys) in recipe.VARIANTS.items():
        cfg = config.parse_config(keys)  # an unknown key or a bad value raises here
        assert what and (keys or name == "baseline")
        assert all(getattr(cfg, k[2:].split("=")[0]) != getattr(config.parse_config([]),
                                                                k[2:].split("=")[0])
                   for k in keys)  # each key changes the default
    assert recipe.band(config.parse_config([])) == (5, 8)


def figs(pass1, passk, seconds=10.0):
    return {"k": "pass@64", "start_passk": passk, "start_greedy": 0.2, "rl_pass1": pass1,
            "rl_passk": 0.9, "rl_greedy": 0.5, "gain_past_sft": 0.1, "entropy": [0.5, 0.3],
            "band": [5, 8], "steps": 120, "seconds": seconds, "verifier_calls": 100}


def test_the_table_ranks_by_pass1_against_the_warm_starts_pass_at_k():
    results = {"baseline": {0: figs(0.30, 0.60), 1: figs(0.20, 0.50)},
               "lr4e-4": {0: figs(0.70, 0.60), 1: figs(0.40, 0.50)},
               "t0.7": {0: figs(0.50, 0.60)}}
    lines = recipe.table(results, "python -m bench recipe")
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| variant")]
    assert [r.split(" | ")[0][2:] for r in rows] == ["lr4e-4", "t0.7", "baseline"]
    cells = rows[0].split(" | ")
    assert cells[2] == "0,1" and cells[4] == "0.550 ± 0.212" and cells[5] == "1 of 2"
    assert rows[2].split(" | ")[5] == "0 of 2" and rows[1].split(" | ")[2] == "0"


def test_quick_runs_each_variant_once_and_the_filter_refuses_unknown_names(tmp_path, monkeypatch,
                                                                            capsys):
    monkeypatch.setenv("ZEROS_CACHE", str(tmp_path / "cache"))
    runs = str(tmp_path / "runs")
    first = recipe.one_run("baseline", 0, True, str(tmp_path / "out"), runs)
    for key in ("start_passk", "rl_pass1", "rl_passk", "start_greedy", "rl_greedy"):
        assert 0.0 <= first[key] <= 1.0
    assert first["k"] == "pass@2" and first["band"] == [5, 8] and first["steps"] == 2
    assert len(first["entropy"]) == 2 and all(e > 0 for e in first["entropy"])

    def no_training(argv):
        raise AssertionError("a recorded run ran again")

    monkeypatch.setattr(recipe.train, "main", no_training)
    assert recipe.one_run("baseline", 0, True, str(tmp_path / "out"), runs) == first
    assert "recorded in" in capsys.readouterr().out
    assert recipe.recorded(runs, True) == {"baseline": {0: first}}
    assert recipe.recorded(runs, False) == {}  # a full sweep's table leaves quick runs out
    path = os.path.join(runs, "baseline-s0.json")  # the default moves under a record: refused
    with open(path) as f:
        rec = json.load(f)
    assert rec["settings"]["lr"] == recipe.parse_config([]).lr
    rec["settings"]["lr"] *= 2
    with open(path, "w") as f:
        json.dump(rec, f)
    with pytest.raises(ValueError, match="other settings"):
        recipe.one_run("baseline", 0, True, str(tmp_path / "out"), runs)
    empty = str(tmp_path / "none")
    assert recipe.run(False, "cmd", "", runs=empty, jobs=0) == ["(no runs recorded yet)"]
    with pytest.raises(ValueError, match="no variant nope"):
        recipe.run(True, "cmd", "baseline,nope", runs)
    with pytest.raises(SystemExit):
        bench_main(["demo", "--variants", "baseline"])  # the filter is recipe's
    with pytest.raises(SystemExit):
        bench_main(["demo", "--records", "ws-0"])  # another set of warm starts: recipe's too
    seen = {}
    monkeypatch.setattr(recipe, "run", lambda quick, cmd, **kw: seen.update(kw) or ["| t |"])
    bench_main(["recipe", "--jobs", "0", "--records", "ws-0"])  # its runs in their own folder
    assert seen["runs"] == os.path.join(recipe.RUNS, "ws-0")
