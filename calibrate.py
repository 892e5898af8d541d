"""
calibrate.py: the offline half of Sparrow's schedule. For a model and a task, sweep KV budgets on a calibration
batch and write the smallest budget per bin of cached length that keeps the 5th percentile of alpha at or above
the threshold.

    python calibrate.py configs/longcot.py                     # -> out/longcot/kv_schedule.json, and printed
    python calibrate.py configs/longcot.py --kv_target=0.9 --calib_prompts=32
    python train.py configs/longcot.py --kv_budget=schedule:out/longcot/kv_schedule.json --kv_controller=true
    python train.py configs/longcot.py --kv_budget=calibrate   # the same sweep at the start of the run

What it does:
    1. Builds the policy the run would start from (the warm start, or the Hugging Face model), and takes the
       first `calib_prompts` training prompts, `group_size` rollouts each, at the run's temperature.
    2. sparsity.calibrate_engine: one sparse generation per candidate budget in `kv_candidates` (pages read per
       step, the same in every bin), a dense forward over the same tokens, alpha per token and its p5 per bin of
       `kv_bin_pages` pages, and for each bin the first candidate that reaches `kv_target`.
    3. Writes the Schedule (table, bin_pages, threshold) and what it was calibrated on as JSON; the run loads it
       with kv_budget=schedule:PATH, and kv_controller=true keeps it on target as the policy moves.

A bin that no candidate satisfies is an error that names it: add larger candidates (a candidate at least as
large as the bin's cached pages reads it densely, so it always passes).
"""

import json
import os
import sys
import time

import torch


def calibrated_schedule(cfg, model, tok, pool_ids, log=print):
    """The sweep on the run's own settings -> a sparsity.Schedule."""
    from sparsity import calibrate_engine
    prompt_ids = pool_ids[:cfg.calib_prompts]
    if not prompt_ids:
        raise ValueError("calibrate: no training prompts to calibrate on")
    t0 = time.perf_counter()
    log(f"calibrating the KV schedule: {len(prompt_ids)} prompts x {cfg.group_size} rollouts, candidates "
        f"{list(cfg.kv_candidates)} pages, bins of {cfg.kv_bin_pages} pages, p5 alpha >= {cfg.kv_target}")
    sched = calibrate_engine(model, tok, prompt_ids, cfg.kv_candidates, cfg.kv_bin_pages, group_size=cfg.group_size,
                             threshold=cfg.kv_target, seed=cfg.seed, min_count=20, max_new_tokens=cfg.max_new_tokens,
                             temperature=cfg.temperature, page_size=cfg.page_size, scorer=cfg.kv_scorer,
                             dense_layers=cfg.dense_layers, stop=[cfg.stop] if cfg.stop else [])
    log(f"calibrated in {time.perf_counter() - t0:.0f} s: table {sched.table} (pages read per bin of "
        f"{cfg.kv_bin_pages} pages)")
    return sched


def save_schedule(sched, path, cfg):
    with open(path + ".tmp", "w") as f:
        json.dump({**sched.state_dict(), "calibrated_on": {k: getattr(cfg, k) for k in (
            "model", "task", "difficulty", "page_size", "kv_scorer", "dense_layers", "calib_prompts", "group_size",
            "temperature", "max_new_tokens", "kv_candidates")}}, f, indent=1)
    os.replace(path + ".tmp", path)


def load_schedule(path, page_size=None):
    """A schedule written by save_schedule -> sparsity.Schedule. A page size other than the one it was calibrated
    for is refused: its bins and budgets count pages."""
    from sparsity import Schedule
    try:
        with open(path) as f:
            sd = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"kv_budget=schedule:{path}: no such file (write one with python calibrate.py "
                                f"CONFIG)") from None
    made = sd.get("calibrated_on", {}).get("page_size")
    if page_size is not None and made is not None and made != page_size:
        raise ValueError(f"{path} was calibrated for page_size={made}, the run has page_size={page_size}")
    sched = Schedule([1], 1)
    sched.load_state_dict(sd)
    return sched


def main(argv):
    import train
    cfg = train.parse_config(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    _, _, dev = train.setup_dist(cfg)
    os.makedirs(cfg.out_dir, exist_ok=True)
    model, tok = train.build_policy(cfg, dev, print)
    problems, _ = train.load_problems(cfg)
    _, pool_ids = train.encode_pool(tok, problems, cfg, model.config.max_position_embeddings, print)
    sched = calibrated_schedule(cfg, model.eval(), tok, pool_ids)
    path = os.path.join(cfg.out_dir, "kv_schedule.json")
    save_schedule(sched, path, cfg)
    print(f"wrote {path}; train with --kv_budget=schedule:{path} --kv_controller=true")
    return sched


if __name__ == "__main__":
    main(sys.argv[1:])
