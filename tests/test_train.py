"""Stage 4 and the loop: config errors, advantages and loss by hand, log-probs, NaN skipping,
resume, torchrun."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import config
import train
import update
from model import ModelConfig, Transformer
from warmstart import cache_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- config


def test_config_overrides_and_types(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("# a comment\nsteps = 7\nlr = 1  # an int where a float is wanted is fine\n"
                 "difficulty = [3, 4]\n")
    cfg = config.parse_config([str(f), "--group_size=4", "--plot=false", "--stop=###"])
    assert ((cfg.steps, cfg.lr, cfg.difficulty, cfg.group_size, cfg.plot, cfg.stop)
            == (7, 1.0, (3, 4), 4, False, "###"))


@pytest.mark.parametrize("argv,msg", [
    (["--stpes=3"], "unknown config key 'stpes' \\(did you mean 'steps'\\?\\)"),
    (["--steps=many"], "config key 'steps' wants int"),
    (["--steps=2.5"], "config key 'steps' wants int"),
    (["--plot=maybe"], "config key 'plot' wants a bool"),
    (["--steps"], "config key 'steps' has no value: give --steps=VALUE or --steps VALUE"),
])
def test_config_errors_name_the_key(argv, msg):
    with pytest.raises(ValueError, match=msg):
        config.parse_config(argv)


def test_config_file_unknown_key(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("learning_rate = 3e-4\n")
    with pytest.raises(ValueError, match="unknown config key 'learning_rate'"):
        config.parse_config([str(f)])


def test_cli_reports_config_error_without_traceback():
    r = subprocess.run([sys.executable, "train.py", "--bogus=1"], cwd=ROOT, capture_output=True,
                       text=True)
    assert (r.returncode == 2 and "unknown config key 'bogus'" in r.stderr
            and "Traceback" not in r.stderr)


# ----------------------------------------------------------------------------- advantages and loss


def test_group_advantages_by_hand():
    adv, keep = update.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]), 4)
    # mean .5, std .5
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    # all equal: no signal
    assert torch.equal(adv[4:], torch.zeros(4)) and keep.tolist() == [True, False]
    adv, keep = update.group_advantages(torch.tensor([0.2, 0.2, 0.8]), 3)  # non-binary rewards
    assert keep.tolist() == [True] and torch.allclose(adv, torch.tensor([-0.7071, -0.7071, 1.4142]),
                                                      atol=1e-4)


def test_pg_loss_by_hand_with_clip_boundaries_and_padding():
    old = torch.zeros(2, 3)
    # ratios: row 0 (A = +1): 1.0, 1.5 (clipped at 1.28), 0.5 (not clipped for A > 0)
    #         row 1 (A = -1): 0.5 (clipped at 0.8), 1.2, and a padded position that must not count
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.2, 9.0]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -1.0])
    loss, s = update.pg_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    want = -(1.0 + 1.28 + 0.5) - (-0.8 - 1.2)  # min(r A, clip(r) A) per token, summed, negated
    assert loss.item() == pytest.approx(want, abs=1e-5)
    # token (0,1) above 1 + clip_high with A > 0, token (1,0) below 1 - clip_low with A < 0
    assert s["clipped"] == 2
    # gradient flows only where the objective is not clipped
    logp.requires_grad_(True)
    update.pg_loss(logp, old, adv, mask, 0.2, 0.28)[0].backward()
    g = logp.grad
    assert g[0, 1] == 0 and g[1, 0] == 0 and g[1, 2] == 0 and g[0, 0] == pytest.approx(-1.0)


def test_is_weights_tis_and_mis_by_hand():
    roll = torch.zeros(1, 5)
    old = torch.log(torch.tensor([[0.25, 0.8, 1.0, 1.5, 3.0]]))  # p_train / p_rollout
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last token is padding
    w, s = update.is_weights(old, roll, mask, "tis", cap=1.2)
    assert (torch.allclose(w, torch.tensor([[0.25, 0.8, 1.0, 1.2, 0.0]]), atol=1e-6)
            and s["is_cut"] == 1)
    w, s = update.is_weights(old, roll, mask, "mis", lo=0.5, hi=1.2)
    assert (torch.allclose(w, torch.tensor([[0.0, 0.8, 1.0, 0.0, 0.0]]), atol=1e-6)
            and s["is_cut"] == 2)
    w, s = update.is_weights(old, roll, mask, "none")
    assert torch.equal(w, mask) and s["is_cut"] == 0
    # min(1, ratio) over real tokens
    assert s["alpha_mean"] == pytest.approx((0.25 + 0.8 + 1 + 1) / 4, abs=1e-6)
    with pytest.raises(ValueError, match="is_correction"):
        update.is_weights(old, roll, mask, "bogus")
    # the weight multiplies the policy term: a token with weight 0 gets no gradient
    lp = torch.zeros(1, 5, requires_grad=True)
    update.pg_loss(lp, torch.zeros(1, 5), torch.ones(1), mask.bool(), 0.2, 0.2,
                   is_w=w * 0 + torch.tensor([[0, 1, 1, 1, 1.0]]))[0].backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == -1


def test_pg_loss_kl_term():
    lp, ref = torch.zeros(1, 2), torch.log(torch.tensor([[0.5, 2.0]]))
    loss, _ = update.pg_loss(lp, lp, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), 0.2, 0.2,
                             ref, kl_coef=0.5, kl_loss="k3")
    d = ref[0]
    assert loss.item() == pytest.approx(0.5 * (torch.exp(d) - d - 1).sum().item(), abs=1e-6)


def tiny(seed=0, vocab=20):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   intermediate_size=64))


def test_token_logprobs_alignment_and_packing():
    m = tiny().eval()
    prompts = [[3, 4, 5], [6]]
    comps = [torch.tensor([7, 8, 0]), torch.tensor([9, 10, 11])]
    masks = [torch.tensor([True, True, False]), torch.tensor([True, True, True])]
    ids, tmask = update.build_batch(prompts, comps, masks, pad_id=0)
    assert ids.tolist() == [[3, 4, 5, 7, 8], [6, 9, 10, 11, 0]]
    with torch.no_grad():
        lp = update.token_logprobs(m, ids, tmask)
        lp_packed = update.token_logprobs(m, ids, tmask, packed=True)
        # the slow way: one row at a time
        for i, (p, c, k) in enumerate(zip(prompts, comps, masks)):
            seq = torch.tensor([p + c[k].tolist()])
            full = m(seq)[0].log_softmax(-1)
            want = [full[len(p) - 1 + j, t].item() for j, t in enumerate(c[k].tolist())]
            assert torch.allclose(lp[i][tmask[i]], torch.tensor(want), atol=1e-5)
    assert torch.allclose(lp, lp_packed, atol=1e-5)


def test_nonfinite_loss_skips_the_step_and_keeps_weights():
    m = tiny()
    cfg = config.Config(micro_batch=4)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ids = torch.randint(1, 20, (2, 6))
    tmask = torch.zeros(2, 6, dtype=torch.bool)
    tmask[:, 2:5] = True
    stats = update.train_on(cfg, m, opt, ids, tmask, torch.tensor([float("nan"), 1.0]),
                            world=1)["stats"]
    assert stats[3].item() == 1  # one step skipped
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    stats = update.train_on(cfg, m, opt, ids, tmask, torch.tensor([-1.0, 1.0]), world=1)["stats"]
    assert stats[3].item() == 0 and any(not torch.equal(before[k], v)
                                        for k, v in m.state_dict().items())


# -------------------------------------------------------------------- the loop: resume and torchrun

# configs/sharpen.py, shrunk: short chains in the "defined" order, the loop's tests' fixed workload
TINY_RUN = ["configs/sharpen.py", "--n_layer=1", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--ffn=64",
            "--sft_steps=3", "--sft_batch=8", "--n_train=64", "--n_eval=8", "--prompts_per_step=4",
            "--group_size=4", "--max_new_tokens=12", "--steps=4", "--eval_every=100",
            "--plot=false", "--difficulty=(1,2)", "--lr=1e-2", "--passes=2", "--minibatches=2",
            "--micro_batch=4"]


def killed_at_2_then_resumed(monkeypatch, run):
    """Run with a checkpoint every 2 steps, kill the run as step 2 starts, resume it: the resumed
    records."""
    real_step = train.rl_step

    def crash_at_2(cfg, step, *a, **k):
        if step == 2:
            raise KeyboardInterrupt("killed")
        return real_step(cfg, step, *a, **k)

    monkeypatch.setattr(train, "rl_step", crash_at_2)
    with pytest.raises(KeyboardInterrupt):
        train.main(run)
    monkeypatch.setattr(train, "rl_step", real_step)
    return train.main(run + ["--resume=true"])["records"]


def test_resume_gives_the_same_next_loss(tmp_path, monkeypatch):
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)
    full = train.main(TINY_RUN + [f"--out_dir={tmp_path / 'a'}", "--save_every=100"])["records"]
    assert full[2]["loss"] != 0.0  # the comparison below means something

    resumed = killed_at_2_then_resumed(monkeypatch,
                                       TINY_RUN + [f"--out_dir={tmp_path / 'b'}", "--save_every=2"])
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert resumed[2]["loss"] == pytest.approx(full[2]["loss"], abs=1e-6)
    assert resumed[3]["loss"] == pytest.approx(full[3]["loss"], abs=1e-6)
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines] == [0, 1, 2, 3]


def test_torchrun_two_ranks_end_identical(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port=29517", "tests/fake_reward.py", *TINY_RUN, "--steps=2", "--threads=1",
           f"--out_dir={tmp_path}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [l for l in (r.stdout + r.stderr).splitlines()
            if l.startswith("weight checksum per rank")][0]
    sums = line.split(":")[1].split("(")[0].split()
    assert len(sums) == 2 and sums[0] == sums[1] and "(identical)" in line
    recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r["tokens"] > 0 for r in recs)  # the ranks really trained (and still agree)


def test_dynamic_sampling_trains_short_when_tries_run_out(tmp_path, monkeypatch, capsys):
    import reward
    orig = reward.Cascade.score_batch

    # no group ever has spread: nothing to learn from
    def all_zero(self, problems, texts, group_size=1, **kw):
        res = orig(self, problems, texts, group_size, **kw)
        res.rewards = [0.0] * len(texts)
        return res

    monkeypatch.setattr(reward.Cascade, "score_batch", all_zero)
    out = train.main(TINY_RUN + ["--steps=2", "--refill_tries=3", f"--out_dir={tmp_path}",
                                 "--save_every=100"])
    recs = out["records"]
    assert all(r["tries"] == 4 and r["groups_kept"] == 0 and r["short"] == 1 and r["tokens"] == 0
               for r in recs)
    cap = capsys.readouterr()
    assert "SHORT" in cap.out + cap.err
    ws = Transformer.from_pretrained(
        cache_path(config.parse_config(TINY_RUN + [f"--out_dir={tmp_path}"])))
    from model import weight_checksum
    # no update happened: the weights are the warm start's
    assert out["checksums"][0] == weight_checksum(ws)


def test_a_refill_draws_the_missing_groups_over_the_keep_rate(tmp_path, monkeypatch):
    import zlib
    import prompts
    import reward
    orig = reward.Cascade.score_batch
    # about a third of the prompts give a group with spread
    spread = lambda p: zlib.crc32(p.prompt.encode()) % 3 == 0

    def some_spread(self, problems, texts, group_size=1, **kw):
        res = orig(self, problems, texts, group_size, **kw)
        res.rewards = [float(spread(p) and k % 2 == 0) for k, p in enumerate(problems)]
        return res

    calls = []
    real = prompts.GrowthZoneSampler.next_batch

    def logged(self, n, refill=False):
        batch = real(self, n, refill)
        calls.append([spread(p) for _, p in batch])
        return batch

    monkeypatch.setattr(reward.Cascade, "score_batch", some_spread)
    monkeypatch.setattr(prompts.GrowthZoneSampler, "next_batch", logged)
    recs = train.main(TINY_RUN + ["--steps=3", "--prompts_per_step=8", "--refill_tries=4",
                                  f"--out_dir={tmp_path}", "--save_every=100"])["records"]
    k = 0
    # replay each step's tries: the first draws a whole batch, a refill what is missing / keep rate
    for r in recs:
        kept, drawn, signals, sizes = 0, 0, 0, []
        for t in range(r["tries"]):
            sizes.append(len(calls[k]))
            want = 8 if t == 0 else min(8, math.ceil((8 - kept) * drawn / max(1, signals)))
            assert len(calls[k]) == want
            drawn, signals, kept = (drawn + want, signals + sum(calls[k]),
                                    min(8, kept + sum(calls[k])))
            k += 1
        assert r["groups_kept"] == kept and r["short"] == int(kept < 8)
        assert r["rollouts"] == 4 * sum(sizes)
    # refills happened, and smaller
    assert any(r["tries"] > 1 for r in recs) and any(len(c) < 8 for c in calls[1:])
    assert k == len(calls)


@pytest.mark.parametrize("form", ["fp8", "nm2:4"])
def test_rollout_copies_run_in_the_loop_with_is_correction(tmp_path, monkeypatch, form):
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)
    recs = train.main(TINY_RUN + ["--steps=2", f"--rollout_copy={form}", "--is_correction=tis",
                                  "--is_cap=1.0", f"--out_dir={tmp_path}",
                                  "--save_every=100"])["records"]
    trained = [r for r in recs if r["tokens"] > 0]
    # the copy really differs from the policy
    assert trained and all(r["alpha_mean"] < 1.0 for r in trained)
    # and the truncation is active (cap 1: every ratio above 1 is cut)
    assert any(r["is_cut"] > 0 for r in trained)


def test_lora_in_the_loop_trains_only_the_adapter_and_resumes(tmp_path, monkeypatch):
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)
    run = TINY_RUN + ["--lora_r=4", "--lora_alpha=8"]
    full = train.main(run + [f"--out_dir={tmp_path / 'a'}", "--save_every=100"])["records"]
    ws = Transformer.from_pretrained(
        cache_path(config.parse_config(run + [f"--out_dir={tmp_path / 'a'}"])))
    ck = Transformer.from_pretrained(str(tmp_path / "a" / "ckpt"))  # merged weights, plain HF names
    assert (tmp_path / "a" / "ckpt" / "adapter" / "adapter_model.safetensors").exists()
    assert any(not torch.equal(a, b)
               for a, b in zip(ws.state_dict().values(), ck.state_dict().values()))
    # embeddings and norms are not adapted: they must be bit-identical to the warm start
    assert torch.equal(ws.model.embed_tokens.weight, ck.model.embed_tokens.weight)
    assert torch.equal(ws.model.norm.weight, ck.model.norm.weight)

    resumed = killed_at_2_then_resumed(monkeypatch,
                                       run + [f"--out_dir={tmp_path / 'b'}", "--save_every=2"])
    assert full[2]["loss"] != 0.0 and resumed[2]["loss"] == pytest.approx(full[2]["loss"], abs=1e-6)


def test_sparse_kv_budget_in_the_loop(tmp_path, monkeypatch):
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)
    run = TINY_RUN + ["--steps=1", "--page_size=4", "--dense_layers=0", "--max_new_tokens=24",
                      "--save_every=100"]
    dense = train.main(run + [f"--out_dir={tmp_path}", "--kv_budget=dense"])["records"][0]
    sparse = train.main(run + [f"--out_dir={tmp_path}", "--kv_budget=fixed:2",
                               "--kv_keep_recent=1", "--overwrite=true"])["records"][0]
    assert dense["kv_read"] == pytest.approx(1.0) and sparse["kv_read"] < 1.0
    # the read fraction the log gives per layer and per bin is what the engine counted
    layers = sparse["kv_read_layers"]  # dense_layers=0: every layer reads the sparse budget
    assert layers and layers == pytest.approx([sparse["kv_read"]] * len(layers), abs=1e-3)
    with pytest.raises(ValueError, match=r"below the 3 pages every sparse step reads"):
        train.main(run + [f"--out_dir={tmp_path}", "--kv_budget=fixed:2"])  # 1 sink + 2 recent
    with pytest.raises(ValueError, match="kv_budget"):
        train.main(run + [f"--out_dir={tmp_path}", "--kv_budget=fraction:2"])
    with pytest.raises(ValueError, match="kv_budget"):
        train.main(run + [f"--out_dir={tmp_path}", "--kv_budget=sometimes"])


def test_kv_controller_raises_a_table_that_misses_the_target(tmp_path, monkeypatch):
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)
    run = TINY_RUN + ["--steps=3", "--page_size=2", "--dense_layers=0", "--max_new_tokens=24",
                      "--save_every=100", "--kv_budget=table:1,1", "--kv_bin_pages=4",
                      "--kv_keep_first=0", "--kv_keep_recent=1",
                      "--kv_controller=true", "--kv_target=0.999", "--is_correction=none",
                      f"--out_dir={tmp_path}"]
    recs = train.main(run)["records"]
    assert all("alpha_bins" in r and r["kv_table"] for r in recs)
    # one page misses the target (p == p skips the NaN p5 of an empty bin)
    assert any(min(p for p in r["alpha_bins"]["p5"] if p == p) < 0.999 for r in recs)
    first, last = recs[0]["kv_table"], recs[-1]["kv_table"]
    # and the controller raised the budgets of the bins that missed it
    assert sum(last) > sum(first) >= 2
    with pytest.raises(ValueError, match="kv_controller"):
        train.main(TINY_RUN + ["--kv_controller=true", f"--out_dir={tmp_path}"])


@pytest.mark.parametrize("nproc,stale", [(2, 1), (3, 0)])
def test_torchrun_disaggregated_rollout_ranks_end_on_the_trainers_weights(tmp_path, nproc, stale):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={29600 + nproc}", "tests/fake_reward.py", *TINY_RUN, "--steps=3",
           "--threads=1", "--rollout_ranks=1", f"--max_staleness={stale}", f"--out_dir={tmp_path}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [l for l in (r.stdout + r.stderr).splitlines()
            if l.startswith("weight checksum per rank")][0]
    sums = line.split(":")[1].split("(")[0].split()
    # every rollout rank holds exactly the trainers' weights
    assert len(sums) == nproc and len(set(sums)) == 1
    recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r["tokens"] > 0 for r in recs)  # the trainers trained
    shipped = [r["sync_bytes"] for r in recs if "sync_bytes" in r]
    assert shipped and all(0 < b for b in shipped) and all(r["sync_ratio"] <= 1.0
                                                          for r in recs if "sync_ratio" in r)


def test_torchrun_fsdp2_matches_plain_data_parallel(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    recs = {}
    for name, extra, port in (("dp", [], 29711), ("fsdp", ["--fsdp=true"], 29712)):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={port}", "tests/fake_reward.py", *TINY_RUN, "--steps=2",
               "--threads=1", f"--out_dir={out}", *extra]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "(identical)" in r.stdout + r.stderr
        recs[name] = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs["fsdp"][0]["tokens"] > 0
    for a, b in zip(recs["dp"], recs["fsdp"]):  # the same data and the same update, sharded or not
        assert a["tokens"] == b["tokens"] and a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def test_calibrated_schedule_distill_and_dense_comparison_in_the_loop(tmp_path, monkeypatch):
    """kv_budget=calibrate writes a table that schedule:PATH reads back; DistillSparse trains its
    adapter (the policy's weights stay adapter-free) and resumes; kv_compare_every times a dense
    rollout in the same step."""
    import json
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)
    run = TINY_RUN + ["--page_size=2", "--dense_layers=0", "--max_new_tokens=24",
                      "--kv_bin_pages=4", "--kv_candidates=(1,2,4,64)", "--calib_prompts=2",
                      "--kv_target=0.5", "--kv_compare_every=2", "--kv_keep_first=0",
                      "--kv_keep_recent=1"]
    a = train.main(run + ["--steps=1", "--kv_budget=calibrate",
                          f"--out_dir={tmp_path / 'a'}"])["records"]
    sd = json.load(open(tmp_path / "a" / "kv_schedule.json"))
    assert (sd["bin_pages"] == 4 and sd["table"] == sorted(sd["table"])
            and a[0]["kv_table"] == sd["table"])
    assert a[0]["rollout_speedup"] > 0 and a[0]["dense_tok_s"] > 0
    # paired: the dense rollout of the same prompts is scored, the gap is sparse minus dense
    assert a[0]["reward_gap"] == pytest.approx(a[0]["reward"] - a[0]["dense_reward"], abs=1e-6)
    b = run + ["--distill_r=2", f"--kv_budget=schedule:{tmp_path / 'a' / 'kv_schedule.json'}",
               "--save_every=2"]
    recs = killed_at_2_then_resumed(monkeypatch, b + [f"--out_dir={tmp_path / 'b'}"])
    assert len(recs) == 4 and all(r["distill_kl"] >= 0 for r in recs)
    from safetensors.torch import load_file
    assert not any("lora" in k
                   for k in load_file(str(tmp_path / "b" / "ckpt" / "model.safetensors")))
    state = torch.load(tmp_path / "b" / "ckpt" / "trainer_state.pt", weights_only=False)
    # it trained
    assert any(v.abs().sum() > 0 for k, v in state["distill"]["adapter"].items() if "lora_B" in k)
    with pytest.raises(ValueError, match="distill_r"):
        train.main(run + ["--distill_r=2", "--lora_r=2", "--kv_budget=fixed:2",
                          f"--out_dir={tmp_path / 'c'}"])
    with pytest.raises(FileNotFoundError, match="calibrate.py"):
        train.main(run + ["--kv_budget=schedule:/nonexistent.json", f"--out_dir={tmp_path / 'c'}"])


def test_warm_start_curriculum_from_another_config(tmp_path, monkeypatch):
    """sft_init = a config file: that config's warm start is built (in its own out_dir) and SFT
    continues from it; the cache key names the chain, so a second run loads instead of
    rebuilding."""
    import json
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)
    inner = tmp_path / "inner.py"
    inner.write_text(f"out_dir = {str(tmp_path / 'inner')!r}\nn_layer = 1\nn_embd = 32\n"
                     f"n_head = 2\nn_kv_head = 1\nffn = 64\nsft_steps = 2\nsft_batch = 4\n"
                     f"difficulty = (1, 2)\n")
    run = TINY_RUN + ["--steps=1", f"--sft_init={inner}", "--sft_difficulty=(1,3)",
                      f"--out_dir={tmp_path / 'outer'}"]
    train.main(run)
    inner_cfg = config.parse_config([str(inner)])
    assert os.path.exists(os.path.join(cache_path(inner_cfg), "model.safetensors"))
    key = json.load(open(os.path.join(cache_path(config.parse_config(run)), "sft_key.json")))
    # the chain: the first stage's file and its own key (a change there is a new key here)
    assert key["sft_init"]["config"] == str(inner) and key["sft_init"]["key"]["sft_steps"] == 2
    assert key["sft_difficulty"] == [1, 3]
    # another shape is refused
    with pytest.raises(ValueError, match=r"sft_init.*hidden_size 32 \(want 64\)"):
        train.main(TINY_RUN + ["--steps=1", f"--sft_init={inner}", "--n_embd=64", "--n_head=2",
                               f"--out_dir={tmp_path / 'other'}"])
