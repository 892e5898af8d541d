"""
zeros_kernels/linear_cpu.py: the weight matmuls of a small decode batch (at most 8 rows) on a CPU, beside
their reference, F.linear.

    w = linear_cpu_pack(weight)        # (N, K) fp32 -> the kernel's layout, or None (no kernel)
    y = linear_cpu(x, w, N)            # x (..., K) with at most 8 rows -> x @ weight.T, (..., N)

What it does: a decode step multiplies one token per live row by every weight of the model, so its
time is the weights' streaming. linear_cpu.cpp lays each weight out in blocks of 32 output columns,
k-major, and keeps a block's outputs for all rows in vector registers while it reads the block
once, where oneDNN's packed kernel is built for larger batches (`Transformer.packed` uses this one
for batches of at most SMALL_ROWS rows, oneDNN above; `python -m bench rollout` measures the engine
with both).

Where it runs: only on CPUs with AVX-512 (torch.backends.cpu.get_cpu_capability()). Its block keeps
8 rows x 32 columns of fp32 in 16 registers of 16 floats; built for AVX2 (16 registers of 8 floats)
those accumulators spill to memory every step of k, and on an AMD EPYC (AVX2) a decode step of the
bench model ran at 63 tokens/s with it against 557 with oneDNN's kernel. Elsewhere linear_cpu_pack
returns None and the model takes oneDNN's path.

Simplifications:
    1. fp32 only, no bias: the plain nn.Linears of a Qwen3 model.
    2. The sum over K runs in order: its results differ from F.linear's (blocked sums) by rounding
       only, about 1e-6 relative.
"""

import torch

from zeros_kernels.cpu_ext import load_cpu_ext

SMALL_ROWS = 8  # the kernel's largest batch: 8 rows x 32 columns of fp32 fill 16 vector registers


def linear_cpu_available():
    """The kernel is built and this CPU has AVX-512 (its registers: see the docstring above)."""
    return (torch.backends.cpu.get_cpu_capability() == "AVX512"
            and load_cpu_ext("linear_cpu") is not None)


def linear_cpu_pack(weight):
    """weight (N, K) float32 in the kernel's layout (ceil(N / 32), K, 32), or None where the kernel
    does not run (no AVX-512, ZEROS_CPU_KERNEL=0, or no compiler)."""
    if not linear_cpu_available():
        return None
    return load_cpu_ext("linear_cpu").pack(weight.detach().float().contiguous())


def linear_cpu(x, packed, n):
    """x (..., K) float32 with at most SMALL_ROWS rows, times the packed weight: (..., n)."""
    rows = x.reshape(-1, x.shape[-1])
    y = load_cpu_ext("linear_cpu").linear(rows if rows.stride(-1) == 1 else rows.contiguous(),
                                          packed)
    return y[:, :n].reshape(*x.shape[:-1], n)
