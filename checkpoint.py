"""
checkpoint.py: atomic save and exact resume.

    python train.py --save_every=20  # out_dir/ckpt, rewritten every 20 steps and at the end
    python train.py --resume=true    # continue from out_dir/ckpt: the same next loss as unbroken

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
import os
import shutil

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


def load_checkpoint(cfg, model, opt, sampler, dev, extra):
    """Restore what save_checkpoint wrote (into `extra`'s objects too, where both sides have them).
    Returns (the step to continue from, the history)."""
    for path in (os.path.join(cfg.out_dir, "ckpt"), os.path.join(cfg.out_dir, "ckpt.old")):
        if os.path.exists(os.path.join(path, "trainer_state.pt")):
            break
    else:
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
