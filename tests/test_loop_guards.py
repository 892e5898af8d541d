"""The loop against bad input and quiet failure: values refused when the config is parsed, dropout
out of the rollouts, a step's refills, distinct rollout seeds, a diverged run that stops, resume
without recalibrating, a short probe on the full schedule's learning rate, and a log a person can
read."""
import os
import subprocess
import sys

import pytest
import torch

import config
import report
import train
import update
from model import Transformer
from prompts import GrowthZoneSampler
from tasks import Problem
from fake_reward import use_parity_reward
from test_train import TINY_RUN
from warmstart import cache_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("arg,key", [
    ("--lr=-1", "lr"), ("--kv_budget=fraction:2", "kv_budget"),
    ("--is_correction=foo", "is_correction"), ("--sampler=often", "sampler"),
    ("--rollout_copy=nm5:4", "rollout_copy"), ("--kv_controller=true", "kv_controller"),
    ("--fsdp=true", "fsdp"), ("--group_size=1", "group_size"), ("--temperature=0", "temperature"),
    ("--zone=(0.9,0.1)", "zone"), ("--autocast=fp16", "autocast"), ("--kl_loss=k1", "kl_loss"),
    ("--overlong_buffer=64", "overlong_buffer"), ("--micro_batch=0", "micro_batch"),
    ("--task=poetry", "task"),
])
def test_bad_values_are_refused_when_parsed_naming_the_key(arg, key, tmp_path):
    with pytest.raises(ValueError, match=f"'{key}'"):
        config.parse_config([arg])
    with pytest.raises(ValueError, match=f"'{key}'"):  # before any warm start is built
        train.main(TINY_RUN + [arg, f"--out_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "warmstart-cache").exists()


def test_lora_dropout_stays_out_of_rollouts_and_old_logprobs(tmp_path, monkeypatch):
    use_parity_reward(monkeypatch.setattr)
    recs = train.main(TINY_RUN + ["--steps=1", "--lora_r=2", "--lora_dropout=0.5", "--lr=1e-3",
                                  f"--out_dir={tmp_path}", "--save_every=100"])["records"]
    assert recs[0]["tokens"] > 0
    # rollout policy = trained policy
    assert recs[0]["sample_alpha_mean"] == pytest.approx(1.0, abs=1e-4)


def test_a_refill_never_redraws_a_prompt_of_the_same_step():
    s = GrowthZoneSampler([Problem(f"p{i}", "0", "synthetic") for i in range(24)], seed=0)
    for _ in range(30):
        drawn = [i for i, _ in s.next_batch(8)]
        for _ in range(2):  # two refills in the same step
            drawn += [i for i, _ in s.next_batch(8, refill=True)]
        assert len(set(drawn)) == len(drawn) == 24
        s.observe(drawn, [[1.0, 0.0]] * len(drawn))


def test_rollout_seeds_are_distinct_for_many_refill_tries():
    seeds = {train.rollout_seed(0, step, t, rank)
             for step in range(50) for t in range(12) for rank in range(4)}
    assert len(seeds) == 50 * 12 * 4
    assert train.rollout_seed(1, 0, 0, 0) != train.rollout_seed(0, 0, 0, 0)


def test_a_diverged_run_stops_with_a_clear_error(tmp_path, monkeypatch):
    use_parity_reward(monkeypatch.setattr)
    with pytest.raises(FloatingPointError, match="max_skipped=2"):
        train.main(TINY_RUN + ["--steps=8", "--lr=1e30", "--max_skipped=2", f"--out_dir={tmp_path}",
                               "--save_every=100"])


def test_stop_at_keeps_the_full_runs_learning_rate_schedule(tmp_path):
    recs = train.main(TINY_RUN + ["--steps=8", "--stop_at=3", f"--out_dir={tmp_path}",
                                  "--save_every=100"])["records"]
    full = config.parse_config(TINY_RUN + ["--steps=8"])
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert [r["lr"] for r in recs] == pytest.approx([update.lr_at(full, s) for s in range(3)])


def test_resume_reads_the_calibrated_schedule_instead_of_recalibrating(tmp_path, capsys):
    run = TINY_RUN + ["--page_size=2", "--dense_layers=0", "--max_new_tokens=16",
                      "--kv_bin_pages=4", "--kv_candidates=(1,2,4,8,16)", "--calib_prompts=2",
                      "--kv_target=0.5", "--kv_budget=calibrate", f"--out_dir={tmp_path}",
                      "--save_every=1", "--kv_keep_first=0", "--kv_keep_recent=1"]
    train.main(run + ["--steps=1"])
    table = tmp_path / "kv_schedule.json"
    before = (table.stat().st_mtime_ns, table.read_text())
    capsys.readouterr()
    train.main(run + ["--steps=2", "--resume=true", "--resume_override=steps"])
    assert "calibrating" not in capsys.readouterr().out
    assert (table.stat().st_mtime_ns, table.read_text()) == before


def test_log_lines_fit_a_terminal_and_no_bars_go_to_a_file(tmp_path):
    rec = {"step": 12, "groups_kept": 14, "groups": 16, "tries": 3, "short": 1, "gen_s": 12.5,
           "len_mean": 1034.2, "kv_read": 0.35, "reward": 0.858, "reach_verify": 0.25,
           "alpha_p5": 0.912, "loss": -0.0123, "grad_norm": 10.92, "train_s": 11.8, "acc": 0.925,
           "rollout_speedup": 1.52, "errors": 2}
    assert all(len(line) <= 100 for line in report.step_lines(rec).splitlines())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "train.py", *TINY_RUN, "--steps=2",
                        f"--out_dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "\r" not in r.stderr + r.stdout and "it/s" not in r.stderr  # no progress bars in a file
    assert "step    1" in r.stdout


def test_a_diverged_run_exits_2_with_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "tests/fake_reward.py", *TINY_RUN, "--steps=6", "--lr=1e30",
                        "--max_skipped=2", f"--out_dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert (r.returncode == 2 and "Traceback" not in r.stderr
            and "error: stopped at step" in r.stderr)


def test_the_signal_bench_stops_early_on_its_configs_schedule():
    from bench import signal
    for quick in (True, False):
        cfg, default = config.parse_config(signal.ARGS[quick]), config.parse_config(signal.ARGS[quick][:1])
        assert cfg.steps == default.steps and 0 < cfg.stop_at < cfg.steps
        assert [update.lr_at(cfg, s) for s in range(cfg.stop_at)] == [update.lr_at(default, s)
                                                                       for s in range(cfg.stop_at)]


@pytest.mark.parametrize("script", ["train.py", "calibrate.py"])
def test_entry_points_report_a_bad_key_in_one_line(script):
    r = subprocess.run([sys.executable, script, "--stpes=3"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "error: unknown config key 'stpes' (did you mean 'steps'?)"


def test_the_loop_measures_alpha_on_every_generated_row_not_only_kept_groups(tmp_path, monkeypatch):
    import reward
    orig = reward.Cascade.score_batch

    def all_zero(self, problems, texts, group_size=1, **kw):  # every group is dropped
        res = orig(self, problems, texts, group_size, **kw)
        res.rewards = [0.0] * len(texts)
        return res

    monkeypatch.setattr(reward.Cascade, "score_batch", all_zero)
    recs = train.main(TINY_RUN + ["--steps=1", "--refill_tries=0", "--page_size=2",
                                  "--dense_layers=0", "--kv_budget=fixed:2", "--kv_bin_pages=4",
                                  "--kv_keep_recent=1",
                                  f"--out_dir={tmp_path}", "--save_every=100"])["records"]
    r = recs[0]
    assert r["groups_kept"] == 0 and r["tokens"] == 0  # nothing trained...
    # ...and yet every generated token was measured
    assert sum(r["alpha_bins"]["count"]) == r["new_tokens"]
    assert 0 < r["alpha_p5"] <= r["alpha_mean"] <= 1


def test_the_cascade_sees_each_rows_finish_reason(tmp_path, monkeypatch):
    import reward
    seen, orig = [], reward.Cascade.score_batch

    def spy(self, problems, texts, group_size=1, **kw):
        seen.append(kw.get("finish"))
        return orig(self, problems, texts, group_size, **kw)

    monkeypatch.setattr(reward.Cascade, "score_batch", spy)
    train.main(TINY_RUN + ["--steps=1", f"--out_dir={tmp_path}", "--save_every=100"])
    assert seen and all(f is not None for f in seen)  # training rollouts and evaluation alike
    # a 12-token limit cuts rows: they reach the cascade as cut
    assert any("length" in f for f in seen)


def test_overlong_punishment_and_filtering_in_the_loop(tmp_path, monkeypatch):
    use_parity_reward(monkeypatch.setattr)
    got, real = [], train.batch_from_groups

    def spy(kept, *a, **k):
        got.append((kept, a[-1] if len(a) >= 7 else k.get("drop_rows")))
        return real(kept, *a, **k)

    monkeypatch.setattr(train, "batch_from_groups", spy)
    train.main(TINY_RUN + ["--steps=2", "--overlong_buffer=6", "--overlong_filter=true",
                           "--refill_tries=3", f"--out_dir={tmp_path}", "--save_every=100"])
    kept = [k for ks, _ in got for k in ks]
    cut = torch.cat([k.cut for k in kept])
    rewards = torch.cat([k.rewards for k in kept])
    # a cut row ends at -1 on top of its parity reward
    assert cut.any() and (rewards[cut] <= 0).all()
    drops = [d for ks, d in got if ks]
    assert drops and all(d is not None for d in drops)
    assert torch.equal(torch.cat(drops), cut)  # ...and, filtered, leaves the loss


def test_nm_training_keeps_the_pruned_weights_at_exactly_zero(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from sparsity import nm_linears
    use_parity_reward(monkeypatch.setattr)
    seen, real = [], update.optimizer_step

    def spy(cfg, model, *a, **k):  # after every optimizer step: still 2 of every 4, the rest exactly 0
        out = real(cfg, model, *a, **k)
        seen.append(all((mod.weight.view(-1, 4) != 0).sum(-1).le(2).all()
                        for mod in nm_linears(model).values()))
        return out

    monkeypatch.setattr(update, "optimizer_step", spy)
    recs = train.main(TINY_RUN + ["--steps=2", "--nm=2:4", f"--out_dir={tmp_path}"])["records"]
    assert any(r["tokens"] > 0 for r in recs) and seen and all(seen)
    ws = Transformer.from_pretrained(cache_path(config.parse_config(TINY_RUN + [f"--out_dir={tmp_path}"])))
    final = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    for name in nm_linears(ws):
        w0, w = ws.state_dict()[name], final[name]
        assert ((w != 0).view(-1, 4).sum(-1) <= 2).all()  # N:M at the end too
        pruned = w0.abs().view(-1, 4).argsort(-1)[:, :2]  # the warm start's two smallest of each four
        assert (w.view(-1, 4).gather(1, pruned) == 0).all()
        assert not torch.equal(w, w0)  # and the active weights did train
    with pytest.raises(ValueError, match="'nm'"):
        config.parse_config(["--nm=2:4", "--lora_r=4"])
