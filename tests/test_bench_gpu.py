"""`python -m bench gpu` at toy sizes: on a machine without a GPU it runs through Triton's interpreter,
so the command a GPU session runs is known to work before the GPU is there."""
import os

import bench.gpu


def test_gpu_bench_runs_at_toy_sizes_and_checks_what_it_times(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it writes out/bench_gpu.md
    rows = bench.gpu.run(quick=True, cmd="python -m bench gpu --quick")
    a = [r for r in rows if r.startswith("| (a)")]
    assert len(a) == 3 and all(r.endswith("| ok |") for r in a)  # fp32, bf16, fp16 against the reference
    b = [r for r in rows if r.startswith("| (b)")]
    assert len(b) == 3 and all(float(r.split("flex err ")[1].split(" ")[0]) < 1e-3 for r in b)
    c = [r for r in rows if r.startswith("| (c)")]  # dense against 1/8, and the lossless row
    assert len(c) == 2 and 0 < float(c[1].split("acceptance ")[1].split(" ")[0]) <= 1
    d = [r for r in rows if r.startswith("| (d)")]  # 2:4 semi-structured: runs or skips cleanly
    assert d and (all("ms" in r or "failed" in r for r in d) if bench.gpu.torch.cuda.is_available()
                  else d == ["| (d) 2:4 semi-structured vs masked dense | skipped: no GPU | | |"])
    f = [r for r in rows if r.startswith("| (f)")]  # the engine against transformers' generate
    assert [r.split(", ")[1] for r in f] == ["float32", "bfloat16"]
    assert "2/2 rows identical" in f[0]  # fp32 at toy sizes: the same greedy path
    g = [r for r in rows if r.startswith("| (g)")]  # train.py's RL steps, three rollout modes
    assert [r.split(", ")[1] for r in g] == ["dense", "sparse decode", "speculative"]
    assert all("| finite loss and grad norms" in r and " 0 tokens trained" not in r for r in g)
    assert (tmp_path / "out" / "bench_gpu.md").read_text().splitlines() == rows
    assert os.environ.get("TRITON_INTERPRET") == "1" or bench.gpu.torch.cuda.is_available()
