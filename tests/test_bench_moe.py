"""`python -m bench moe --quick`: the router-replay comparison end to end at toy sizes (a one-layer
MoE, a 3-step warm start, 2 RL steps per arm), so the command that writes the results is known to
run."""
import bench.moe


def test_moe_bench_runs_and_replay_zeroes_the_disagreement_it_trains_on(tmp_path, monkeypatch):
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)  # rewards with spread: the untrained model's groups train
    monkeypatch.setattr(bench.moe, "ROOT", str(tmp_path))  # its warm start and plot go there
    rows = bench.moe.run(quick=True, cmd="python -m bench moe --quick")
    assert rows[:2] == bench.moe.TABLE_HEAD and len(rows) == 16
    diff = rows[2].split(" | ")
    assert float(diff[1]) == 0.0  # replay: the training forward routes as the rollout did
    assert (tmp_path / "out" / "bench_moe.png").exists()
