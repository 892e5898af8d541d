"""`python -m bench gpu` at toy sizes: on a machine without a GPU it runs through Triton's
interpreter, so the command a GPU session runs is known to work before the GPU is there. Each row
reaches out/bench_gpu.md as soon as it is measured, and a part (or an RL arm) that fails is a row
with its error while the others run."""
import os

import bench.gpu


def test_gpu_bench_runs_at_toy_sizes_and_checks_what_it_times(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it writes out/bench_gpu.md
    rows = bench.gpu.run(quick=True, cmd="python -m bench gpu --quick")
    assert not [r for r in rows if "FAILED" in r], [r for r in rows if "FAILED" in r]
    a = [r for r in rows if r.startswith("| (a)")]
    # fp32, bf16, fp16 against the reference
    assert len(a) == 3 and all(r.endswith("| ok |") for r in a)
    b = [r for r in rows if r.startswith("| (b)")]
    assert len(b) == 3 and all(float(r.split("flex err ")[1].split(" ")[0]) < 1e-3 for r in b)
    c = [r for r in rows if r.startswith("| (c)")]  # dense against 1/8, and the lossless row
    assert len(c) == 4 and 0 < float(c[1].split("acceptance ")[1].split(" ")[0]) <= 1
    # the captured step against eager (on a CPU both eager), dense and 1/8: the same greedy tokens
    assert all("captured" in r and "tokens identical" in r for r in c[2:]), c[2:]
    d = [r for r in rows if r.startswith("| (d)")]  # 2:4 semi-structured: runs or skips cleanly
    assert d and (all("ms" in r or "failed" in r for r in d) if bench.gpu.torch.cuda.is_available()
                  else d == ["| (d) 2:4 semi-structured vs masked dense | skipped: no GPU | | |"])
    f = [r for r in rows if r.startswith("| (f)")]  # the engine against transformers' generate
    assert [r.split(", ")[1] for r in f] == ["float32", "bfloat16"]
    assert "2/2 rows identical" in f[0]  # fp32 at toy sizes: the same greedy path
    g = [r for r in rows if r.startswith("| (g)")]  # train.py's RL steps, three rollout modes
    assert [r.split(", ")[1] for r in g] == ["dense", "sparse decode", "speculative"]
    assert all("| finite loss and grad norms" in r and " 0 tokens trained" not in r for r in g)
    # the memory model's figure beside the peak, the cost model's beside the step time
    assert all("predicted by memory.py" in r and "the cost model's floor" in r for r in g)
    assert (tmp_path / "out" / "bench_gpu.md").read_text().splitlines() == rows
    assert os.environ.get("TRITON_INTERPRET") == "1" or bench.gpu.torch.cuda.is_available()


def test_rows_are_written_as_they_finish_and_a_failing_part_is_a_row(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    table = tmp_path / "out" / "bench_gpu.md"
    on_disk = []

    def first(dev, quick):
        yield "| (a) one | 1 | | |"
        yield "| (a) two | 2 | | |"

    def broken(dev, quick):
        on_disk.append(table.read_text().splitlines()[-2:])  # what the file held when it started
        yield "| (b) kept | 3 | | |"
        raise RuntimeError("CUDA out of memory | tried\nthe second line")

    def after(dev, quick):
        yield "| (c) ran | 4 | | |"

    monkeypatch.setattr(bench.gpu, "PARTS", {"a": ("first", first), "b": ("broken", broken),
                                             "c": ("after", after)})
    rows = bench.gpu.run(quick=True, cmd="x")
    assert on_disk == [["| (a) one | 1 | | |", "| (a) two | 2 | | |"]]
    assert rows[-4:] == ["| (a) two | 2 | | |", "| (b) kept | 3 | | |",
                         "| (b) broken | FAILED: RuntimeError: CUDA out of memory / tried | | |",
                         "| (c) ran | 4 | | |"]
    assert table.read_text().splitlines() == rows


def test_a_failing_rl_arm_is_a_row_and_the_next_arm_runs(monkeypatch):
    def arm(dev, folder, out_dir, quick, extra, rates):
        if extra and "speculative" not in " ".join(extra):
            raise ValueError("predicted peak memory 90.00 GiB exceeds the 79.10 GiB of the GPU")
        return " | step | peak | finite loss and grad norms, 1 tokens trained |"

    monkeypatch.setattr(bench.gpu, "rl_arm", arm)
    monkeypatch.setattr(bench.gpu, "gpu_rates", lambda dev: (1e9, 1e9))
    rows = list(bench.gpu.rl_steps("cpu", quick=True))
    assert [r.split(", ")[1] for r in rows] == ["dense", "sparse decode", "speculative"]
    assert "FAILED: ValueError: predicted peak memory 90.00 GiB" in rows[1]
    assert "finite" in rows[0] and "finite" in rows[2]
