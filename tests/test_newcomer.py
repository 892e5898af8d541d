"""What a first-time user meets: a second run into the same folder is refused (and --overwrite=true
or --resume=true get past it), --resume=true on a folder without a checkpoint fails at once,
--help lists every key by stage, Ctrl-C says where the run stopped and how to resume it, keys that
do nothing in a run say so, and the summary, the log and run.png read cleanly."""
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import checkpoint
import config
import report
import train
from fake_reward import use_parity_reward
from test_train import TINY_RUN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def no_build(monkeypatch):
    """train.build (the warm start and everything after it) raises: what fails first, fails before
    any expensive work."""
    def build(*a, **k):
        raise RuntimeError("build reached")
    monkeypatch.setattr(train, "build", build)


# ----------------------------------------------------------------------------- out_dir


@pytest.mark.parametrize("held", ["metrics.jsonl", "ckpt", "ckpt.old"])
def test_a_folder_that_holds_a_run_is_refused_before_the_warm_start(held, tmp_path, monkeypatch):
    out = tmp_path / "run"
    (out / held).parent.mkdir(parents=True, exist_ok=True)
    (out / held).mkdir() if held.startswith("ckpt") else (out / held).write_text("{}\n")
    no_build(monkeypatch)
    with pytest.raises(FileExistsError) as e:
        train.main(TINY_RUN + [f"--out_dir={out}"])
    msg = str(e.value)
    assert str(out) in msg and held in msg
    assert "--overwrite=true" in msg and "--resume=true" in msg and "--out_dir=" in msg
    assert not (out / "config.json").exists()  # the refused run wrote nothing there
    # overwrite=true gets past the check, and the old run's files are gone
    with pytest.raises(RuntimeError, match="build reached"):
        train.main(TINY_RUN + [f"--out_dir={out}", "--overwrite=true"])
    assert not (out / held).exists() and (out / "config.json").exists()
    # a folder with only a config.json (a run refused or stopped in its warm start) is free
    with pytest.raises(RuntimeError, match="build reached"):
        train.main(TINY_RUN + [f"--out_dir={out}"])


def test_a_second_run_is_refused_and_overwrite_or_resume_continue(tmp_path, monkeypatch, capsys):
    use_parity_reward(monkeypatch.setattr)
    run = TINY_RUN + ["--steps=2", "--save_every=1", f"--out_dir={tmp_path / 'run'}"]
    train.main(run)
    first = (tmp_path / "run" / "metrics.jsonl").read_text()
    r = config.cli(train.main, run)  # the command line: one line, exit code 2
    err = capsys.readouterr().err
    assert r == 2 and "already holds a run" in err and "Traceback" not in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == first  # nothing lost
    recs = train.main(run + ["--steps=3", "--resume=true", "--resume_override=steps"])["records"]
    assert [r["step"] for r in recs] == [0, 1, 2]
    recs = train.main(run + ["--overwrite=true"])["records"]
    assert [r["step"] for r in recs] == [0, 1]
    with pytest.raises(ValueError, match="'resume' and 'overwrite'"):
        train.main(run + ["--overwrite=true", "--resume=true"])


@pytest.mark.parametrize("state", ["missing", "empty", "started"])
def test_resume_without_a_checkpoint_fails_at_once(state, tmp_path, monkeypatch):
    out = tmp_path / "run"
    if state != "missing":
        out.mkdir()
    if state == "started":  # a run stopped before its first checkpoint
        (out / "metrics.jsonl").write_text("")
    no_build(monkeypatch)
    with pytest.raises(FileNotFoundError) as e:
        train.main(TINY_RUN + [f"--out_dir={out}", "--resume=true"])
    msg = str(e.value)
    assert str(out) in msg and ("does not exist" if state == "missing" else "no checkpoint") in msg


# ----------------------------------------------------------------------------- --help


def test_every_key_is_in_one_stage_of_the_help():
    keys = [f.name for f in config.dataclasses.fields(config.Config)]
    listed = [k for ks in report.STAGES.values() for k in ks.split()]
    assert sorted(listed) == sorted(keys)  # each key once, none unknown
    about = report.key_comments()
    assert about["device"] == "auto | cpu | cuda"
    assert about["lora_r"].startswith("> 0: train a LoRA adapter") and "N:M" not in about["lora_r"]
    assert about["overlong_buffer"].startswith("> 0: DAPO's soft overlong")
    assert not about["out_dir"]  # a section's title is not a key's description


def test_help_lists_the_keys_by_stage_with_this_runs_values():
    r = subprocess.run([sys.executable, "train.py", "configs/lagged.py", "--steps=7", "--help"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    out = r.stdout
    heads = [line for line in out.splitlines() if line and line[0].isalnum()]
    for stage in ("run", "model", "task", "1 signal", "2 rollout", "3 rewards", "4 update",
                  "5 sync"):
        assert any(h.startswith(stage) for h in heads), stage
    for f in config.dataclasses.fields(config.Config):
        assert f"--{f.name}=" in out
    lines = out.splitlines()
    assert any(line.startswith(" *--steps=7 (int)") for line in lines)  # the command line's
    assert any(line.startswith("  --seed=0 (int)") for line in lines)  # Config's default
    assert any("configs/lagged.py" in line for line in lines[:15])
    steps = next(i for i, line in enumerate(lines) if "--steps=7" in line)
    assert steps > next(i for i, line in enumerate(lines) if line.startswith("4 update"))


# ----------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_says_the_step_the_checkpoint_and_the_resume_command(tmp_path, monkeypatch,
                                                                      capsys):
    use_parity_reward(monkeypatch.setattr)
    run = TINY_RUN + ["--save_every=2", f"--out_dir={tmp_path / 'run'}"]
    real_step = train.rl_step

    def ctrl_c_at_3(cfg, step, *a, **k):
        if step == 3:
            raise KeyboardInterrupt
        return real_step(cfg, step, *a, **k)

    monkeypatch.setattr(train, "rl_step", ctrl_c_at_3)
    assert config.cli(train.main, run) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "at step 3 (of 0-3)" in err
    ckpt = os.path.join(str(tmp_path / "run"), "ckpt")
    assert f"{ckpt}, was saved after step 1: a resume continues from step 2" in err
    command = shlex.split(err.split("resume with: ")[1].strip())
    assert command[:2] == ["python", "train.py"] and command[-1] == "--resume=true"
    monkeypatch.setattr(train, "rl_step", real_step)
    recs = train.main(command[2:])["records"]  # the printed command does resume
    assert [r["step"] for r in recs] == [0, 1, 2, 3]


def test_ctrl_c_before_the_first_step_and_before_any_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "build", interrupted)  # in the warm start
    assert config.cli(train.main, TINY_RUN + [f"--out_dir={out}"]) == 130
    err = capsys.readouterr().err
    assert "before the first RL step" in err and "no checkpoint was saved yet" in err
    assert err.split("start again with: ")[1].split()[-1] == f"--out_dir={out}"  # nothing to add
    (out / "metrics.jsonl").write_text("")  # a run stopped in its first steps needs overwrite
    note = checkpoint.resume_note(config.parse_config(TINY_RUN + [f"--out_dir={out}"]), 1,
                                  ["--resume=true", f"--out_dir={out}"], 3)
    assert note.startswith("at step 1 (of 0-3); no checkpoint")
    assert note.endswith(f"start again with: python train.py --out_dir={out} --overwrite=true")


def test_a_real_ctrl_c_exits_130_with_the_resume_command(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "train.py", *TINY_RUN, "--steps=400", "--save_every=1",
                             "--threads=1", f"--out_dir={out}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a session of its own, Ctrl-C's default action (a shell may ignore it)
                            preexec_fn=lambda: (os.setsid(),
                                                signal.signal(signal.SIGINT, signal.SIG_DFL)))
    try:
        deadline = time.time() + 300
        while time.time() < deadline:  # the first step's log line: the loop is running
            line = proc.stdout.readline()
            if line.startswith("step    1") or not line:
                break
        assert line.startswith("step    1"), "the run ended before its second step"
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: to every process of the run
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted: at step" in err
    assert "resume with: python train.py " in err and err.strip().endswith("--resume=true")


# ----------------------------------------------------------------------------- keys that do nothing


@pytest.mark.parametrize("args,note", [
    (["--steps=80", "--stop_at=80"], "stop_at=80 has no effect in this run: steps=80 ends"),
    (["--overlong_buffer=16", "--overlong_penalty=0"], "overlong_buffer=16 has no effect"),
    (["--overlong_penalty=0.5"], "overlong_penalty=0.5 has no effect in this run: overlong_buffer"),
    (["--kv_scorer=quest", "--dense_layers=0"], "kv_scorer=quest, dense_layers=0 have no effect"),
    (["--model=/some/hf/folder", "--sft_steps=5"], "sft_steps=5, "),  # and tiny.py's sft keys
    (["--steps=80", "--stop_at=12"], None), (["--overlong_buffer=16"], None), ([], None),
])
def test_keys_that_do_nothing_in_a_run_say_so(args, note):
    text = report.idle_keys(config.parse_config(args))
    assert (note in text and "no effect in this run" in text) if note else text == ""


def layers(n):
    return SimpleNamespace(config=SimpleNamespace(num_hidden_layers=n))


def test_a_sparse_budget_that_drops_no_page_says_so():
    cfg = config.parse_config(["--kv_budget=fraction:0.125", "--page_size=16",
                               "--max_new_tokens=12"])
    prompts = [[0] * 20, [0] * 36]  # at most 36 + 12 = 48 tokens: 3 pages, the 3 it always keeps
    note = report.kv_reads_all(cfg, layers(4), prompts)
    assert "reads every page: contexts of at most 48 tokens are 3 pages of 16" in note
    assert report.kv_reads_all(config.parse_config(["--kv_budget=fraction:0.125"]), layers(4),
                               prompts) == ""  # 548 tokens: 35 pages, it reads 5
    assert report.kv_reads_all(config.parse_config(["--kv_budget=fixed:3", "--page_size=4"]),
                               layers(4), prompts) == ""
    fixed = config.parse_config(["--kv_budget=fixed:3", "--max_new_tokens=12"])
    assert "3 pages" in report.kv_reads_all(fixed, layers(4), prompts)
    assert report.kv_reads_all(fixed, layers(4), [[0] * 37]) == ""  # 49 tokens: it drops 1 of 4
    assert "dense_layers=2" in report.kv_reads_all(config.parse_config(
        ["--kv_budget=fixed:3", "--page_size=4"]), layers(2), prompts)
    assert report.kv_reads_all(config.parse_config([]), layers(4), prompts) == ""  # dense


def test_the_notes_reach_the_log_before_the_warm_start(tmp_path, monkeypatch, capsys):
    no_build(monkeypatch)
    with pytest.raises(RuntimeError, match="build reached"):
        train.main(TINY_RUN + ["--stop_at=4", f"--out_dir={tmp_path}"])
    assert "note: stop_at=4 has no effect in this run: steps=4" in capsys.readouterr().out


# ----------------------------------------------------------------------------- what a run shows


def test_the_summary_and_the_log_show_no_raw_floats_or_nans():
    recs = [{"step": i, "reward": 0.5, "groups": 4, "groups_kept": 4} for i in range(3)]
    recs[-1].update(acc=0.7272727272727273)
    text = report.summary({"records": recs, "acc0": 0.3795454545454545}, 12.0)
    assert "0.380" in text and "0.727" in text and "0.37954" not in text and "0.72727" not in text
    line = report.step_lines({"step": 3, "alpha_bins": {"p5": [float("nan"), 0.912]},
                              "kv_read_bins": [1.0, float("nan")]})
    assert "p5 alpha per bin [-, 0.91]" in line and "kv read per bin [1.00, -]" in line
    assert "nan" not in line
    rows = report.per_difficulty({"start": {"greedy": {2: 0.5, 3: 0.25}}},
                                 {"acc_by_difficulty": {"2": 1.0}}, 8)
    assert rows[-1].split() == ["3", "0.250", "-"] and "nan" not in "".join(rows)


def test_run_png_has_a_readable_legend_and_lines_that_stay_apart(tmp_path, monkeypatch):
    figs = []
    monkeypatch.setattr(report.plt, "close", figs.append)
    evals = [{"step": s, "reward": 1.0, "acc": 1.0,
              "acc_by_difficulty": {str(d): 1.0 for d in range(2, 8)}} for s in range(4)]
    report.plot({"records": evals, "acc0": 0.5, "start": {"greedy": {d: 0.5 for d in range(2, 8)}}},
                str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").exists()
    ax = figs[0].axes[1]
    lo, hi = ax.get_ylim()
    assert lo < 0 and hi > 1  # lines at 0 or 1 are not cut by the frame
    lines = [l for l in ax.get_lines() if l.get_label() != "all"]  # a difficulty's each
    assert len({l.get_marker() for l in lines}) == len(lines) == 6  # a marker each
    assert len({l.get_linestyle() for l in lines}) == 4  # and line styles in turn
    legend = ax.get_legend()
    assert legend.get_texts()[0].get_fontsize() >= 9
    figs[0].canvas.draw()
    box, frame = legend.get_window_extent(), ax.get_window_extent()
    assert box.x0 >= frame.x1  # beside the plot, not over its lines
    assert not math.isnan(box.width)
