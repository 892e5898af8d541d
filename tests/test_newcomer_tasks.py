"""What a fresh clone meets when it runs the README's commands: roi.py masks a saved model on the
task it was trained on; a dataset task or a model that cannot be had fails at once in one line; the
warm start logs its time left, resumes when interrupted and is cached in one place whatever the
out_dir; calibrate.py prints the command that reuses its schedule; `python -m bench step` without
TRL says it skipped; the tests write nothing into the repository's out/."""
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

import calibrate
import config
import roi
import warmstart
from tasks import build_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--ffn=64", "--sft_batch=4",
         "--n_train=64", "--n_eval=8", "--difficulty=(2,3)", "--plot=false"]
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY",
               "https_proxy", "ALL_PROXY", "all_proxy")


def small_cfg(tmp_path, *extra):
    return config.parse_config(["configs/sharpen.py"] + SMALL + [f"--out_dir={tmp_path / 'run'}"]
                               + list(extra))


# ----------------------------------------------------------------------------- roi.py learn/apply


def marked_warm_start(tmp_path):
    """A tiny warm start of configs/marked.py's task (order "marked", SFT on chains of 2 to 6)."""
    cfg = config.parse_config(["configs/marked.py"] + SMALL[:-3] + ["--sft_steps=3",
                                                                  f"--out_dir={tmp_path / 'ws'}"])
    warmstart.build_policy(cfg, "cpu", lambda s: None)
    return warmstart.cache_path(cfg)


def test_roi_masks_a_warm_start_on_its_own_task_and_refuses_another(tmp_path, monkeypatch):
    folder, seen, lines = marked_warm_start(tmp_path), [], []
    real = roi.load_problems
    monkeypatch.setattr(roi, "load_problems", lambda cfg: seen.append(cfg) or real(cfg))
    out = tmp_path / "masked"
    roi.main(["apply", folder, "--nm=2:4", f"--out={out}", "--eval=4"])
    assert seen[-1].order == "marked" and seen[-1].difficulty == (2, 6)  # its SFT's task and range
    assert json.load(open(out / "nm.json"))["config"]["order"] == "marked"
    saved = torch.load(out / "masks.pt", weights_only=True)
    assert saved["task"] == {"task": "synthetic", "order": "marked"}
    # a folder roi.py wrote records the task too: masking it again keeps it
    roi.mask_saved(roi.build_parser().parse_args(["apply", str(out), "--nm=2:4", "--eval=2",
                                                  f"--out={tmp_path / 'again'}"]), lines.append)
    assert seen[-1].order == "marked" and any("order marked" in s for s in lines)
    with pytest.raises(ValueError, match="trained on task synthetic, order marked.*order defined"):
        roi.main(["learn", folder, "--nm=2:4", f"--out={tmp_path / 'x'}",
                  "--config=configs/sharpen.py"])


def test_roi_reads_a_checkpoints_run_config_and_refuses_a_task_without_traces(tmp_path):
    folder = marked_warm_start(tmp_path)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(folder, ckpt)
    os.remove(ckpt / "sft_key.json")
    cfg = config.parse_config(["configs/sharpen.py", "--order=shuffled", "--difficulty=(3,4)"])
    torch.save({"config": {**vars(cfg), "task": "synthetic"}}, ckpt / "trainer_state.pt")
    rec, where = roi.trained_config(str(ckpt))
    assert where.endswith("trainer_state.pt") and rec["order"] == "shuffled"
    args = roi.build_parser().parse_args(["apply", str(ckpt), "--nm=2:4", "--out=x"])
    got = roi.task_config(args, lambda s: None)
    assert (got.order, got.difficulty) == ("shuffled", (3, 4))
    torch.save({"config": {**vars(cfg), "task": "gsm8k"}}, ckpt / "trainer_state.pt")
    with pytest.raises(ValueError, match="task gsm8k, which has no reference traces"):
        roi.task_config(args, lambda s: None)
    os.remove(ckpt / "trainer_state.pt")  # nothing recorded: sharpen's, and the log says so
    lines = []
    assert roi.task_config(args, lines.append).order == "defined"
    assert "records no task" in lines[0] and "--config" in lines[0]


# ----------------------------------------------------------------------------- data and model


def test_a_dataset_task_offline_fails_before_the_warm_start_naming_the_fix(tmp_path, monkeypatch):
    import datasets
    for v in OFFLINE_ENV:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(warmstart, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("no retries"))
    lines = []
    with pytest.raises(FileNotFoundError, match="openai/gsm8k cannot be fetched.*cannot be reached"
                                                ".*HF_DATASETS_OFFLINE=1.*--data="):
        warmstart.build_policy(small_cfg(tmp_path, "--task=gsm8k"), "cpu", lines.append)
    assert "tiny character-level model" in lines[0] and "--model=" in lines[0]
    assert not os.path.exists(warmstart.cache_root())  # no warm start was built first
    with pytest.raises(FileNotFoundError, match="local file data/none.jsonl does not exist"):
        warmstart.check_data(small_cfg(tmp_path, "--task=gsm8k", "--data=data/none.jsonl"))


def cli(out, *argv, **env):
    env = {**{k: v for k, v in os.environ.items() if k not in OFFLINE_ENV}, **env}
    small = SMALL + ["--sft_steps=2", "--steps=1"]  # should the check come late: a short run
    return subprocess.run([sys.executable, "train.py", *argv, *small,
                           f"--out_dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def test_cli_gsm8k_offline_and_a_missing_model_folder_are_one_line_each(tmp_path):
    off = dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = cli(tmp_path / "gsm8k", "--task=gsm8k", **off)  # offline, nothing cached: hermetic
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert err[-1].startswith("error: task gsm8k: dataset openai/gsm8k is not in the datasets "
                              "cache")
    assert "tiny character-level model" in r.stdout + r.stderr
    r = cli(tmp_path / "model", "--model=/nonexistent", **off)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: config key 'model': the local folder /nonexistent does not exist")
    assert not os.path.exists(os.environ["ZEROS_CACHE"])


def test_model_names_local_paths_and_hub_ids(tmp_path, monkeypatch):
    assert not warmstart.looks_like_path("Qwen/Qwen3-0.6B")
    assert all(map(warmstart.looks_like_path, ("/m", "./m", "~/m", "out/run/ckpt", "../m")))
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a model folder \\(it has no config.json\\)"):
        warmstart.check_model(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="is a file, not a model folder"):
        warmstart.check_model(str(tmp_path / "file"))
    for v in OFFLINE_ENV:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(warmstart, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(FileNotFoundError, match="zeros-test/none.*cannot be reached.*HF_HUB_OFFL"):
        warmstart.check_model("zeros-test/none")
    monkeypatch.setattr(warmstart, "hub_reachable", lambda timeout=3.0: True)
    assert warmstart.check_model("zeros-test/none") == "zeros-test/none"  # left to the download


# ----------------------------------------------------------------------------- the warm start


def test_an_interrupted_warm_start_resumes_where_it_stopped(tmp_path, monkeypatch):
    """Killed after 4 of 6 steps, with progress saved at every step: the next build runs the last
    2 steps only, and ends on the same weights as an unbroken build; its file goes once the entry
    is written. The log gives the time spent and left."""
    monkeypatch.setattr(warmstart, "PROGRESS_EVERY_S", 0.0)
    cfg, tok = small_cfg(tmp_path, "--sft_steps=6"), build_char_tokenizer(str(tmp_path / "tok"))
    lines = []
    monkeypatch.setenv("ZEROS_CACHE", str(tmp_path / "whole"))
    whole = warmstart.warm_start(cfg, tok, "cpu", lines.append)
    assert any("elapsed, about" in s and s.endswith("left") for s in lines)
    monkeypatch.setenv("ZEROS_CACHE", str(tmp_path / "parts"))
    real, calls = warmstart.token_logprobs, []

    def killed_at_5(*a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(warmstart, "token_logprobs", killed_at_5)
    with pytest.raises(KeyboardInterrupt):
        warmstart.warm_start(cfg, tok, "cpu", lines.append)
    path = warmstart.cache_path(cfg)
    assert os.listdir(tmp_path / "parts") == [os.path.basename(warmstart.progress_path(path))]
    calls.clear()
    monkeypatch.setattr(warmstart, "token_logprobs",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    lines.clear()
    resumed = warmstart.warm_start(cfg, tok, "cpu", lines.append)
    assert len(calls) == 2 and any("resuming the interrupted SFT at step 4" in s for s in lines)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(),
                                                 resumed.state_dict().values()))
    assert os.listdir(tmp_path / "parts") == [os.path.basename(path)]
    # a damaged progress file costs its steps, nothing else
    monkeypatch.setenv("ZEROS_CACHE", str(tmp_path / "bad"))
    os.makedirs(tmp_path / "bad")
    open(warmstart.progress_path(warmstart.cache_path(cfg)), "w").write("not a checkpoint")
    lines.clear()
    warmstart.warm_start(cfg, tok, "cpu", lines.append)
    assert any("starting over" in s for s in lines)


def test_the_warm_start_cache_is_one_place_whatever_the_out_dir(tmp_path, monkeypatch):
    a, b = (config.parse_config(["configs/sharpen.py", f"--out_dir={d}"])
            for d in (tmp_path / "x" / "a", "/elsewhere/deep/b"))
    assert warmstart.cache_path(a) == warmstart.cache_path(b)
    assert warmstart.cache_root() == os.environ["ZEROS_CACHE"]  # the tests': under tmp
    monkeypatch.delenv("ZEROS_CACHE")
    # where a run from the repository with its out_dir under out/ found it before, by the same name:
    # the entries cached there stay valid
    digest = hashlib.sha1(json.dumps(warmstart.sft_key(b), sort_keys=True).encode()).hexdigest()
    assert warmstart.cache_path(b) == os.path.join(ROOT, "out", "warmstart-cache",
                                                   f"sft-{digest[:12]}")


# ----------------------------------------------------------------------------- calibrate, bench


def test_calibrate_prints_the_train_command_that_reuses_its_schedule(tmp_path, monkeypatch, capsys):
    argv = ["configs/sharpen.py"] + SMALL + [
        "--sft_steps=2", "--page_size=2", "--dense_layers=0", "--max_new_tokens=16",
        "--kv_bin_pages=4", "--kv_candidates=(1,2,4,64)", "--calib_prompts=2", "--kv_target=0.5",
        "--kv_keep_first=0", "--kv_keep_recent=1", "--group_size=2", "--kv_budget=calibrate",
        f"--out_dir={tmp_path / 'run'}"]
    sched = calibrate.main(argv)
    cmd = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert cmd[:3] == ["python", "train.py", "configs/sharpen.py"]
    cfg = config.parse_config(cmd[2:])
    path = str(tmp_path / "run" / "kv_schedule.json")
    assert cfg.kv_budget == f"schedule:{path}" and cfg.kv_controller and cfg.page_size == 2
    monkeypatch.setattr(calibrate, "calibrated_schedule", lambda *a, **k: pytest.fail("swept"))
    assert calibrate.kv_budget(cfg).table == sched.table  # the run reads it, no new sweep


def test_bench_step_without_trl_says_skipped_not_a_ratio(monkeypatch):
    from bench import step
    monkeypatch.setitem(sys.modules, "trl", None)
    row = step.run(True, "python -m bench step --quick")[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "skipped: trl not installed" and "0.00x" not in row


def test_the_tests_write_no_tokenizer_into_the_repository():
    made = os.path.join(ROOT, "out", "test-tokenizer")
    shutil.rmtree(made, ignore_errors=True)  # what earlier runs of the tests left
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_prompts.py"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:]
    assert not os.path.exists(made)
