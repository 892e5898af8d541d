"""
checkpoint.py: atomic save and exact resume.

    python train.py --save_every=20  # out_dir/ckpt, rewritten every 20 steps and at the end
    python train.py --resume=true    # continue from out_dir/ckpt: the same next loss as unbroken
    python train.py --overwrite=true # replace the run in out_dir (without it, the run is refused)

The run's folder (claim_out_dir, before any work): a run refuses an out_dir that holds a run (a
checkpoint or metrics.jsonl) unless resume=true continues it or overwrite=true replaces it, and
resume=true refuses one without a checkpoint. Ctrl-C prints resume_note: the step the run was at,
the last checkpoint and its step, and the command that resumes.

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


# ----------------------------------------------------------------------------- the run's folder

RUN_FILES = ("ckpt", "ckpt.old", "metrics.jsonl")  # what says that a folder holds a run
REPLACED = RUN_FILES + ("ckpt.tmp", "run.png")  # what overwrite=true removes


def claim_out_dir(cfg, rank=0, log=print):
    """Before any work: out_dir is this run's. resume=true needs a checkpoint there; otherwise a
    folder that holds a run (a checkpoint or metrics.jsonl) is refused, unless overwrite=true,
    which removes that run's checkpoint, metrics.jsonl and run.png (rank 0). Then rank 0 writes
    the config to out_dir/config.json."""
    if cfg.resume and cfg.overwrite:
        raise ValueError("config keys 'resume' and 'overwrite': choose one (resume continues the "
                         "run in out_dir, overwrite replaces it)")
    if cfg.resume and find_checkpoint(cfg.out_dir) is None:
        what = ("does not exist" if not os.path.isdir(cfg.out_dir) else
                "holds no checkpoint (ckpt/trainer_state.pt)")
        raise FileNotFoundError(f"resume=true, but out_dir {cfg.out_dir} {what}: give the "
                                f"--out_dir= of the run to continue, or leave out --resume=true")
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
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)


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
    args = [a for a in argv if not a.startswith(("--resume=", "--overwrite="))] + flag
    script = sys.argv[0] if os.path.basename(sys.argv[0]) == "train.py" else "train.py"
    world = int(os.environ.get("WORLD_SIZE", 1))
    run = f"torchrun --nproc_per_node={world}" if world > 1 else "python"
    command = " ".join([run, shlex.quote(script)] + [shlex.quote(a) for a in args])
    last = (f"the last checkpoint, {path}, was saved after step {saved - 1}: a resume continues "
            f"from step {saved}" if path else
            f"no checkpoint was saved yet (one every save_every={cfg.save_every} steps)")
    return f"{where}; {last}.\n{'resume' if path else 'start again'} with: {command}"
