"""The Triton decode kernels compile for real GPUs: checked on the CPU, no GPU needed.

tests/test_kernel.py runs the kernels through Triton's interpreter, which accepts what the GPU
compiler rejects (a tl.dot inner dimension below 16) and never takes the bf16 tensor-core path.
Here each variant that block_sparse_decode can launch (zeros_kernels.block_sparse_decode's
launch_configs) is compiled ahead of time for sm_80 (A100) and sm_90 (H100, H200): Triton lowers it
to PTX and the ptxas that ships in Triton's wheel (or TRITON_PTXAS_PATH) assembles it. The
launches are the wrapper's own: it is called on CPU tensors laid out as the engine's cache, with
each kernel swapped for a recorder, and each recorded launch is compiled with the arguments'
specialization as the JIT makes it (a stride of 1 is a constant, multiples of 16 are marked),
which decides the registers: compiled with plain i32 strides instead, the bf16 variant spills.
Each variant's registers and spills come from ptxas's log; none may spill.

Triton reads TRITON_INTERPRET when the kernel module is imported, so the compiles run in a child
process without it (conftest.py turns the interpreter on for the test session). The child's Triton
cache is a temporary folder: every run compiles afresh.

Run: python -m pytest tests/test_kernel_compile.py -s   (prints the table; 24 compiles, about 20
CPU-seconds, spread over the cores)
"""
import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = (80, 90)  # compute capabilities: A100, H100/H200
SHAPES = dict(H_kv=8, G=2, D=128)  # Qwen3's attention (0.6B to 8B), as configs/*_qwen3.py run it


def test_every_variant_compiles_for_sm80_and_sm90_without_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton has no CUDA backend")
    from triton import knobs
    try:
        ptxas = {80: knobs.nvidia.ptxas, 90: knobs.nvidia.ptxas_blackwell}  # as Triton picks them
    except RuntimeError as e:
        pytest.skip(f"no ptxas (Triton's wheel ships it; else set TRITON_PTXAS_PATH): {e}")
    try:  # what JITFunction.run specializes the arguments with
        from triton.runtime.jit import native_specialize_impl  # noqa: F401
    except ImportError:
        pytest.skip("this Triton's JIT specializes arguments otherwise (the test follows 3.9)")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "TRITON_ALWAYS_COMPILE": "1", "TRITON_DUMP_PTXAS_LOG": "1",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    table = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, __file__, str(table)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(table.read_text())

    print("\n" + ", ".join(f"sm_{a}: ptxas {t.version}" for a, t in ptxas.items()))
    print(f"{'variant':<56} {'sm':>3} {'warps':>5} {'regs':>5} {'spill B':>7}  tensor cores")
    for r in rows:
        print(f"{r['name']:<56} {r['arch']:>3} {r['num_warps']:>5} {r['regs'] or '-':>5} "
              f"{'-' if r['spills'] is None else r['spills']:>7}  {r['mma']}")
    assert {r["arch"] for r in rows} == set(TARGETS) and len(rows) >= 2 * len(TARGETS)
    failed = [f"{r['name']} sm_{r['arch']}:\n{r['error']}" for r in rows if r["error"]]
    assert not failed, "the GPU compiler rejects:\n" + "\n".join(failed)
    spilled = [f"{r['name']} sm_{r['arch']}: {r['spills']} bytes" for r in rows if r["spills"]]
    assert not spilled, "spills registers to local memory: " + "; ".join(spilled)
    for r in rows:  # bf16/fp16 caches multiply on the tensor cores, fp32 ones exactly on the FMAs
        if r["name"].startswith("decode"):
            assert r["mma"] == ("kv=fp32" not in r["name"]), r["name"]


# -----------------------------------------------------------------------------
# the child process: record the wrapper's launches, compile each for each target


class Recorder:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def engine_call(bsd, torch, kv, q_dtype, page_size, num_splits, dense):
    """Call the wrapper as the rollout engine does: one layer of the head-major pool (kvcache.py)
    viewed as (num_pages, page_size, H_kv, D), a page table, and a dense selection (broadcast
    views, decode_attention's) or a sparse one (contiguous)."""
    H_kv, G, D = SHAPES["H_kv"], SHAPES["G"], SHAPES["D"]
    B, max_pages = 4, 8 * num_splits
    k, v = (torch.zeros(H_kv, B * max_pages * page_size, D, dtype=kv)
            .view(H_kv, -1, page_size, D).permute(1, 2, 0, 3) for _ in range(2))
    q = torch.zeros(B, 1, H_kv * G, D, dtype=q_dtype).transpose(1, 2)[:, :, 0]  # (B, H_q, D)
    table = torch.arange(B * max_pages, dtype=torch.int32).view(B, max_pages)
    lens = torch.full((B,), max_pages * page_size, dtype=torch.int32)
    if dense:
        sel, n_sel = bsd.dense_selection(table, lens, H_kv, page_size)
    else:
        sel = torch.arange(max_pages, dtype=torch.int32).repeat(B, H_kv, 1)
        n_sel = torch.full((B, H_kv), max_pages, dtype=torch.int32)
    bsd.block_sparse_decode(q, k, v, table, lens, sel, n_sel, num_splits=num_splits)


def record_launches():
    """Every distinct launch of the wrapper over launch_configs(): a list of (name, kernel name,
    signature, constexprs, attrs, options), as triton.compile takes them. Dense and sparse
    selections alternate down the list (their strides specialize differently; the registers
    barely differ), so both are compiled and the test stays fast."""
    import torch
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl  # the JIT's own specialization

    import zeros_kernels.block_sparse_decode as bsd

    kernels = {name: getattr(bsd, name) for name in
               ("_block_sparse_decode_kernel", "_merge_splits_kernel")}
    recorders = {name: Recorder() for name in kernels}
    launches = {}
    try:
        for name, rec in recorders.items():
            setattr(bsd, name, rec)
        for i, (kv, q_dtype, page_size, num_splits) in enumerate(bsd.launch_configs()):
            dense = i % 2 == 0
            engine_call(bsd, torch, kv, q_dtype, page_size, num_splits, dense)
            for kname, rec in recorders.items():
                for args, kwargs in rec.launches:
                    key = _compile_args(kernels[kname], args, kwargs, CUDABackend,
                                        native_specialize_impl)
                    launches.setdefault(key, _describe(kname, kv, q_dtype, page_size,
                                                       num_splits, dense, kwargs))
                rec.launches.clear()
    finally:
        for name, fn in kernels.items():
            setattr(bsd, name, fn)
    return [(name, *json.loads(key)) for key, name in launches.items()]


def _compile_args(fn, args, kwargs, backend, specialize):
    """What JITFunction.run hands triton.compile for this launch, as a JSON key."""
    signature, constexprs, attrs = {}, {}, []
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    for i, p in enumerate(fn.params):
        if p.name in kwargs:
            signature[p.name], constexprs[p.name] = "constexpr", kwargs[p.name]
            continue
        ty, spec = specialize(backend, args[i], False, True, True)  # not const, specialize, align
        signature[p.name] = ty
        if ty == "constexpr":  # an int equal to 1
            constexprs[p.name] = spec
        elif isinstance(spec, str) and backend.parse_attr(spec):
            attrs.append([i, backend.parse_attr(spec)])
    return json.dumps([fn.__name__, signature, constexprs, attrs, options])


def _describe(kname, kv, q_dtype, page_size, num_splits, dense, kwargs):
    short = lambda dt: str(dt).removeprefix("torch.").replace("bfloat", "bf").replace("float", "fp")
    sel = "dense" if dense else "sparse"
    if kname == "_merge_splits_kernel":
        return f"merge out={short(q_dtype)} BLOCK_S={kwargs['BLOCK_S']}"
    return (f"decode kv={short(kv)} q={short(q_dtype)} page={page_size} tile={kwargs['BLOCK_N']} "
            f"splits={num_splits} {sel}")


def compile_one(job):
    """Compile one launch for one target; its row of the table. ptxas's log (printed by Triton
    under TRITON_DUMP_PTXAS_LOG) gives the registers and the bytes of spill stores."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import zeros_kernels.block_sparse_decode as bsd

    arch, (name, kname, signature, constexprs, attrs, options) = job
    row = dict(name=name, arch=arch, num_warps=options.get("num_warps", 4), regs=None,
               spills=None, mma=None, error=None)
    src = ASTSource(getattr(bsd, kname), signature, constexprs,
                    {(i,): spec for i, spec in attrs})
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as e:  # the compiler's own message, for the table
        row["error"] = f"{type(e).__name__}: {e}"[-2000:]
        return row
    regs = re.search(r"Used (\d+) registers", log.getvalue())
    spills = re.search(r"(\d+) bytes spill stores", log.getvalue())
    if regs is None or spills is None:
        row["error"] = "no ptxas log to read: " + log.getvalue()[-500:]
        return row
    row.update(regs=int(regs.group(1)), spills=int(spills.group(1)),
               mma="mma" in kernel.asm["ptx"])
    return row


def main(out_path):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import zeros_kernels.block_sparse_decode as bsd

    assert not bsd._INTERPRET, "run with TRITON_INTERPRET=0: the interpreter replaces @triton.jit"
    launches = record_launches()
    jobs = [(arch, launch) for launch in launches for arch in TARGETS]
    # fork: the workers share the imported modules (no GPU, no CUDA context to break)
    with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1),
                             mp_context=multiprocessing.get_context("fork")) as pool:
        rows = list(pool.map(compile_one, jobs))
    with open(out_path, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1])
