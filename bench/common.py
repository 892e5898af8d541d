"""
bench/common.py: what every section shares. The hardware string a row names, the timer, the table's
row and head, the writer of bench/RESULTS.md (report.write_block), and the random model the speed
sections time.

Simplifications:
    1. A time is the best of a few runs after a warm-up (the minimum is the least noisy estimate of
       the cost); the two sides of a ratio take turns, so a drifting machine load hits both.
    2. On a machine shared with other work, `--threads 1` gives steadier numbers than several
       threads that wait on each other; the hardware string records the thread count.
    3. The results writer replaces one marked block and leaves the rest of the file alone; when the
       file or a marker is missing it writes nothing (the table is printed either way).

    python -m bench rollout --quick --write-results    # rewrites the rollout block of RESULTS.md
"""

import os
import time

import torch

from model import ModelConfig, Transformer
from report import RESULTS, hardware, write_block  # noqa: F401  (the sections import them here)

TABLE_HEAD = ["| figure | ours | baseline | ratio | target | hardware | command |",
              "|---|---|---|---|---|---|---|"]


def best_of(fns, repeats, warmup=1):
    """{name: fn} -> {name: minimum wall time of fn()}. The functions take turns, so a machine whose
    load drifts during the run slows both sides of a ratio alike. Syncs the GPU around each run."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def row(figure, ours, base, ratio, target, hw, cmd):
    """One line of the seven-column table (TABLE_HEAD)."""
    return f"| {figure} | {ours} | {base} | {ratio:.2f}x | {target} | {hw} | `{cmd}` |"


class _Ids:
    """The engine needs a tokenizer only for the pad and EOS ids and to decode texts, which nobody
    reads here."""
    pad_token_id, eos_token_id = 0, None

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["" for _ in rows]


def bench_model(max_len):
    """A ~12M-parameter Qwen3-shaped model, random: big enough that the forward, not Python, sets
    the pace on a CPU. Speed does not depend on the weights."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=max_len)
    return Transformer(cfg).eval()
