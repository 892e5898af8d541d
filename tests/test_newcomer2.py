"""A newcomer's second hour: a task switch whose traces outrun max_new_tokens is refused before the
warm start (and a warm start far longer than the default's is announced), --steps=0, --out_dir=
and --device=cuda without CUDA stop in one line that names the key, every entry point's --help
helps, both command-line styles work, a resume keeps the run's maths unless told otherwise, a
warm-up longer than the run says so, the README's log example matches a real step, the rollout
bench prints its table once with every letter, and sparse_rollout's docstring calls what exists."""
import dataclasses
import inspect
import json
import os
import re
import runpy
import sys
import types

import pytest
import torch

import calibrate
import checkpoint
import config
import parallel
import report
import train
from fake_reward import use_parity_reward
from test_train import TINY_RUN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the embedded default (configs/tiny.py, chain_sum) at a size that runs in seconds
TINY_DEFAULT = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--ffn=64",
                "--sft_steps=3", "--sft_batch=8", "--n_train=64", "--eval_per_bin=1",
                "--eval_sampled=false", "--prompts_per_step=2", "--group_size=4", "--steps=1",
                "--plot=false"]


def no_build(monkeypatch):
    """train.build (the warm start and all after it) raises: what fails first, fails before it."""
    def build(*a, **k):
        raise RuntimeError("build reached")
    monkeypatch.setattr(train, "build", build)


def one_line_error(capsys, argv):
    """config.cli on train.main: exit code 2 and stderr's one line."""
    assert config.cli(train.main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- 1: a task switch


def test_a_task_whose_traces_outrun_max_new_tokens_is_refused_before_the_warm_start(
        tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError) as e:
        config.parse_config(["--task=reasoning_gym:string_splitting"])
    msg = str(e.value)
    assert "'max_new_tokens' (64)" in msg and "configs/splitting.py" in msg
    assert re.search(r"--max_new_tokens=\d+", msg)
    no_build(monkeypatch)
    err = one_line_error(capsys, ["--task=reasoning_gym:string_splitting",
                                  f"--out_dir={tmp_path / 'run'}"])
    assert "max_new_tokens" in err and not (tmp_path / "run").exists()
    for fits in ([], ["configs/splitting.py"], ["--task=reasoning_gym:string_splitting",
                                                 "--max_new_tokens=512"]):
        config.parse_config(fits)  # the default, the task's own config, a length that fits


def test_a_warm_start_far_longer_than_the_defaults_is_announced_first(tmp_path, monkeypatch,
                                                                       capsys):
    long = ["--task=reasoning_gym:string_splitting", "--max_new_tokens=512"]
    note = train.notes(config.parse_config(long))
    assert "warm start" in note and "times the default's" in note
    assert "configs/splitting.py" in note
    assert train.notes(config.parse_config([])) == ""
    assert train.notes(config.parse_config(["configs/splitting.py"])) == ""  # its own stages
    no_build(monkeypatch)
    with pytest.raises(RuntimeError, match="build reached"):
        train.main(long + [f"--out_dir={tmp_path}"])
    assert "times the default's" in capsys.readouterr().out


# ----------------------------------------------------------------------------- 2, 3, 8: one line


def test_steps_0_is_refused_and_leaves_no_folder(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    no_build(monkeypatch)
    err = one_line_error(capsys, TINY_RUN + ["--steps=0", f"--out_dir={out}"])
    assert "'steps'" in err and "nothing to run" in err and "--steps=1" in err
    assert not out.exists()  # the next run there is accepted
    with pytest.raises(RuntimeError, match="build reached"):
        train.main(TINY_RUN + ["--steps=1", f"--out_dir={out}"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_naming_the_key(tmp_path, capsys):
    with pytest.raises(ValueError, match="'device'.*--device=cpu"):
        parallel.setup_dist(config.parse_config(["--device=cuda"]))
    err = one_line_error(capsys, TINY_RUN + ["--device=cuda", f"--out_dir={tmp_path}"])
    assert "'device'" in err and "--device=cpu" in err and "--device=auto" in err


def test_an_empty_out_dir_is_one_line_naming_the_key(monkeypatch, capsys):
    no_build(monkeypatch)
    err = one_line_error(capsys, TINY_RUN + ["--out_dir="])
    assert "'out_dir'" in err and "--out_dir=" in err


# ----------------------------------------------------------------------------- 4, 9: --help


def test_calibrate_help_prints_its_usage_and_every_key(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    for flag in ("--help", "-h"):  # `python calibrate.py configs/longcot.py --help`, in-process
        monkeypatch.setattr(sys, "argv", ["calibrate.py", "configs/longcot.py", flag])
        with pytest.raises(SystemExit) as e:
            runpy.run_path(os.path.join(ROOT, "calibrate.py"), run_name="__main__")
        out = capsys.readouterr().out
        assert e.value.code == 0 and out
        assert "python calibrate.py configs/longcot.py" in out  # its own commands first
        assert "--kv_target=" in out and "--kv_candidates=" in out


def test_roi_describes_its_commands_and_every_option(capsys):
    import roi
    p = roi.build_parser()
    commands = p._subparsers._group_actions[0].choices
    assert set(commands) == {"learn", "apply", "compare"}
    for name, sub in commands.items():
        undescribed = [a.dest for a in sub._actions if not a.help]
        assert not undescribed, f"roi.py {name}: options without a description: {undescribed}"
    with pytest.raises(SystemExit) as e:
        roi.main([])
    assert e.value.code == 2
    got = capsys.readouterr()
    for name, about in roi.ROI_HELP.items():
        assert name in got.out and about.split(";")[0] in " ".join(got.out.split())
    assert "COMMAND" in got.err and "learn, apply or compare" in got.err


def test_the_bench_help_describes_every_section(capsys):
    from bench.__main__ import SECTIONS, main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name, about in SECTIONS.items():
        assert re.search(rf"^  {name} +{re.escape(about)}$", out, re.M), name


def test_help_describes_eval_rg_kwargs_and_which_tasks_the_tiny_model_takes():
    about = report.key_comments()
    assert about["eval_rg_kwargs"] and about["eval_rg_kwargs"] != about["sft_rg_kwargs"]
    assert "held-out" in about["eval_rg_kwargs"]
    task = about["task"]
    assert all(t in task for t in ("synthetic", "chain_sum", "string_splitting", "--model"))
    assert "e.g. chain_sum, countdown" not in task  # countdown needs --model
    with pytest.raises(ValueError, match="needs model="):
        config.parse_config(["--task=reasoning_gym:countdown"])


# ----------------------------------------------------------------------------- 5: both styles


def test_both_command_line_styles_and_a_bare_flag(tmp_path):
    a = config.parse_config(["configs/sharpen.py", "--lr=1e-3", "--steps=5", "--overwrite=true",
                             "--plot=false", "--stop=\n"])
    b = config.parse_config(["--lr", "1e-3", "configs/sharpen.py", "--steps", "5", "--overwrite",
                             "--plot", "false", "--stop", "\n"])
    assert a == b and b.overwrite and not b.plot and b.lr == 1e-3
    assert config.parse_config(["--resume", "--lr", "1e-3"]).resume
    for argv, says in ((["-lr", "1e-3"], "'-lr': a key takes two dashes"),
                       (["--steps"], "'steps' has no value: give --steps=VALUE or --steps VALUE"),
                       (["--stepz", "3"], "unknown config key 'stepz' (did you mean 'steps'?)")):
        with pytest.raises(ValueError) as e:
            config.parse_config(argv)
        assert says in str(e.value)
    # what the entry points print back repeats every key as --key=value
    cfg = config.parse_config(["--out_dir", str(tmp_path)])
    note = checkpoint.resume_note(cfg, None, ["--steps", "3", "--overwrite", "--out_dir",
                                              str(tmp_path)], 2)
    assert note.endswith(f"python train.py --steps=3 --out_dir={tmp_path}")
    again = calibrate.reuse_command(["configs/longcot.py", "--kv_budget", "calibrate", "--lr",
                                     "1e-3"], "s.json", config.parse_config(["configs/longcot.py"]))
    assert again.split()[2:5] == ["configs/longcot.py", "--lr=1e-3",
                                  "--kv_budget=schedule:s.json"]
    import roi  # argparse takes both forms too
    p = roi.build_parser()
    assert (vars(p.parse_args(["learn", "m", "--nm", "2:4", "--out", "o"]))
            == vars(p.parse_args(["learn", "m", "--nm=2:4", "--out=o"])))


# ----------------------------------------------------------------------------- 6: resume


def test_resume_refuses_a_changed_schedule_unless_named_and_keeps_the_first_config(
        tmp_path, monkeypatch, capsys):
    use_parity_reward(monkeypatch.setattr)
    out = tmp_path / "run"
    run = TINY_RUN + ["--steps=2", "--save_every=1", f"--out_dir={out}"]
    train.main(run)
    with pytest.raises(ValueError) as e:
        train.main(run + ["--steps=3", "--resume=true"])
    msg = str(e.value)
    assert "steps 2 -> 3" in msg and "--resume_override=steps" in msg
    with pytest.raises(ValueError, match="'resume_override'"):
        train.main(run + ["--steps=3", "--resume_override=steps"])  # without resume
    with pytest.raises(ValueError, match="'resume_override' names stepz"):
        train.main(run + ["--steps=3", "--resume=true", "--resume_override=stepz"])
    longer = run + ["--steps=3", "--resume=true", "--resume_override=steps", "--eval_every=50"]
    recs = train.main(longer)["records"]  # eval_every is free to change
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert json.loads((out / "config.json").read_text())["steps"] == 2  # the first run's, kept
    assert json.loads((out / "config.resume-2.json").read_text())["steps"] == 3
    capsys.readouterr()
    assert train.main(longer) is None  # finished: nothing to do
    said = capsys.readouterr().out
    assert "already complete" in said and "RL wall time" not in said
    assert "--steps and --resume_override=steps" in said


# ----------------------------------------------------------------------------- 7: warm-up


def test_a_warm_up_longer_than_the_run_says_so_before_the_warm_start(tmp_path, monkeypatch,
                                                                      capsys):
    note = train.notes(config.parse_config(["--steps=3"]))  # the default's warmup_steps=5
    assert "warmup_steps=5" in note and "--warmup_steps=3" in note and "0.60 of lr" in note
    assert train.notes(config.parse_config(["--steps=5"])) == ""
    assert "warmup_steps" in train.notes(config.parse_config(["--stop_at=2"]))
    no_build(monkeypatch)
    with pytest.raises(RuntimeError, match="build reached"):
        train.main(TINY_RUN + ["--steps=3", f"--out_dir={tmp_path}"])
    assert "note: warmup_steps=5 outlasts the run (3 steps)" in capsys.readouterr().out


# ----------------------------------------------------------------------------- 10: the log


def readme_log_section():
    text = open(os.path.join(ROOT, "README.md")).read()
    return text.split("### Reading the log", 1)[1].split("\n## ", 1)[0]


def shape(segment):
    """A log segment with its figures replaced: 'kept 14/16 in 2 tries' -> 'kept N/N in N tries'."""
    return re.sub(r"[+-]?\d[\d,.]*", "N", segment.strip())


def segments(lines):
    """A step's printed lines -> the shapes of their ' | '-separated segments."""
    body = re.sub(r"^step +\d+ +", "", lines.strip(), flags=re.M)
    return [shape(s) for line in body.splitlines() for s in line.split(" | ")]


def test_the_readme_log_example_and_table_match_a_real_steps_lines(tmp_path, monkeypatch):
    section = readme_log_section()
    example = section.split("```\n", 2)[1]
    labels = {shape(m) for m in re.findall(r"^\| `([^`]+)`", section, re.M)}
    assert set(segments(example)) <= labels, set(segments(example)) - labels
    recs = train.main(TINY_DEFAULT + [f"--out_dir={tmp_path}"])["records"]
    real = segments(report.step_lines(recs[0]))
    assert "truncated N" in real  # the default's third line: its untrained rollouts are cut
    missing = [s for s in real if s not in labels]
    assert not missing, f"README's Reading the log has no row for {missing}"
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "A run ends with `weight checksum per rank" not in readme


# ----------------------------------------------------------------------------- 12: the bench


def test_the_bench_prints_a_streamed_table_once_and_an_interrupted_one_again(monkeypatch,
                                                                              capsys):
    import bench.__main__ as cli

    def section(noise):
        def run(quick, cmd):
            rows = ["| head |", "| (a) row |", "| (b) row |"]
            for r in rows:
                print(r)
                if noise:
                    print("progress ...")
            return rows
        return types.SimpleNamespace(run=run)

    for noise, times in ((False, 1), (True, 2)):
        monkeypatch.setattr(cli.importlib, "import_module", lambda name, n=noise: section(n))
        cli.main(["rollout"])
        assert capsys.readouterr().out.count("| (a) row |") == times


def test_the_rollout_bench_has_every_letter_and_no_loading_bar(monkeypatch, capsys):
    from bench import rollout
    from model import ModelConfig, Transformer
    fake = lambda letter: (lambda *a, **k: [f"| ({letter}) row |"])
    for name, letter in (("rollout_vs_transformers", "a"), ("rollout_shared_prefill", "b"),
                         ("rollout_vs_vllm", "a"), ("rollout_sparse_decode_cpu", "c"),
                         ("rollout_sparse_decode_gpu", "d"), ("rollout_cost_vs_measured", "e")):
        monkeypatch.setattr(rollout, name, fake(letter))
    monkeypatch.setattr(rollout, "bench_model", lambda max_len: None)
    monkeypatch.setattr(rollout.torch.cuda, "is_available", lambda: False)
    rows = rollout.run(True, "python -m bench rollout --quick")
    letters = sorted({m for r in rows for m in re.findall(r"^\| \(([a-z])\)", r)})
    assert letters == ["a", "b", "c", "d", "e"]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=8,
                                    max_position_embeddings=64)).eval()
    monkeypatch.undo()
    capsys.readouterr()
    assert rollout.rollout_vs_transformers(model, [], prompt_len=4, hw="cpu", cmd="x") == []
    assert "Loading weights" not in capsys.readouterr().err  # loaded, and no bar in the table


# ----------------------------------------------------------------------------- 14: the names


def test_sparse_rollouts_docstring_calls_what_exists_and_the_dense_default_is_explained():
    import sparse_rollout
    from sparse_rollout import SparseRollout
    doc = sparse_rollout.__doc__
    calls = re.findall(r"SparseRollout(\.\w+)?\(([^)]*)\)", doc)
    assert calls and "SparseRollout(cfg" not in doc
    for attr, args in calls:
        fn = getattr(SparseRollout, attr[1:]) if attr else SparseRollout.__init__
        params = [p for n, p in inspect.signature(fn).parameters.items()
                  if n not in ("self", "cls")]
        need = [p for p in params if p.default is inspect.Parameter.empty]
        assert len(need) <= len(args.split(",")) <= len(params), (attr, args, params)
    assert "kv_budget=dense" in doc and "plain dense decoding" in doc
    src = open(os.path.join(ROOT, "train.py")).read()
    at = src.index("SparseRollout.for_run(cfg")
    assert "plain dense decoding" in src[at - 300:at]  # said at the line
    assert "kv_budget=dense" in report.key_comments()["rollout_mode"]
    assert "plain dense decoding" in report.key_comments()["rollout_mode"]
    assert dataclasses.asdict(config.parse_config([]))["rollout_mode"] == "sparse"
