"""
checkpoint.py: atomic save and exact resume.

    python train.py --save_every=20  # out_dir/ckpt, rewritten every 20 steps and at the end
    python train.py --resume=true    # continue from out_dir/ckpt: the same next loss as unbroken
    python train.py --resume=true --steps=300 --resume_override=steps  # ... on a longer schedule
    python train.py --overwrite=true # replace the run in out_dir (without it, the run is refused)

The run's folder (claim_out_dir, before any work): a run refuses an out_dir that holds a run (a
checkpoint or metrics.jsonl) unless resume=true continues it or overwrite=true replaces it, and
resume=true refuses one without a checkpoint. A resume keeps the checkpoint's settings: one that
changes the run's maths (steps, lr, ...; any key but RESUME_FREE) is refused unless
--resume_override=KEY,... names it, and the first run's config.json is kept beside the resume's
config.resume-<step>.json. A finished run resumed says "already complete" and does nothing. Ctrl-C
prints resume_note: the step the run was at, the last checkpoint and its step, and the command that
resumes.

trained_config reads what a saved folder records of the data it was trained on (a checkpoint's
config, a warm start's sft_key.json, roi.py's nm.json): roi.py fits its masks on that data.

A checkpoint is a Hugging Face folder (config.json, model.safetensors, the tokenizer), so
transformers and other engines load the trained model as it is, plus trainer_state.pt: the step, the
optimizer, the sampler, the run's history, the RNG state, the config, and the state of whatever else
the run keeps (the KV schedule, its controller, the DistillSparse adapter).

With LoRA:
    ckpt/                  the merged model (base + adapter folded in): what transformers loads
    ckpt/adapter/          the adapter alone, in PEFT's format; its adapter_config.json names the
                           base (cfg.model, or out_dir/warmstart as an absolute path)
    The adapter is kept out of ckpt/ itself because transformers, with PEFT installed, applies an
    adapter_config.json that it finds beside model.safetensors: the merged weights would get the
    adapter a second time. Resume loads the adapter from ckpt/adapter/ onto the base weights the
    run built (from an older checkpoint that kept it in ckpt/, from there).

Simplifications:
    1. One checkpoint, overwritten; no history of checkpoints.
    2. A kill at any moment leaves a complete checkpoint: the new folder is written beside the old
       one and swapped in with renames (see save_atomic). The swap itself is two renames, so load
       also looks at the `.old` folder that a kill between them leaves.
    3. Under FSDP the optimizer state is sharded, and resume is not supported yet: it is not saved.
"""

import dataclasses
import json
import os
import shlex
import shutil
import sys

import torch
from safetensors.torch import load_file

from config import last_step, split_args
from model import load_adapter, save_adapter


def save_atomic(path, write):
    """Write a folder with write(tmp_dir), then swap it in with renames. A kill at any point leaves
    either the old complete folder at `path`, or (between the two renames) the old one at
    `path.old`, which load looks at."""
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    for d, _, files in os.walk(tmp):  # flush file contents before the rename makes them visible
        for fn in files:
            with open(os.path.join(d, fn), "rb") as f:
                os.fsync(f.fileno())
    if os.path.exists(path):
        shutil.rmtree(f"{path}.old", ignore_errors=True)
        os.replace(path, f"{path}.old")
    os.replace(tmp, path)
    shutil.rmtree(f"{path}.old", ignore_errors=True)


def save_checkpoint(cfg, model, tok, opt, sampler, step, history, extra, base=None):
    """out_dir/ckpt. `extra` maps a name to an object with state_dict() (or None): the run's other
    state. `base`: the model a LoRA adapter sits on (default cfg.model, or out_dir/warmstart)."""
    state = {"step": step, "opt": None if cfg.fsdp else opt.state_dict(),
             "sampler": sampler.state_dict(), "history": history,
             **{k: None if v is None else v.state_dict() for k, v in extra.items()},
             "torch_rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg)}

    base = base or cfg.model or os.path.join(cfg.out_dir, "warmstart")  # what the adapter sits on
    if os.path.isdir(base) or not cfg.model:  # a folder: absolute, so PEFT finds it from anywhere
        base = os.path.abspath(base)

    def write(d):
        model.save_pretrained(d)  # the adapter folded in
        tok.save_pretrained(d)
        if cfg.lora_r:
            save_adapter(model, os.path.join(d, "adapter"), base)
        torch.save(state, os.path.join(d, "trainer_state.pt"))

    save_atomic(os.path.join(cfg.out_dir, "ckpt"), write)


def find_checkpoint(out_dir):
    """The folder of out_dir's complete checkpoint: ckpt, or the ckpt.old that a kill between
    save_atomic's two renames leaves; None if there is none."""
    for path in (os.path.join(out_dir, "ckpt"), os.path.join(out_dir, "ckpt.old")):
        if os.path.exists(os.path.join(path, "trainer_state.pt")):
            return path
    return None


def load_checkpoint(cfg, model, opt, sampler, dev, extra):
    """Restore what save_checkpoint wrote (into `extra`'s objects too, where both sides have them).
    Returns (the step to continue from, the history)."""
    path = find_checkpoint(cfg.out_dir)
    if path is None:
        raise FileNotFoundError(f"resume=True but there is no checkpoint in {cfg.out_dir}/ckpt")
    if cfg.lora_r:
        # model.safetensors holds the merged weights (for other engines); resume from the adapter
        adapter = os.path.join(path, "adapter")
        load_adapter(model, adapter if os.path.isdir(adapter) else path)
    else:
        sd = load_file(os.path.join(path, "model.safetensors"), device=str(dev))
        model.load_state_dict(sd, strict=not model.config.tie_word_embeddings)
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location=dev, weights_only=False)
    opt.load_state_dict(state["opt"])
    sampler.load_state_dict(state["sampler"])
    for k, obj in extra.items():
        # the KV table as the controller left it, the rollout-only adapter, ...
        if state.get(k) and obj is not None:
            obj.load_state_dict(state[k])
    torch.set_rng_state(state["torch_rng"].cpu())
    return state["step"], state["history"]


def trained_config(model_dir):
    """What MODEL_DIR records of the data it was trained on -> ({config key: value}, the file) or
    ({}, ""): trainer_state.pt's config (train.py's checkpoint), sft_key.json (a warm start: its
    SFT range is the difficulty) or nm.json's (a folder roi.py wrote): the data roi.py fits a mask
    on."""
    state, key, nm = (os.path.join(model_dir, f) for f in ("trainer_state.pt", "sft_key.json",
                                                           "nm.json"))
    if os.path.exists(state):
        return torch.load(state, map_location="cpu", weights_only=False, mmap=True)["config"], state
    if os.path.exists(key):
        with open(key) as f:
            rec = json.load(f)
        return {"task": "synthetic", **rec, "sft_seed": rec.get("seed", -1),
                "difficulty": rec["sft_difficulty"]}, key  # a synthetic key names no task
    if os.path.exists(nm):
        with open(nm) as f:
            rec = json.load(f).get("config", {})
        return rec, nm if rec else ""
    return {}, ""


# ----------------------------------------------------------------------------- the run's folder

RUN_FILES = ("ckpt", "ckpt.old", "metrics.jsonl")  # what says that a folder holds a run
REPLACED = RUN_FILES + ("ckpt.tmp", "run.png", "ledger.png", "summary.json")  # overwrite removes
# the keys a resume may change freely: where the run writes and how often, what it shows, the
# machine it runs on, and where it stops on its schedule; any other change is the run's maths
RESUME_FREE = ("out_dir", "resume", "resume_override", "overwrite", "threads", "device",
               "eval_every", "save_every", "plot", "tracker", "stop_at")


def claim_out_dir(cfg, rank=0, log=print):
    """Before any work: out_dir (a folder, for a run of at least one step) is this run's.
    resume=true needs a checkpoint there (check_resume); otherwise a folder that holds a run (a
    checkpoint or metrics.jsonl) is refused, unless overwrite=true, which removes that run's
    checkpoint, metrics.jsonl, pictures and summary.json (REPLACED; rank 0). Then rank 0 writes
    the config to out_dir/config.json (a resume: config.resume-<step>.json, the first run's
    kept). -> True when a resumed run is already complete: nothing to do."""
    if not cfg.out_dir:
        raise ValueError("config key 'out_dir' is empty: give the run a folder, e.g. "
                         "--out_dir=out/run")
    if cfg.steps < 1:  # a run of no steps would leave a folder that holds no run
        raise ValueError(f"config key 'steps' is {cfg.steps}: nothing to run; give --steps=1 or "
                         f"more (python train.py --help shows the config without running)")
    if cfg.resume and cfg.overwrite:
        raise ValueError("config keys 'resume' and 'overwrite': choose one (resume continues the "
                         "run in out_dir, overwrite replaces it)")
    if cfg.resume_override and not cfg.resume:
        raise ValueError("config key 'resume_override' names the keys a resume may change: it "
                         "needs --resume=true")
    saved = check_resume(cfg) if cfg.resume else None
    if saved is not None and saved > last_step(cfg):
        more = ("a larger --stop_at" if cfg.stop_at and cfg.stop_at < cfg.steps else
                "a larger --steps and --resume_override=steps")
        log(f"out_dir {cfg.out_dir}: the run is already complete ({saved} of {last_step(cfg) + 1}"
            f" steps; its log is metrics.jsonl, its plot run.png); to train it longer, resume "
            f"with {more}")
        return True
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(cfg.out_dir, f))]
    if held and not cfg.resume and not cfg.overwrite:
        raise FileExistsError(
            f"out_dir {cfg.out_dir} already holds a run ({', '.join(held)}): --resume=true "
            f"continues it, --overwrite=true replaces it, or give this run its own folder with "
            f"--out_dir=<folder>")
    if held and cfg.overwrite and rank == 0:
        log(f"overwrite=true: removing the run in {cfg.out_dir} ({', '.join(held)})")
        for name in REPLACED:
            f = os.path.join(cfg.out_dir, name)
            if os.path.isdir(f):
                shutil.rmtree(f)
            elif os.path.exists(f):
                os.remove(f)
    os.makedirs(cfg.out_dir, exist_ok=True)
    if rank == 0:
        name = f"config.resume-{saved}.json" if cfg.resume else "config.json"
        with open(os.path.join(cfg.out_dir, name), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
    return False


def check_resume(cfg):
    """resume=true: out_dir's checkpoint, and this run's settings against the ones it was saved
    with: a key that changes the run's maths (any key but RESUME_FREE) may differ only where
    resume_override names it. -> the step the run continues from."""
    path = find_checkpoint(cfg.out_dir)
    if path is None:
        what = ("does not exist" if not os.path.isdir(cfg.out_dir) else
                "holds no checkpoint (ckpt/trainer_state.pt)")
        raise FileNotFoundError(f"resume=true, but out_dir {cfg.out_dir} {what}: give the "
                                f"--out_dir= of the run to continue, or leave out --resume=true")
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", mmap=True,
                       weights_only=False)
    now, was = dataclasses.asdict(cfg), json.loads(json.dumps(state["config"]))
    named = cfg.resume_override.split(",") if cfg.resume_override else []
    unknown = [k for k in named if k not in now]
    if unknown:
        raise ValueError(f"config key 'resume_override' names {', '.join(unknown)}, which are "
                         f"not config keys")
    moved = [k for k in now if k in was and k not in RESUME_FREE + tuple(named)
             and json.loads(json.dumps(now[k])) != was[k]]
    if moved:
        what = ", ".join(f"{k} {was[k]!r} -> {now[k]!r}" for k in moved)
        raise ValueError(f"resume=true: this run changes {what} from the checkpoint's config "
                         f"({path}), which changes the run's maths (steps: the learning-rate "
                         f"schedule): keep the checkpoint's values, or say so with "
                         f"--resume_override={','.join(moved)}")
    return state["step"]


def saved_step(out_dir):
    """(the checkpoint's folder, the step a resume continues from), or (None, None). Reads the
    step alone: the tensors are mapped, not loaded."""
    path = find_checkpoint(out_dir)
    if path is None:
        return None, None
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", mmap=True,
                       weights_only=False)
    return path, state["step"]


def resume_note(cfg, step, argv, end):
    """What Ctrl-C prints: the step the run was at (None: before its first, while it was built),
    the last checkpoint and its step, and the command that continues the run (or, with no
    checkpoint yet, starts it again). `end`: the index of the run's last step."""
    path, saved = saved_step(cfg.out_dir)
    where = (f"at step {step} (of 0-{end})" if step is not None else
             "before the first RL step (while the run was built: warm start, calibration or the "
             "start's evaluation)")
    started = any(os.path.exists(os.path.join(cfg.out_dir, f)) for f in RUN_FILES)
    flag = ["--resume=true"] if path else ["--overwrite=true"] if started else []
    files, keys = split_args(argv)  # every key as --key=value, whichever form was typed
    drop = ("resume", "overwrite") + (() if path else ("resume_override",))  # the flag says which
    args = files + [f"--{k}={v}" for k, v in keys.items() if k not in drop]
    args += flag
    script = sys.argv[0] if os.path.basename(sys.argv[0]) == "train.py" else "train.py"
    world = int(os.environ.get("WORLD_SIZE", 1))
    run = f"torchrun --nproc_per_node={world}" if world > 1 else "python"
    command = " ".join([run, shlex.quote(script)] + [shlex.quote(a) for a in args])
    last = (f"the last checkpoint, {path}, was saved after step {saved - 1}: a resume continues "
            f"from step {saved}" if path else
            f"no checkpoint was saved yet (one every save_every={cfg.save_every} steps)")
    return f"{where}; {last}.\n{'resume' if path else 'start again'} with: {command}"
