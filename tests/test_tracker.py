"""The experiment tracker (report.Tracker, config key `tracker`): a run hands it the config at the
start, metrics.jsonl's record at every step and run.png at the end; a missing package is refused
when the config is parsed, naming the package and its pip command. A recording fake stands in for
trackio and wandb, whose calls are the same; trackio itself runs offline when it is installed."""
import importlib.machinery
import json
import os
import sqlite3
import subprocess
import sys
import types

import pytest

import config
import report
import train
from test_train import TINY_RUN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recording_tracker(name):
    """A module with trackio's and wandb's shared calls (init, log, Image, finish) that records
    them; the spec lets config's importlib.util.find_spec see it as installed."""
    mod, calls = types.ModuleType(name), []
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.init = lambda **kw: calls.append(("init", kw))
    mod.log = lambda metrics, step=None: calls.append(("log", metrics, step))
    mod.Image = lambda path: ("image", path)
    mod.finish = lambda: calls.append(("finish",))
    return mod, calls


@pytest.mark.parametrize("name", ["trackio", "wandb"])
def test_a_run_gives_the_tracker_its_config_every_record_and_the_plot(name, tmp_path,
                                                                      monkeypatch):
    mod, calls = recording_tracker(name)
    monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "run"
    train.main(TINY_RUN + ["--steps=2", "--plot=true", f"--tracker={name}", f"--out_dir={out}"])
    init, logs = calls[0], [c for c in calls if c[0] == "log"]
    assert init[0] == "init" and init[1]["project"] == "zeros" and init[1]["name"] == "run"
    # the config as config.json has it (JSON turns tuples into lists)
    saved = json.loads((out / "config.json").read_text())
    assert json.loads(json.dumps(init[1]["config"])) == saved
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(logs) == len(recs) + 2 == 4  # the start's figures, a record a step, the end's
    assert logs[0][2] == 0 and "accuracy_before_rl" in logs[0][1]  # summary.json's, flat
    for (_, metrics, step), rec in zip(logs[1:], recs):
        assert step == rec["step"] and json.loads(json.dumps({**metrics, "step": step})) == rec
    end, step = logs[-1][1:]
    assert step == 1 and end["run.png"] == ("image", str(out / "run.png"))
    assert end["ledger.png"] == ("image", str(out / "ledger.png")) and "summary/steps" in end
    assert calls[-1] == ("finish",) and os.path.exists(out / "run.png")
    if name == "wandb":  # offline unless the user says otherwise, its files inside the run's folder
        assert os.environ["WANDB_MODE"] == "offline" and init[1]["dir"] == str(out)


def test_without_a_tracker_nothing_is_imported_or_called(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)  # an import would fail
    cfg = config.parse_config(TINY_RUN + [f"--out_dir={tmp_path}"])
    t = report.Tracker(cfg)
    t.log({"step": 0, "loss": 1.0})
    t.finish(str(tmp_path / "run.png"))
    assert t.lib is None and report.Tracker(config.parse_config([]), rank=1).lib is None


@pytest.mark.parametrize("name", ["trackio", "wandb"])
def test_a_missing_tracker_is_refused_before_the_warm_start(name, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # what an environment without it looks like
    with pytest.raises(ValueError, match=f"'tracker'.*pip install {name}"):
        config.parse_config([f"--tracker={name}"])
    with pytest.raises(ValueError, match=f"pip install {name}"):
        train.main(TINY_RUN + [f"--tracker={name}", f"--out_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "warmstart-cache").exists()
    with pytest.raises(ImportError, match=f"pip install {name}"):  # installed, but broken
        report.tracker_package(name)
    with pytest.raises(ValueError, match="'tracker'"):
        config.parse_config(["--tracker=tensorboard"])


def test_trackio_itself_logs_a_run_offline(tmp_path):
    """trackio, when installed, in its own process: TRACKIO_DIR is read when it is imported, and
    the hub is off, so the run is local."""
    pytest.importorskip("trackio")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "tracked"
    subprocess.run([sys.executable, "train.py"] + TINY_RUN + [
        "--steps=2", "--plot=true", "--tracker=trackio", f"--out_dir={out}", "--threads=1"],
        cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    db = sqlite3.connect(tmp_path / "trackio" / "zeros.db")
    rows = [(step, json.loads(m)) for step, m in
            db.execute("select step, metrics from metrics where run_name = 'tracked' order by id")]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s, _ in rows] == [0, 0, 1, 1]  # the start's figures, the steps, the end's
    for (step, metrics), rec in zip(rows[1:], recs):
        assert set(metrics) == set(rec) - {"step"} and metrics["loss"] == rec["loss"]
    assert rows[-1][1]["run.png"]["_type"] == "trackio.image"
    (cfg,), = db.execute("select config from configs where run_name = 'tracked'")
    assert json.loads(cfg)["tracker"] == "trackio"
