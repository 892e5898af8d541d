"""
bench/syncbytes.py: stage 5. The bytes that a bf16 rollout copy's delta ships per step, against the
full bf16 model's, at learning rates 1e-6, 1e-5 and 1e-4, as the run logs them (sync_bytes,
sync_full_bytes and sync_changed in metrics.jsonl).

Each run is configs/sharpen.py (the earlier default, a fixed workload: the tiny model's warm start
on the synthetic task) with rollout_copy=bf16. After every optimizer step the copy takes a delta in bf16: only the
weights whose bf16 bits changed, checked by checksum against the trainer's cast (sync.Sender and
Receiver; the disaggregated mode ships the same update). An Adam step moves every fp32 weight, but
at small learning rates most moves fall below bf16's resolution and leave the copy's bits as they
were: those cost nothing.

Simplifications:
    1. A few steps per learning rate, without warmup, so every step runs at about that rate (the
       60-step cosine schedule barely moves in so few steps). The figure is the mean over the steps
       and the largest step's.
    2. "Full" is the bf16 copy's bytes (the fp32 policy's are twice that).
    3. Held-out evaluation is cut to a few problems; its numbers are not reported.
    4. The runs write under out/ (removed after), so they share that config's cached warm start
       (out/warmstart-cache), built once if it is missing.

    python -m bench syncbytes --threads 1   # a few minutes on 2 cores
    python -m bench syncbytes --quick       # 2 steps per rate: a smoke run
"""

import os
import shutil

import train
from bench.common import TABLE_HEAD, hardware

RATES = (1e-6, 1e-5, 1e-4)
TARGET = {1e-5: "<= 10% of full"}


def run(quick, cmd):
    """-> the table, head included: one row per learning rate."""
    hw = hardware()
    steps = 2 if quick else 6
    args = ["configs/sharpen.py", "--rollout_copy=bf16", "--warmup_steps=0", f"--stop_at={steps}", "--plot=false",
            "--eval_every=1000", "--n_eval=10", "--eval_sampled=false", "--save_every=1000"]
    rows = []
    for lr in RATES:
        out = os.path.join("out", f"bench-syncbytes-lr{lr:g}")  # beside the warm start's cache
        try:
            recs = train.main(args + [f"--lr={lr}", f"--out_dir={out}", "--overwrite=true"])[
                "records"]
        finally:
            shutil.rmtree(out, ignore_errors=True)
        recs = [r for r in recs if "sync_bytes" in r and r["tokens"] > 0]
        mean = lambda k: sum(r[k] for r in recs) / len(recs)
        worst = max(r["sync_ratio"] for r in recs)
        rows.append(f"| bf16 copy: delta bytes per step at lr {lr:g} (mean over {len(recs)} "
                    f"steps; largest step {worst:.1%}; weights whose bf16 bits changed "
                    f"{mean('sync_changed'):.1%}) | {mean('sync_bytes'):,.0f} B | "
                    f"{recs[0]['sync_full_bytes']:,} B (full bf16) | "
                    f"{mean('sync_ratio'):.3f}x | {TARGET.get(lr, '')} | {hw} | `{cmd}` |")
        print(rows[-1], flush=True)
    return TABLE_HEAD + rows
